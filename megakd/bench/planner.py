"""The memory/throughput planner: which (ZeRO stage, pipeline stages, micro-batch, checkpointing)
parallel plans fit a GPU, and how long a step will take.

Step time = compute + exposed communication. Compute is the step's hardware FLOPs (flops.py, with
recomputation) at `efficiency` x peak, stretched by the 1F1B pipeline bubble ((m + P - 1) micro-
batch slots of the slowest stage). Memory and communication are counted per DeepSpeed engine (one per
optimized unit), from the config megakd derives for it (`EngineConfigs.derived`: bucket sizes, the
gradient communication dtype) and the optimizer DeepSpeed 0.19 builds for it (bench/memory.py). The
collectives of one step, as DeepSpeed runs them (`collective_bytes`), at the nccl-tests bus bandwidth:
ZeRO-0 and ZeRO-1 all-reduce the gradients once per step (BF16_Optimizer: its whole fp32 buffer); ZeRO-2
all-reduces them bucket by bucket after every micro-batch (`use_multi_rank_bucket_allreduce`, on by
default; a reduce-scatter's bytes with it off); ZeRO-3 reduce-scatters them after every micro-batch and
all-gathers the 16-bit weights once per micro-batch while the model fits `max_live_parameters` and
`max_reuse_distance` (nothing is released between forward and backward), else for forward and again for
backward; ZeRO 1-2 all-gather the updated 16-bit weights after the step, ZeRO-3 its persistent ones.
`overlap` is the share hidden behind compute (0 by default: a conservative upper bound).

Storage (`storage_io`): the loader reads WebDataset tars with ranged reads, each reader (DataLoader
worker, at least one per rank) fetching only the tar members of its own samples, so the job reads
global batch x member bytes x (1 + data.read_overfetch, the gap bytes a ranged read may read through)
per optimizer step from shared storage, plus the member indexes (12 bytes per sample), which each
node fetches once per run into its cache (docs/decisions.md § Reads proportional to the share).
With an aggregate read bandwidth (`--storage-gbps`) the step cannot be shorter than step bytes /
bandwidth.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from megakd.bench.flops import StepFlops, step_flops
from megakd.bench.hardware import Hardware
from megakd.bench.memory import (
    DTYPE_BYTES,
    Block,
    EngineShape,
    GiB,
    ZeroSettings,
    block_activation_bytes,
    engine_state_bytes,
    layer_activation_bytes,
    model_blocks,
)
from megakd.bench.step_time import Assumptions, matmul_class, micro_batch_parts, optimizer_seconds
from megakd.config import Config, ConfigError
from megakd.engine.deepspeed_config import EngineConfigs, merge_user_config

GEMM_EFFICIENCY = Assumptions().gemm_efficiency  # --efficiency's default


@dataclass
class ParallelPlan:
    """How a run is spread over the GPUs: the planner's unit of choice (not a training layout,
    `megakd.engine.layouts`)."""

    zero_stage: int
    pipeline_stages: int
    micro_batch: int
    checkpointing: bool


@dataclass
class Plan:
    layout: ParallelPlan  # named `layout` in --json's output
    dp: int
    accumulation: int
    memory: dict[str, float]  # bytes per device on the fullest pipeline stage
    compute_s: float
    comm_s: float
    step_s: float
    fits: bool

    @property
    def total_gib(self) -> float:
        return self.memory["total"] / GiB

    def to_dict(self) -> dict:
        return {**asdict(self), "total_gib": self.total_gib}


def _stage_flops(blocks: list[Block], cfg: Config, sequences: int, checkpointing: bool) -> list[float]:
    """Hardware FLOPs of each block for `sequences` sequences (embeddings count the projection only)."""
    f = step_flops(cfg, sequences)
    parts = f.parts
    out = []
    for b in blocks:
        enc = getattr(cfg.model, b.model)
        if b.kind == "layer":
            total = parts[f"{b.model}_encoder"]
            per_layer = (total["forward"] + total["backward"]) / enc.num_layers  # embeddings projection spread
            out.append(per_layer * (4 / 3 if checkpointing else 1))
        elif b.kind == "head":
            keys = (["generator_head", "generator_mlm_projection"]
                    if b.model == "generator" else ["discriminator_head"])
            out.append(sum(parts[k]["forward"] + parts[k]["backward"] for k in keys))
        else:
            out.append(0.0)
    return out


def partition(costs: list[float], stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of `costs` into `stages` parts minimising the largest sum."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    ranges, j = [], n
    for k in range(stages, 0, -1):
        ranges.append((cut[k][j], j))
        j = cut[k][j]
    return ranges[::-1]


def evaluate(cfg: Config, hw: Hardware, gpus: int, gpu_mem_gib: float, parallel: ParallelPlan, *,
             efficiency: float = GEMM_EFFICIENCY, overlap: float = 0.0, reserve_gib: float = 2.0,
             tf32: bool = True, blocks: list[Block] | None = None) -> Plan:
    """Memory per device and estimated step time of one parallel plan (`blocks`: model_blocks(cfg), reused)."""
    precision = cfg.train.precision
    matmul = matmul_class(precision, tf32, hw)
    if matmul not in hw.peak_tflops:
        raise ConfigError(f"train.precision={precision}: {hw.name} has no {matmul} peak "
                          f"(known: {', '.join(hw.peak_tflops)})")
    P, b = parallel.pipeline_stages, parallel.micro_batch
    dp = gpus // P
    micro_batches = cfg.train.global_batch_size // (dp * b)
    elem = 4 if precision == "fp32" else 2
    seq = cfg.data.seq_len
    blocks = blocks or model_blocks(cfg)
    flops = _stage_flops(blocks, cfg, b, parallel.checkpointing)
    ranges = partition(flops, P) if P > 1 else [(0, len(blocks))]
    worst: dict[str, float] = {"total": -1.0}
    for s, (lo, hi) in enumerate(ranges):
        mine = blocks[lo:hi]
        engines = [EngineShape.of(unit) for unit in _units(cfg, mine)]
        mem = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "buffers": 0.0, "transient": 0.0}
        volumes = {"all_reduce": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0}
        for shape in engines:
            zero = engine_settings(cfg, parallel.zero_stage, dp, micro_batches, b, shape.params)
            for key, value in engine_state_bytes(shape, parallel.zero_stage, dp, precision, zero).items():
                mem[key] += value
            for key, value in collective_bytes(shape, parallel.zero_stage, dp, precision, zero,
                                               micro_batches).items():
                volumes[key] += value
        zero3 = parallel.zero_stage == 3
        acts = sum(block_activation_bytes(x, getattr(cfg.model, x.model), seq, b, elem, cfg.data.mask_prob,
                                          parallel.checkpointing, zero3) for x in mine)
        if parallel.checkpointing and any(x.kind == "layer" for x in mine):
            acts += max(layer_activation_bytes(getattr(cfg.model, x.model), seq, b, elem, zero3=zero3)
                        for x in mine if x.kind == "layer")  # the one layer being recomputed
        in_flight = min(P - s, micro_batches)  # 1F1B: stage s holds P - s micro-batches
        mem["activations"] = acts * in_flight
        mem["total"] = sum(mem.values())
        if mem["total"] > worst["total"]:
            worst = mem | {"params_on_stage": float(sum(x.params for x in mine))}
            worst_volumes = volumes
    # One micro-batch part by part (step_time.py), the pipeline's slowest stage taking its share of the
    # FLOPs, stretched by the 1F1B bubble; then the optimizer over the stage's local partition.
    assume = Assumptions(gemm_efficiency=efficiency)
    micro = sum(micro_batch_parts(cfg, hw, b, matmul, assume,
                                  checkpointing=parallel.checkpointing).values())
    slowest = max(sum(flops[lo:hi]) for lo, hi in ranges) / sum(flops)
    local = worst["params_on_stage"] / (dp if parallel.zero_stage else 1)
    compute = (micro_batches + P - 1) * micro * slowest + optimizer_seconds(cfg, hw, local, assume)
    comm = _dp_comm_seconds(hw, gpus, dp, worst_volumes)
    if P > 1:  # activations to the next stage forward, their gradients back, per micro-batch and cut
        comm += 2 * micro_batches * (P - 1) / P * seq * b * cfg.model.discriminator.hidden_size * elem / (
            hw.busbw_intra * 1e9)
    step = compute + (1 - overlap) * comm
    fits = worst["total"] <= (gpu_mem_gib - reserve_gib) * GiB
    return Plan(parallel, dp, micro_batches, worst, compute, comm, step, fits)


def _units(cfg: Config, blocks: list[Block]) -> list[list[Block]]:
    """The blocks of each optimized unit (one DeepSpeed engine each): the generator and the discriminator
    under DecoupledOptim, else one unit."""
    if cfg.model.objective == "electra" and cfg.electra.decoupled:
        return [u for u in ([x for x in blocks if x.model == m] for m in ("generator", "discriminator")) if u]
    return [blocks]


def engine_settings(cfg: Config, zero_stage: int, dp: int, accumulation: int, micro_batch: int,
                    parameters: int) -> ZeroSettings:
    """The buffer and collective settings of one engine of `parameters` elements: the DeepSpeed config megakd
    derives for it (`EngineConfigs.derived`) with backend.deepspeed_config merged in, as the backend builds it."""
    backend = replace(cfg.backend, name="deepspeed", zero_stage=zero_stage)
    configs = EngineConfigs(backend, cfg.train.precision, micro_batch)
    derived = configs.derived(0.0, accumulation, dp, parameters)
    merged = merge_user_config(derived, configs.user_config, f"backend.deepspeed_config={backend.deepspeed_config}")
    return ZeroSettings.from_config(merged, cfg.train.precision)


def collective_bytes(shape: EngineShape, zero_stage: int, dp: int, precision: str, zero: ZeroSettings,
                     micro_batches: int) -> dict[str, float]:
    """Bytes one engine's data-parallel collectives move per optimizer step, by kind (the tensor an
    all-reduce reduces, the whole output of an all-gather, the whole input of a reduce-scatter), as
    DeepSpeed 0.19 runs them (module docstring)."""
    w, c, n, m = DTYPE_BYTES[precision], zero.comm_bytes, dp, micro_batches
    out = {"all_reduce": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0}
    if n == 1:
        return out
    if zero_stage == 0:
        out["all_reduce"] = c * shape.params
    elif zero_stage == 1:
        out["all_reduce"] = c * (shape.flat(n) if precision == "bf16" else shape.params)
        out["all_gather"] = w * shape.flat(n)
    elif zero_stage == 2:
        out["all_reduce" if zero.multi_rank_allreduce else "reduce_scatter"] = m * c * shape.params
        out["all_gather"] = w * shape.flat(n)
    else:
        gathered = n * shape.partition(n)  # every parameter padded to a multiple of n
        small, persistent = shape.persistent(n, zero.param_persistence_threshold)
        passes = 1 if zero.keeps_gathered(shape.params - small) else 2  # forward (and backward)
        out["reduce_scatter"] = m * c * gathered
        out["all_gather"] = m * passes * w * (gathered - persistent) + w * persistent
    return out


def _dp_comm_seconds(hw: Hardware, gpus: int, dp: int, volumes: dict[str, float]) -> float:
    """Seconds of data-parallel collectives per step (nccl-tests bus-bandwidth model: an all-gather or a
    reduce-scatter moves (n-1)/n of its bytes over each rank's link, an all-reduce twice that)."""
    if dp == 1:
        return 0.0
    busbw = (hw.busbw_inter if gpus > hw.gpus_per_node else hw.busbw_intra) * 1e9
    share = (dp - 1) / dp
    return share * (2 * volumes["all_reduce"] + volumes["reduce_scatter"] + volumes["all_gather"]) / busbw


def candidate_parallel_plans(cfg: Config, gpus: int, zero: int | None, pp: int | None,
                      micro_batches: list[int] | None, n_blocks: int) -> list[ParallelPlan]:
    """Every valid parallel plan: ZeRO stage x pipeline stages x micro-batch x activation checkpointing.

    DeepSpeed's pipeline engine allows ZeRO stage <= 1; pipeline stages divide the GPUs and are at
    most the number of blocks; the micro-batch times data-parallel ranks divides the global batch.
    Unless `zero` asks for it, no ZeRO-0 plan that accumulates 16-bit gradients over micro-batches:
    DeepSpeed then sums them in bf16/fp16 (megakd's fp32 accumulation needs ZeRO >= 1), which the run
    warns about, so the planner does not offer it.
    """
    global_batch = cfg.train.global_batch_size
    sums_in_16bit = cfg.train.precision != "fp32" and zero is None
    out = []
    for stage in [zero] if zero is not None else [0, 1, 2, 3]:
        for p in [pp] if pp is not None else [d for d in range(1, gpus + 1) if gpus % d == 0]:
            if p > 1 and stage > 1 or p > n_blocks:
                continue
            dp = gpus // p
            if global_batch % dp:
                continue
            sizes = micro_batches or [2**k for k in range(12) if 2**k <= global_batch // dp]
            for b in sizes:
                if (global_batch // dp) % b:
                    continue
                if sums_in_16bit and stage == 0 and global_batch // (dp * b) > 1:
                    continue
                out += [ParallelPlan(stage, p, b, ckpt) for ckpt in (False, True)]
    return out


def plan(cfg: Config, hw: Hardware, gpus: int, gpu_mem_gib: float, *, zero: int | None = None,
         pp: int | None = None, micro_batches: list[int] | None = None, **kwargs) -> list[Plan]:
    """All candidate parallel plans evaluated: the ones that fit first, fastest first."""
    if gpus < 1:
        raise ConfigError(f"--gpus: expected a positive integer, got {gpus}")
    if gpu_mem_gib <= 0:
        raise ConfigError(f"--gpu-mem: expected a positive number of GB, got {gpu_mem_gib}")
    if zero is not None and zero not in (0, 1, 2, 3):
        raise ConfigError(f"--zero: expected 0, 1, 2 or 3, got {zero}")
    if pp is not None and (pp < 1 or gpus % pp):
        raise ConfigError(f"--pp: expected a divisor of --gpus={gpus}, got {pp}")
    if pp is not None and pp > 1 and zero is not None and zero > 1:
        raise ConfigError(f"--zero {zero} --pp {pp}: DeepSpeed pipeline parallelism allows ZeRO stage 0 or 1")
    blocks = model_blocks(cfg)
    candidates = candidate_parallel_plans(cfg, gpus, zero, pp, micro_batches, len(blocks))
    if not candidates:
        raise ConfigError(f"no layout: train.global_batch_size={cfg.train.global_batch_size} cannot be split "
                          f"over {gpus} GPUs with the requested --pp/--micro-batch")
    plans = [evaluate(cfg, hw, gpus, gpu_mem_gib, parallel, blocks=blocks, **kwargs) for parallel in candidates]
    # Equal estimates (to 4 digits) prefer the larger micro-batch: the model assumes GEMM efficiency
    # independent of it, which favours small ones only on paper.
    return sorted(plans, key=lambda p: (not p.fits, float(f"{p.step_s:.4g}"), -p.layout.micro_batch,
                                        p.memory["total"]))


def layout_overrides(cfg: Config, layout: ParallelPlan) -> list[str]:
    """A plan's layout as the `key=value` overrides a launcher line takes (the accumulation follows from
    train.global_batch_size, the micro-batch and the world size the launcher starts)."""
    words = ["backend.name=deepspeed", f"backend.zero_stage={layout.zero_stage}",
             f"backend.pipeline_stages={layout.pipeline_stages}", f"train.micro_batch_size={layout.micro_batch}"]
    models = ("generator", "discriminator") if cfg.model.objective == "electra" else ("generator",)
    return words + [f"model.{m}.activation_checkpointing={str(layout.checkpointing).lower()}" for m in models]


TAR_BLOCK = 512  # a tar member: one 512-byte header block + its data rounded up to whole blocks
NPY_HEADER = 128  # np.save's header of a 1-D uint16/uint32 array (format 1.0, padded to 64 bytes)
INDEX_BYTES_PER_SAMPLE = 12  # a member index record (size and digest), fetched once a run per node


def sample_member_bytes(seq_len: int, vocab_size: int) -> int:
    """Bytes of one sample's tar member in a shard: 512-byte header + the .npy (128-byte header +
    seq_len token ids, uint16 for vocab <= 65536 else uint32) rounded up to a multiple of 512.

    A full-length sample; a shorter one (a document's tail, unpacked) is at most this.
    """
    itemsize = 2 if vocab_size <= 1 << 16 else 4
    payload = NPY_HEADER + seq_len * itemsize
    return TAR_BLOCK + -(-payload // TAR_BLOCK) * TAR_BLOCK


def parse_storage_gbps(value: str | float | None) -> float | None:
    """--storage-gbps as a positive, finite number of GB/s (1 GB = 1e9 bytes); None when not given."""
    if value is None:
        return None
    try:
        gbps = float(value)
    except (TypeError, ValueError):
        gbps = math.nan
    if not (math.isfinite(gbps) and gbps > 0):
        raise ConfigError(f"--storage-gbps: expected a positive number of GB/s (aggregate shared-storage "
                          f"read bandwidth, e.g. 10), got {value!r}")
    return gbps


@dataclass
class StorageIO:
    """What the job reads from shared storage (see the module docstring), independent of the parallel plan."""

    member_bytes: int  # one sample's tar member
    step_bytes: int  # global batch x member bytes x (1 + overfetch): read per optimizer step, job-wide
    nodes: int
    corpus_samples: int
    corpus_source: str  # where corpus_samples comes from
    index_bytes_per_node: int  # 12 bytes x samples, fetched once a run into the node's cache
    readers: int  # workers per rank (at least 1) x ranks (the whole-shard loader read the corpus this often)
    storage_gbps: float | None = None  # aggregate read bandwidth, GB/s; None = unbounded

    @property
    def corpus_bytes(self) -> int:
        return self.corpus_samples * self.member_bytes

    def need_gbps(self, step_s: float) -> float:
        """Job-wide read bandwidth (GB/s) a step of `step_s` seconds needs."""
        return self.step_bytes / step_s / 1e9

    @property
    def storage_s(self) -> float:
        """Seconds the storage needs for one step's reads (0 without a bandwidth)."""
        return self.step_bytes / (self.storage_gbps * 1e9) if self.storage_gbps else 0.0

    def bound_step_s(self, step_s: float) -> float:
        """The step time the run gets: the compute-bound step or the storage-bound one, the larger."""
        return self.storage_s if self.storage_bound(step_s) else step_s

    def storage_bound(self, step_s: float) -> bool:
        """Whether reading a step takes longer than computing it (a bandwidth equal to the need, to
        rounding, is not a bound)."""
        return self.storage_s > step_s * (1 + 1e-9)

    def to_dict(self) -> dict:
        return {**asdict(self), "corpus_bytes": self.corpus_bytes, "storage_s": self.storage_s}


def corpus_samples_of(cfg: Config) -> tuple[int, str]:
    """Samples in the corpus: `num_samples` of <data.shards>/manifest.json when it is there, else one
    pass of the run (train.max_steps x train.global_batch_size)."""
    if cfg.data.shards:
        manifest = Path(cfg.data.shards) / "manifest.json"
        try:
            return int(json.loads(manifest.read_text())["num_samples"]), str(manifest)
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return cfg.train.max_steps * cfg.train.global_batch_size, "assumed: one pass, max_steps x global batch"


def storage_io(cfg: Config, hw: Hardware, gpus: int, *, storage_gbps: str | float | None = None,
               corpus_samples: int | None = None) -> StorageIO:
    """Shared-storage reads of the job on `gpus` GPUs (nodes of hw.gpus_per_node)."""
    gbps = parse_storage_gbps(storage_gbps)
    if corpus_samples is not None and corpus_samples < 1:
        raise ConfigError(f"--corpus-samples: expected a positive number of samples, got {corpus_samples}")
    samples, source = ((corpus_samples, "--corpus-samples") if corpus_samples is not None
                       else corpus_samples_of(cfg))
    vocab = cfg.model.generator.vocab_size
    if not isinstance(vocab, int):
        raise ConfigError(f"model.generator.vocab_size={vocab!r}: the planner needs a resolved vocab size")
    member = sample_member_bytes(cfg.data.seq_len, vocab)
    nodes = -(-gpus // max(hw.gpus_per_node, 1))
    step = math.ceil(cfg.train.global_batch_size * member * (1 + cfg.data.read_overfetch))
    return StorageIO(member, step, nodes, samples, source, INDEX_BYTES_PER_SAMPLE * samples,
                     max(cfg.data.num_workers, 1) * gpus, gbps)


def model_flops(cfg: Config) -> StepFlops:
    """FLOPs of one full optimizer step (global batch) of the config."""
    return step_flops(cfg, cfg.train.global_batch_size)
