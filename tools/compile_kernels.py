"""Compile every Triton launch megakd makes at production shapes for sm_80 and sm_90a, on a CPU machine.

The interpreter that runs the kernel tests never sees registers, spills or shared memory; Triton's own
compiler does, and it needs no GPU: TTIR -> TTGIR -> LLVM IR -> PTX -> cubin runs on the CPU with the
``ptxas`` the triton wheel bundles. Only the launch asks the driver for a target, so this tool stands a
compile-only driver in for it (:class:`CompileOnlyDriver`).

The launches are the wrappers' own: each workload calls the Triton wrappers of ``megakd.kernels`` on CPU
tensors of production shapes inside :func:`megakd.kernels.dispatch.compiling_for`, with ``JITFunction.run``
replaced by a recorder, so every tile, ``num_warps``, ``num_stages``, constexpr and integer
specialization is what the wrapper would launch on that GPU; nothing is copied here. Each recorded
launch is then compiled for its target, and ptxas's ``-v`` log gives registers and spill bytes.

    python tools/compile_kernels.py                         # everything: 100 launches, ~5 min on 2 cores
    python tools/compile_kernels.py --quick                 # the slow test's 44: one dtype per matmul class
    python tools/compile_kernels.py --only head_ce --dtypes bf16 --targets sm_90a --json out.json
    python tools/compile_kernels.py --list                  # the launches (grid, tiles, warps), compiling none

Exit status 1 when any launch fails to compile, spills a register, or needs more shared memory than a
block may have on its target; the table marks each such row. A Triton other than the installed one:
``PYTHONPATH=<folder holding it> python tools/compile_kernels.py`` (how CI compiles pyproject's floor).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import torch
from megakd.kernels.dispatch import CudaTarget, compiling_for

from megakd.bench.planner import GPUS as PLANNER_GPUS


@dataclass(frozen=True)
class Gpu:
    """What a target allows one streaming multiprocessor (CUDA C Programming Guide, compute capability table)."""

    target: CudaTarget
    shared_per_block: int  # bytes a block may opt into
    shared_per_sm: int
    hardware: str  # megakd.bench.planner.GPUS key: its dense matmul peaks
    tf32_tflops: float  # dense TF32 tensor-core peak (datasheet)
    hbm_gbps: float  # memory bandwidth (datasheet)
    registers_per_sm: int = 65536
    warps_per_sm: int = 64
    blocks_per_sm: int = 32


# A100 SXM4 80 GB (sm_80, 108 SMs) and H100 SXM5 (sm_90a, 132 SMs); TF32 and bandwidth from their datasheets.
GPUS = {
    "sm_80": Gpu(CudaTarget(80, 108), shared_per_block=163 * 1024, shared_per_sm=164 * 1024, hardware="a100",
                 tf32_tflops=156.0, hbm_gbps=2039.0),
    "sm_90a": Gpu(CudaTarget(90, 132), shared_per_block=227 * 1024, shared_per_sm=228 * 1024, hardware="h100",
                  tf32_tflops=494.5, hbm_gbps=3350.0),
}

# name -> (activations, weights, allow_tf32): what a GPU run feeds the kernels (docs/decisions.md, "Kernel dtypes").
DTYPES = {
    "fp32": (torch.float32, torch.float32, False),
    "tf32": (torch.float32, torch.float32, True),
    "bf16": (torch.bfloat16, torch.bfloat16, False),
    "fp16": (torch.float16, torch.float16, False),
    "bf16+fp32w": (torch.bfloat16, torch.float32, False),
}
# --quick (the slow test's set): the head in one dtype per matmul class its configuration tables tell apart
# (IEEE fp32, TF32, 16-bit), the kernels without a matmul in the last of them (bf16, the production dtype).
QUICK_DTYPES = ("fp32", "tf32", "bf16")

# Production shapes: the masked tokens of a 32 x 512 batch at 15 % (2,458), BERT-base's hidden size and
# a 128,000-token vocabulary; a 256-wide student under a 768-wide teacher; the sampler over a larger batch.
TOKENS, HIDDEN, VOCAB, STUDENT = 2458, 768, 128_000, 256
SAMPLED_ROWS = 8192
RTD_ROWS, RTD_WIDTHS = 16_384, (768, 128, 8192)


def _empty(*shape: int, dtype: torch.dtype, grad: bool = False) -> torch.Tensor:
    """Never read: the launches are recorded, not run; ``torch.empty`` touches no memory."""
    return torch.empty(*shape, dtype=dtype).requires_grad_(grad)


def _head_ce(act: torch.dtype, wdt: torch.dtype) -> None:
    from megakd.kernels.linear_head_triton import linear_cross_entropy_triton

    hidden = _empty(TOKENS, HIDDEN, dtype=act, grad=True)
    weight, bias = _empty(VOCAB, HIDDEN, dtype=wdt, grad=True), _empty(VOCAB, dtype=wdt, grad=True)
    linear_cross_entropy_triton(hidden, weight, bias, torch.zeros(TOKENS, dtype=torch.long), -100).backward()


def _head_kl(act: torch.dtype, wdt: torch.dtype) -> None:
    from megakd.kernels.linear_head_triton import linear_kl_triton

    student = _empty(TOKENS, STUDENT, dtype=act, grad=True), _empty(VOCAB, STUDENT, dtype=wdt, grad=True)
    teacher = _empty(TOKENS, HIDDEN, dtype=act), _empty(VOCAB, HIDDEN, dtype=wdt)
    linear_kl_triton(*student, None, *teacher, None, 2.0).backward()


def _sample(act: torch.dtype, wdt: torch.dtype) -> None:
    from megakd.kernels.linear_head_triton import linear_sample_triton

    linear_sample_triton(_empty(SAMPLED_ROWS, HIDDEN, dtype=act), _empty(VOCAB, HIDDEN, dtype=wdt),
                         _empty(VOCAB, dtype=wdt), None, 1.0)


def _uniforms(act: torch.dtype, wdt: torch.dtype) -> None:
    from megakd.kernels.linear_head_triton import sampler_uniforms

    sampler_uniforms(0, SAMPLED_ROWS, VOCAB, torch.device("cpu"))


def _rtd(act: torch.dtype, wdt: torch.dtype) -> None:
    from megakd.kernels.rtd_loss_triton import rtd_loss_triton

    labels = torch.zeros(RTD_ROWS, dtype=torch.long)
    mask = torch.ones(RTD_ROWS, dtype=torch.bool)
    for width in RTD_WIDTHS:
        hidden = _empty(RTD_ROWS, width, dtype=act, grad=True)
        rtd_loss_triton(hidden, _empty(width, dtype=wdt, grad=True), _empty((), dtype=wdt, grad=True),
                        labels, labels, mask)
    with torch.no_grad():  # validation: the loss alone
        rtd_loss_triton(_empty(RTD_ROWS, HIDDEN, dtype=act), _empty(HIDDEN, dtype=wdt), _empty((), dtype=wdt),
                        labels, labels, mask)


def _lipschitz(act: torch.dtype, wdt: torch.dtype) -> None:
    from megakd.kernels.lipschitz_triton import column_abs_sums_triton, column_sign_grads_triton

    # A BERT-base layer's matrices in the weights' dtype: attention, the two feed-forward projections.
    weights = [_empty(HIDDEN, HIDDEN, dtype=wdt), _empty(4 * HIDDEN, HIDDEN, dtype=wdt),
               _empty(HIDDEN, 4 * HIDDEN, dtype=wdt)]
    _, argmax = column_abs_sums_triton(weights)
    column_sign_grads_triton(weights, argmax, torch.ones((), dtype=torch.float32))


# Workloads that do not depend on the activations' dtype run once per weight dtype.
WORKLOADS: dict[str, Callable[[torch.dtype, torch.dtype], None]] = {
    "head_ce": _head_ce, "head_kl": _head_kl, "sample": _sample, "rtd": _rtd, "lipschitz": _lipschitz,
    "uniforms": _uniforms,
}
ONE_DTYPE = {"uniforms"}  # its launch takes no tensor of the head's dtypes
TF32_BLIND = {"rtd", "lipschitz", "uniforms"}  # no tl.dot: torch's TF32 flag changes nothing


@dataclass
class Launch:
    kernel: object  # the JITFunction
    grid: tuple
    args: tuple
    kwargs: dict


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """Within: ``kernel[grid](...)`` appends a :class:`Launch` to the yielded list instead of running."""
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    run = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        if warmup:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        launches.append(Launch(self, grid, args, kwargs))
        return None

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = run


class CompileOnlyDriver:
    """The parts of Triton's CUDA driver that ``JITFunction.warmup`` asks: a device, a stream, a target."""

    def __init__(self, target: CudaTarget):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", target.arch, 32)

    def get_current_device(self) -> str:
        return f"compile-only-sm{self.target.arch}"  # a key of JITFunction.device_caches: one per target

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def cost(launch: Launch) -> tuple[float, float, float, str]:
    """(FLOPs, compulsory bytes, tile traffic bytes, peak class) of one launch at its shapes, computed.

    Compulsory bytes: each input read once, each output written once (fp32 atomics read and written
    once): the DRAM traffic if caches kept every reuse. Tile traffic: what the tiles load, store and add
    atomically at the launch's tile sizes (the head reloads its weight tile per row block and its hidden
    tile per vocabulary tile), an upper bound of it. FLOPs count the matmuls (2 per multiply-add) and,
    for the reductions without one, one per element read.
    """
    a = dict(zip(launch.kernel.arg_names, launch.args))
    kw = launch.kwargs
    name = launch.kernel.fn.__name__
    dot = str(kw.get("DOT", ""))
    peak = "bf16" if dot in ("bf16", "fp16") else "tf32" if kw.get("PREC") == "tf32" else "fp32"
    if name in ("_forward_kernel", "_backward_kernel", "_sample_kernel"):
        if name == "_sample_kernel":
            heads = [("h_ptr", "w_ptr", "b_ptr", "HAS_B", "H")]
        else:
            heads = [("hs_ptr", "ws_ptr", "bs_ptr", "HAS_BS", "Hs")] + (
                [("ht_ptr", "wt_ptr", "bt_ptr", "HAS_BT", "Ht")] if kw["KL"] else [])
        n, v = a["N"], a["V"]
        row_blocks, v_tiles = -(-n // kw["BLOCK_N"]), -(-v // kw["BLOCK_V"])
        flops = compulsory = tiles = 0.0
        for hidden, weight, bias, has_bias, width in heads:
            h, w = a[hidden], a[weight]
            flops += 2.0 * n * v * a[width]
            compulsory += _bytes(h) + _bytes(w) + (_bytes(a[bias]) if kw[has_bias] else 0)
            tiles += row_blocks * _bytes(w) + v_tiles * _bytes(h)
        if name == "_backward_kernel":
            # grad_hidden: each program reloads its weight tile and adds a [BLOCK_N, H] block atomically;
            # grad_weight: it reloads its hidden tile and adds a [BLOCK_V, H] block.
            for flag, grad, reloaded, reloads, adds in (("GRAD_H", "gh_ptr", "ws_ptr", row_blocks, v_tiles),
                                                        ("GRAD_W", "gw_ptr", "hs_ptr", v_tiles, row_blocks)):
                if kw[flag]:
                    flops += 2.0 * n * v * a["Hs"]
                    compulsory += 2 * _bytes(a[grad])
                    tiles += reloads * _bytes(a[reloaded]) + adds * 2 * _bytes(a[grad])
        return flops, compulsory, tiles, peak
    if name == "_rtd_kernel":
        h = a["h_ptr"]
        moved = _bytes(h) + (_bytes(a["gh_ptr"]) + _bytes(a["gw_part_ptr"]) if kw["COMPUTE_GRAD"] else 0)
        return 2.0 * h.numel() * (3 if kw["COMPUTE_GRAD"] else 1), moved, moved, "fp32"
    if name in ("_colsum_kernel", "_sign_grad_kernel"):
        shapes = a["shapes"].view(-1, 2)
        size = kw["DTYPE"].primitive_bitwidth // 8
        elements = float((shapes[:, 0] * shapes[:, 1]).sum()) if name == "_colsum_kernel" else float(shapes[:, 0].sum())
        moved = elements * size * (1 if name == "_colsum_kernel" else 2)
        return elements, moved, moved, "fp32"
    moved = a["N"] * a["V"] * 8.0  # _uniform_kernel: float64 uniforms written
    return 0.0, moved, moved, "fp32"


def roofline_seconds(gpu: Gpu, flops: float, moved: float, peak: str) -> tuple[float, str]:
    """The lower bound max(FLOPs / peak, bytes / bandwidth) on ``gpu``, and which term binds."""
    tflops = gpu.tf32_tflops if peak == "tf32" else PLANNER_GPUS[gpu.hardware].peak_tflops[peak]
    compute, memory = flops / (tflops * 1e12), moved / (gpu.hbm_gbps * 1e9)
    return (compute, "compute") if compute >= memory else (memory, "memory")


@dataclass
class Row:
    kernel: str
    variant: str
    dtype: str
    target: str
    grid: tuple
    options: dict  # the launch's constexprs and compiler options (tiles, num_warps, num_stages, ...)
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    shared: int | None = None  # bytes of dynamic shared memory per block
    num_warps: int | None = None
    num_stages: int | None = None
    blocks_per_sm: int | None = None
    limited_by: str = ""
    gflop: float = 0.0
    compulsory_mb: float = 0.0
    tile_traffic_gb: float = 0.0
    roofline_us: float = 0.0  # at the target's datasheet peaks: computed, not measured
    bound: str = ""
    seconds: float = 0.0
    error: str = ""

    @property
    def failures(self) -> list[str]:
        gpu = GPUS[self.target]
        if self.error:
            return [f"compile error: {self.error}"]
        if self.registers is None:  # listed, not compiled
            return []
        out = []
        if self.spill_stores or self.spill_loads:
            out.append(f"spills {self.spill_stores} B stored / {self.spill_loads} B loaded")
        if self.shared > gpu.shared_per_block:
            out.append(f"shared memory {self.shared} B > {gpu.shared_per_block} B per block")
        return out


_VARIANT_FLAGS = ("KL", "GRAD_H", "GRAD_W", "GRAD_B", "COMPUTE_GRAD", "HAS_BS", "HAS_B")


def variant(launch: Launch) -> str:
    """The specialization that tells one launch of a kernel from another: its flags and tiles."""
    kw = launch.kwargs
    flags = [k.lower() for k in _VARIANT_FLAGS if kw.get(k)]
    tiles = "x".join(str(v) for k, v in kw.items() if k.startswith("BLOCK_"))
    return " ".join([*flags, tiles])


def occupancy(gpu: Gpu, registers: int, warps: int, shared: int) -> tuple[int, str]:
    """Resident blocks per SM and what limits them (registers allocated per warp in units of 256)."""
    per_warp = -(-registers * 32 // 256) * 256
    limits = {
        "registers": gpu.registers_per_sm // (per_warp * warps),
        "warps": gpu.warps_per_sm // warps,
        "shared": gpu.shared_per_sm // (shared + 1024) if shared else gpu.blocks_per_sm,  # 1 KiB reserved a block
        "blocks": gpu.blocks_per_sm,
    }
    limit = min(limits, key=limits.get)
    return limits[limit], limit


_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_launch(launch: Launch, target_name: str) -> Row:
    import triton
    from triton.runtime.driver import driver

    gpu = GPUS[target_name]
    row = listed(launch, target_name)
    driver.set_active(CompileOnlyDriver(gpu.target))
    triton.knobs.nvidia.dump_ptxas_log = True  # ptxas -v, printed to stdout
    log = io.StringIO()
    start = time.perf_counter()
    # Compiled afresh, whatever compiled before in this process or on disk: a cache hit skips ptxas and with
    # it the register report (the Lipschitz kernels of bf16 activations with fp32 weights are the fp32 ones).
    launch.kernel.device_caches.clear()
    try:
        with tempfile.TemporaryDirectory(prefix="megakd-compile-") as cache, contextlib.redirect_stdout(log):
            os.environ["TRITON_CACHE_DIR"] = cache
            compiled = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.kwargs)
    except Exception as e:  # any compile failure is a row of the table, not the end of the run
        row.error = " ".join(str(e).split())[:300]
        return row
    finally:
        row.seconds = time.perf_counter() - start
    text = log.getvalue()
    registers = [int(r) for r in _PTXAS_REGISTERS.findall(text)]
    spills = [tuple(map(int, s)) for s in _PTXAS_SPILLS.findall(text)]
    if not registers or not spills:
        row.error = f"no ptxas -v report in the compiler's output: {text[-200:]!r}"
        return row
    row.registers, (row.spill_stores, row.spill_loads) = registers[-1], spills[-1]
    meta = compiled.metadata
    row.shared, row.num_warps, row.num_stages = meta.shared, meta.num_warps, meta.num_stages
    row.blocks_per_sm, row.limited_by = occupancy(gpu, row.registers, row.num_warps, row.shared)
    return row


def listed(launch: Launch, target_name: str) -> Row:
    """The launch as a row of the table, compiled or not."""
    options = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in launch.kwargs.items()}
    flops, compulsory, tiles, peak = cost(launch)
    seconds, bound = roofline_seconds(GPUS[target_name], flops, compulsory, peak)
    return Row(launch.kernel.fn.__name__, variant(launch), "", target_name, tuple(launch.grid), options,
               gflop=flops / 1e9, compulsory_mb=compulsory / 1e6, tile_traffic_gb=tiles / 1e9,
               roofline_us=seconds * 1e6, bound=bound)


def record(workload: str, dtype: str, target_name: str) -> list[Launch]:
    """The launches ``workload`` makes in ``dtype`` on ``target_name``'s GPU (distinct ones, in order)."""
    act, wdt, tf32 = DTYPES[dtype]
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        with compiling_for(GPUS[target_name].target), recorded_launches() as launches:
            WORKLOADS[workload](act, wdt)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    distinct: dict[tuple, Launch] = {}
    for launch in launches:
        distinct.setdefault((launch.kernel.fn.__name__, variant(launch)), launch)
    return list(distinct.values())


def run_job(job: tuple[str, str, str], compile: bool = True) -> list[Row]:
    workload, dtype, target_name = job
    rows = []
    for launch in record(workload, dtype, target_name):
        row = compile_launch(launch, target_name) if compile else listed(launch, target_name)
        row.dtype = "any" if workload in ONE_DTYPE else dtype
        rows.append(row)
    return rows


def jobs_for(workloads: list[str], dtypes: list[str], targets: list[str], quick: bool = False
             ) -> list[tuple[str, str, str]]:
    out = []
    for workload in workloads:
        chosen = [d for d in dtypes if not (workload in TF32_BLIND and d == "tf32")] or dtypes
        if workload in ONE_DTYPE or (quick and workload in TF32_BLIND):
            chosen = chosen[-1:]
        for dtype in chosen:
            out.extend((workload, dtype, target) for target in targets)
    return out


def markdown(rows: list[Row]) -> str:
    lines = ["| kernel | variant | dtype | target | registers | spill st / ld B | shared KiB | warps | stages "
             "| blocks / SM (limit) | GFLOP | MB | FLOP/B | roofline µs | compile s | check |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        check = "; ".join(r.failures) or "ok"
        if r.error:
            blank = "| " * 10
            lines.append(f"| {r.kernel} | {r.variant} | {r.dtype} | {r.target} | {blank}{r.seconds:.1f} | {check} |")
            continue
        lines.append(f"| {r.kernel} | {r.variant} | {r.dtype} | {r.target} | {r.registers} | "
                     f"{r.spill_stores} / {r.spill_loads} | {r.shared / 1024:.0f} | {r.num_warps} | {r.num_stages} | "
                     f"{r.blocks_per_sm} ({r.limited_by}) | {r.gflop:.1f} | {r.compulsory_mb:.0f} | "
                     f"{r.gflop * 1e3 / max(r.compulsory_mb, 1e-9):.3g} | {r.roofline_us:.0f} ({r.bound}) | "
                     f"{r.seconds:.1f} | {check} |")
    return "\n".join(lines)


def _write_json(path: str | None, triton_version: str, rows: list[Row]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"triton": triton_version, "rows": [{**asdict(r), "failures": r.failures} for r in rows]}, f,
                      indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS),
                        help="workloads to compile (default: all)")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=None,
                        help="dtype variants (default: all, or --quick's)")
    parser.add_argument("--targets", nargs="+", choices=list(GPUS), default=list(GPUS))
    parser.add_argument("--quick", action="store_true",
                        help=f"the head in {', '.join(QUICK_DTYPES)} (one dtype per matmul class), the other kernels "
                        f"in {QUICK_DTYPES[-1]}: what the slow test compiles")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes (default: CPUs)")
    parser.add_argument("--list", action="store_true", help="record and print the launches, compile none")
    parser.add_argument("--json", help="also write the rows here as JSON")
    args = parser.parse_args(argv)
    dtypes = args.dtypes or (list(QUICK_DTYPES) if args.quick else list(DTYPES))
    jobs = jobs_for(args.only, dtypes, args.targets, quick=args.quick and not args.dtypes)
    os.environ.pop("TRITON_INTERPRET", None)  # compiled, never interpreted
    import triton

    if args.list:
        rows = [row for job in jobs for row in run_job(job, compile=False)]
        for r in rows:
            print(f"{r.kernel} [{r.variant}] {r.dtype} {r.target}: grid {r.grid} {r.options}")
        _write_json(args.json, triton.__version__, rows)
        return 0
    start = time.perf_counter()
    if args.jobs > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(max_workers=min(args.jobs, len(jobs))) as pool:
            rows = [row for job_rows in pool.map(run_job, jobs) for row in job_rows]
    else:
        rows = [row for job in jobs for row in run_job(job)]
    print(f"triton {triton.__version__}, torch {torch.__version__}: {len(rows)} launches compiled in "
          f"{time.perf_counter() - start:.0f} s ({args.jobs} processes)\n")
    print(markdown(rows))
    _write_json(args.json, triton.__version__, rows)
    failed = [r for r in rows if r.failures]
    for r in failed:
        print(f"FAIL {r.kernel} [{r.variant}] {r.dtype} {r.target}: {'; '.join(r.failures)}", file=sys.stderr)
    print(f"SUMMARY: {len(rows) - len(failed)}/{len(rows)} launches compile spill-free within shared memory")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
