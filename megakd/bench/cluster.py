"""`megakd bench`: measure a cluster the way a 125K-step run will use it.

Runs under any launcher (torchrun, deepspeed, Slurm) through `init_distributed`, at any world size.
Collectives are reported like nccl-tests: for a message of S bytes taking t seconds,
algbw = S / t and busbw = algbw x 2(n-1)/n (all-reduce) or x (n-1)/n (all-gather, reduce-scatter;
S is the full gathered / scattered buffer), so busbw is comparable across world sizes and with the
link speed. Every timing is the slowest rank's (the collective is not done until all are).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import resource
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from megakd.bench.flops import step_flops
from megakd.bench.roofline import matmul_seconds, phase_seconds
from megakd.config import Config
from megakd.engine.backends import default_device, init_distributed
from megakd.engine.units import StepContext, untimed
from megakd.launch import Launch

log = logging.getLogger(__name__)

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's `seconds`."""
    if not _distributed():
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def collective_bandwidth(op: str, size_bytes: int, device: torch.device, iters: int = 5, warmup: int = 2) -> dict:
    """algbw/busbw of one collective on a `size_bytes` fp32 message (nccl-tests conventions)."""
    n = dist.get_world_size() if _distributed() else 1
    elems = max(n, size_bytes // 4 // n * n)  # the buffer splits evenly over ranks
    full = torch.ones(elems, dtype=torch.float32, device=device)
    part = torch.ones(elems // n, dtype=torch.float32, device=device)

    def once() -> None:
        if not _distributed():
            return
        if op == "all_reduce":
            dist.all_reduce(full)
        elif op == "all_gather":
            dist.all_gather_single(full, part)
        else:
            dist.reduce_scatter_single(part, full)

    for _ in range(warmup):
        once()
    _sync(device)
    if _distributed():
        dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        once()
    _sync(device)
    seconds = _slowest((time.perf_counter() - start) / iters, device)
    size = elems * 4
    algbw = size / seconds / 1e9
    return {"bytes": size, "time_us": seconds * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * BUS_FACTOR[op](n)}


def matmul_tflops(precision: str, device: torch.device, n: int = 2048, iters: int = 5) -> dict:
    """Dense [n x n] @ [n x n] throughput per device, in TFLOP/s (2n^3 per product, fastest of `iters`)."""
    seconds = _slowest(matmul_seconds(DTYPES[precision], device, n, iters), device)
    return {"n": n, "time_ms": seconds * 1e3, "tflops": 2 * n**3 / seconds / 1e12}


def loader_throughput(cfg: Config, batches: int, rank: int, world_size: int) -> dict:
    """Samples/s of the real PretrainingLoader (shards, decoding, masking): this rank's, and all ranks'
    (every rank reads the same number of batches; the slowest rank sets the pace)."""
    from megakd.data.tokenizer import Tokenizer
    from megakd.engine.pretrain import build_loader, resolve_data
    from megakd.finish import finish_config

    tokenizer_dir, shards_dir = resolve_data(cfg)
    tokenizer = Tokenizer.load(tokenizer_dir)
    finish_config(cfg, tokenizer)
    loader = build_loader(cfg, tokenizer, shards_dir, cfg.train.micro_batch_size, rank, world_size)
    it = iter(loader)
    next(it)  # worker start-up is not throughput
    start = time.perf_counter()
    samples = sum(next(it)["input_ids"].shape[0] for _ in range(batches))
    seconds = time.perf_counter() - start
    per_rank = samples / seconds
    total = samples * (dist.get_world_size() if _distributed() else 1) / _slowest(seconds, torch.device("cpu"))
    return {"micro_batch_size": cfg.train.micro_batch_size, "num_workers": cfg.data.num_workers,
            "batches": batches, "samples_per_s_per_rank": per_rank, "samples_per_s": total}


class _PhaseTimer:
    """Wall time per phase of real training steps, through the backend contract's timing hook.

    `StepContext.timer` wraps every forward, backward and optimizer phase of a step. Under DDP the
    gradient all-reduce is made synchronous through a comm hook (a real `all_reduce` of each
    bucket), so its time is measured and taken out of backward; elsewhere it stays inside backward
    (and `communication` is None). The pipeline backend reports no phases (DeepSpeed interleaves
    them over the stages).
    """

    def __init__(self, units, device: torch.device) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.comm_measured = False
        self.device = device
        for unit in units:
            if isinstance(unit.wrapped, torch.nn.parallel.DistributedDataParallel):
                unit.wrapped.register_comm_hook(None, self._allreduce_hook)
                self.comm_measured = True

    @contextlib.contextmanager
    def __call__(self, phase: str):
        _sync(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            _sync(self.device)
            self.seconds[phase] += time.perf_counter() - start

    def _allreduce_hook(self, _state, bucket):  # no annotations: DDP compares them as objects, not strings
        start = time.perf_counter()
        buffer = bucket.buffer()
        dist.all_reduce(buffer)
        buffer.div_(dist.get_world_size())
        _sync(self.device)
        self.seconds["communication"] += time.perf_counter() - start
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(buffer)
        return future


def training_throughput(cfg: Config, steps: int, warmup: int, peak_tflops: float | None,
                        matmul_n: int = 2048, profile_steps: int = 2) -> dict:
    """Tokens/s, samples/s, step-time split, peak memory and MFU of real training steps of `cfg`.

    Without `peak_tflops` the peak is a dense matmul at the training precision measured right
    after the timed steps (same process, threads and machine load). `profile_steps` more steps run
    under `torch.profiler` to split the step into data, generator, sampling, discriminator and
    optimizer time.
    """
    from megakd.engine.pretrain import build_trainer

    trainer = build_trainer(cfg)
    backend, layout, rng = trainer.backend, trainer.layout, trainer.loop.streams.sampling
    batches: Iterator = iter(trainer.loader)
    step_index = 0

    def train_step(timer=None) -> float:
        """One step through the backend contract; returns this rank's non-padding tokens."""
        nonlocal step_index
        context = StepContext(index=step_index, rng=rng, timer=timer or untimed)
        result = backend.train_step(layout, batches, context)
        step_index += result.norms is not None
        return float(result.stats["tokens"]) if "tokens" in result.stats else 0.0

    for _ in range(warmup):
        train_step()
    timer = _PhaseTimer(layout.units.values(), backend.device)
    if backend.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(backend.device)
    backend.barrier()
    start = time.perf_counter()
    local_tokens = sum(train_step(timer) for _ in range(steps))
    _sync(backend.device)
    elapsed = _slowest(time.perf_counter() - start, backend.device)
    world = backend.world_size
    tokens = float(backend.all_reduce_sum(torch.tensor(local_tokens, dtype=torch.float64)).item())
    per_step = {k: _slowest(v, backend.device) / steps for k, v in timer.seconds.items()}
    if timer.comm_measured:
        per_step["backward"] -= per_step.get("communication", 0.0)
    step_s = elapsed / steps
    per_step["other"] = max(0.0, step_s - sum(per_step.values()))
    flops = step_flops(cfg, cfg.train.global_batch_size, trainer.loader.seq_len)
    peak_source = "--peak-tflops"
    if peak_tflops is None:
        peak_tflops, peak_source = _measured_peak(cfg.train.precision, backend.device, matmul_n)
    split = phase_seconds(train_step, profile_steps, backend.device)
    split = {k: _slowest(v, backend.device) for k, v in split.items()}
    peak_mem, mem_kind = _peak_memory(backend.device)
    achieved = flops.model / step_s / world / 1e12
    result = {
        "steps": steps, "world_size": world, "backend": backend.name, "precision": cfg.train.precision,
        "global_batch_size": cfg.train.global_batch_size, "seq_len": trainer.loader.seq_len,
        "step_s": step_s, "samples_per_s": cfg.train.global_batch_size / step_s,
        "tokens_per_s": tokens / elapsed,  # non-padding tokens, all ranks
        "phases_s": {k: per_step.get(k) for k in ("forward", "backward", "communication", "optimizer", "other")},
        "peak_memory_bytes": peak_mem, "peak_memory_kind": mem_kind,
        "phase_split_s": split,
        "model_flops_per_step": flops.model, "hardware_flops_per_step": flops.hardware,
        "model_flops_per_token": flops.per_token,
        "achieved_tflops_per_device": achieved, "peak_tflops": peak_tflops, "peak_source": peak_source,
        "mfu": achieved / peak_tflops if peak_tflops else None,
    }
    if not timer.comm_measured:
        result["phases_s"]["communication"] = None
    # Drop the DDP wrappers (and their comm hooks) before the process group goes: destroying the
    # group under live reducers made a rank abort at exit ("terminate called without an active
    # exception") in about one run in four.
    backend.barrier()
    for unit in trainer.units.values():
        unit.wrapped = None
    del trainer, timer
    gc.collect()
    backend.close()
    return result


def _measured_peak(precision: str, device: torch.device, matmul_n: int) -> tuple[float, str]:
    """(TFLOP/s, how it was measured) of a dense matmul at `precision`: the slowest rank's."""
    matmul_s = _slowest(matmul_seconds(DTYPES[precision], device, matmul_n), device)
    source = f"measured {precision} matmul n={matmul_n}, {torch.get_num_threads()} threads"
    return 2 * matmul_n**3 / matmul_s / 1e12, source


def _peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what they count): the allocator's peak on CUDA, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS"


def run_bench(cfg: Config, *, parts: tuple[str, ...], sizes: list[int], iters: int, matmul_n: int,
              loader_batches: int, train_steps: int, train_warmup: int, peak_tflops: float | None) -> dict:
    """Every requested measurement, as one JSON-able dict (identical on all ranks)."""
    rank, world, local_rank = init_distributed(Launch.from_environ(), cfg.backend.dist_backend)
    device = default_device(local_rank)
    out: dict = {"world_size": world, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                 else "cpu", "dist_backend": dist.get_backend() if _distributed() else None,
                 "torch_threads": torch.get_num_threads()}
    if "collectives" in parts and not _distributed():
        log.info("bench: collectives need two or more processes (torchrun/deepspeed/srun): skipped")
    elif "collectives" in parts:
        out["collectives"] = {op: [collective_bandwidth(op, s, device, iters) for s in sizes] for op in COLLECTIVES}
    if "matmul" in parts:
        precisions = ["fp32", "bf16"] + (["fp16"] if device.type == "cuda" else [])
        out["matmul"] = {p: matmul_tflops(p, device, matmul_n, iters) for p in precisions}
    if "loader" in parts:
        out["loader"] = loader_throughput(cfg, loader_batches, rank, world)
    if "train" in parts:
        if world > 1 and cfg.backend.name == "single":
            log.info("bench: %d processes with backend.name=single: measuring training with ddp", world)
            cfg.backend.name = "ddp"
        out["train"] = training_throughput(cfg, train_steps, train_warmup, peak_tflops, matmul_n)
    elif _distributed():
        with contextlib.suppress(RuntimeError):
            dist.destroy_process_group()
    return out
