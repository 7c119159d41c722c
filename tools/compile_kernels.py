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

    python tools/compile_kernels.py                         # everything: 164 launches, ~1 min on 2 cores (warm)
    python tools/compile_kernels.py --quick                 # the slow test's 74: one dtype per matmul class
    python tools/compile_kernels.py --only head_ce --dtypes bf16 --targets sm_90a --json out.json
    python tools/compile_kernels.py --list                  # the launches (grid, tiles, warps), compiling none

Each compiled launch's PTX is also read (:func:`read_ptx`): its atomics (semantics, scope, whether a loop
repeats them), its float64 instructions (how many a loop repeats), and the grid against the target's SMs.

Exit status 1 when any launch fails to compile, spills a register, needs more shared memory than a
block may have on its target, repeats an atomic stronger than relaxed in a loop, or (a linear-head
kernel without fp64 inputs) repeats float64 arithmetic in a loop; the table marks each such row.
A Triton other than the installed one:
``PYTHONPATH=<folder holding it> python tools/compile_kernels.py`` (how CI compiles pyproject's floor).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
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

from megakd.bench.hardware import GPUS as HARDWARE


@dataclass(frozen=True)
class Gpu:
    """What a target allows one streaming multiprocessor (CUDA C Programming Guide, compute capability table)."""

    target: CudaTarget
    shared_per_block: int  # bytes a block may opt into
    shared_per_sm: int
    hardware: str  # megakd.bench.hardware.GPUS key: its datasheet peaks and memory bandwidth
    registers_per_sm: int = 65536
    warps_per_sm: int = 64
    blocks_per_sm: int = 32


# A100 SXM4 80 GB (sm_80, 108 SMs) and H100 SXM5 (sm_90a, 132 SMs).
GPUS = {
    "sm_80": Gpu(CudaTarget(80, 108), shared_per_block=163 * 1024, shared_per_sm=164 * 1024, hardware="a100"),
    "sm_90a": Gpu(CudaTarget(90, 132), shared_per_block=227 * 1024, shared_per_sm=228 * 1024, hardware="h100"),
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
# electra-base's attention: batch, heads, length, head dim; T5's 32 buckets
ATTENTION_SHAPE, ATTENTION_BUCKETS = (32, 12, 512, 64), 32


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


def _head_ce_sample(act: torch.dtype, wdt: torch.dtype) -> None:
    """The ELECTRA generator's head: the loss and the replacements from one forward launch."""
    from megakd.kernels.linear_head_triton import linear_cross_entropy_and_sample_triton

    hidden = _empty(TOKENS, HIDDEN, dtype=act, grad=True)
    weight, bias = _empty(VOCAB, HIDDEN, dtype=wdt, grad=True), _empty(VOCAB, dtype=wdt, grad=True)
    loss, _, _ = linear_cross_entropy_and_sample_triton(hidden, weight, bias, torch.zeros(TOKENS, dtype=torch.long),
                                                        -100, None, 1.0)
    loss.backward()


def _noise(act: torch.dtype, wdt: torch.dtype) -> None:
    from megakd.kernels.linear_head_triton import sampler_noise

    sampler_noise(0, SAMPLED_ROWS, VOCAB, torch.device("cpu"))


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


def _attention(act: torch.dtype, wdt: torch.dtype) -> None:
    """electra-base's self-attention with T5 relative positions, padding and attention dropout 0.1."""
    from megakd.kernels.attention_triton import relative_attention_triton

    batch, heads, length, dim = ATTENTION_SHAPE
    q, k, v = (_empty(batch, heads, length, dim, dtype=act, grad=True) for _ in range(3))
    table = _empty(ATTENTION_BUCKETS, heads, dtype=wdt, grad=True)
    buckets = torch.zeros(2 * length - 1, dtype=torch.long)
    key_mask = torch.ones(batch, length, dtype=torch.bool)
    relative_attention_triton(q, k, v, table, buckets, key_mask, None, 0.1, 0).backward(
        torch.empty(batch, heads, length, dim, dtype=act))


# Workloads that do not depend on the activations' dtype run once per weight dtype.
WORKLOADS: dict[str, Callable[[torch.dtype, torch.dtype], None]] = {
    "head_ce": _head_ce, "head_ce_sample": _head_ce_sample, "head_kl": _head_kl, "sample": _sample, "rtd": _rtd,
    "lipschitz": _lipschitz, "noise": _noise, "attention": _attention,
}
ONE_DTYPE = {"noise"}  # its launch takes no tensor of the head's dtypes
# torch's TF32 flag changes nothing: no tl.dot, or (attention) IEEE fp32 dots whatever it says
TF32_BLIND = {"rtd", "lipschitz", "noise", "attention"}


@dataclass
class Launch:
    kernel: object  # the JITFunction
    grid: tuple
    args: tuple
    kwargs: dict
    label: str = ""  # a launch only a non-default choice makes: the choice (see ``record``)


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """Within: ``kernel[grid](...)`` appends a :class:`Launch` to the yielded list instead of running,
    compiled kernels and interpreted ones (tools/bench_kernels_cuda.py's CPU rehearsal) alike. The chunked
    head backward's GEMMs (cuBLAS on a GPU) return empty results of their shapes instead of computing:
    at production shapes a CPU fp16 GEMM takes minutes, and only the Triton launches are compiled."""
    from megakd.kernels import chunked_grads
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    runs = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}
    gemms = chunked_grads._mm, chunked_grads._addmm
    chunked_grads._mm = lambda a, b, out_dtype: torch.empty(a.shape[0], b.shape[1], dtype=out_dtype)
    chunked_grads._addmm = lambda c, a, b: c

    def recorder(run):
        def record(self, *args, grid, warmup, **kwargs):
            if warmup:
                return run(self, *args, grid=grid, warmup=warmup, **kwargs)
            launches.append(Launch(self, grid, args, kwargs))
            return None
        return record

    for cls, run in runs.items():
        cls.run = recorder(run)
    try:
        yield launches
    finally:
        for cls, run in runs.items():
            cls.run = run
        chunked_grads._mm, chunked_grads._addmm = gemms


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


# attention kernel -> (matmuls per score, [B, heads, L, d] tensors written, more of them read)
ATTENTION_MATMULS = {"_attention_forward_kernel": (2, 1, 0), "_attention_dq_kernel": (3, 1, 2),
                     "_attention_dkdv_kernel": (4, 2, 1)}


def cost(launch: Launch) -> tuple[float, float, float, str] | None:
    """(FLOPs, compulsory bytes, tile traffic bytes, peak class) of one launch at its shapes, computed;
    None for a kernel this function has no model of (its row says so, and nothing is predicted for it).

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
    if name in ("_forward_kernel", "_backward_kernel", "_grad_logits_kernel"):
        heads = [("hs_ptr", "ws_ptr", "bs_ptr", "HAS_BS", "Hs")] + (
            [("ht_ptr", "wt_ptr", "bt_ptr", "HAS_BT", "Ht")] if kw["KL"] else [])
        # the chunked backward's first half covers rows ROW0 .. N of the hidden states: one chunk
        row0 = a.get("ROW0", 0) if name == "_grad_logits_kernel" else 0
        n, v = a["N"] - row0, a["V"]
        row_blocks, v_tiles = -(-n // kw["BLOCK_N"]), -(-v // kw["BLOCK_V"])
        flops = compulsory = tiles = 0.0
        for hidden, weight, bias, has_bias, width in heads:
            h_bytes, w = n * a[width] * a[hidden].element_size(), a[weight]
            flops += 2.0 * n * v * a[width]
            compulsory += h_bytes + _bytes(w) + (_bytes(a[bias]) if kw[has_bias] else 0)
            tiles += row_blocks * _bytes(w) + v_tiles * h_bytes
        if name == "_grad_logits_kernel":  # writes d(loss)/d(logits) and the bias's per-row-block sums
            written = _bytes(a["dz_ptr"]) + (_bytes(a["gb_ptr"]) if kw["GRAD_B"] else 0)
            return flops, compulsory + written, tiles + written, peak
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
    if name == "_noise_kernel":
        moved = a["N"] * a["V"] * 4.0  # fp32 Gumbel noise written
        return 0.0, moved, moved, "fp32"
    if name in ATTENTION_MATMULS:
        # [B, heads, L, d] tensors: q, k, v read; the forward writes o, the dQ kernel reads o and dO and writes
        # dQ, the dK/dV kernel reads dO and writes dK and dV. Each program reloads the other side's two tensors
        # (k and v; or q and dO) once per block of its own side.
        q = a["q_ptr"]
        heads_rows, length, dim = q.shape[0] * q.shape[1], q.shape[2], q.shape[3]
        matmuls, written, read = ATTENTION_MATMULS[name]
        flops = 2.0 * matmuls * heads_rows * length * length * dim
        own = "BLOCK_N" if name == "_attention_dkdv_kernel" else "BLOCK_M"
        tensor = _bytes(q)
        compulsory = (3 + read + written) * tensor
        tiles = (1 + read + written) * tensor + -(-length // kw[own]) * 2 * tensor
        return flops, compulsory, tiles, peak
    return None


def launch_roofline(launch: Launch, target_name: str) -> tuple[float, str] | None:
    """(seconds, "compute" | "memory") of ``launch`` on ``target_name`` at datasheet peaks, None without a
    cost model: what tools/bench_kernels_cuda.py prints beside its measured times."""
    computed = cost(launch)
    return None if computed is None else roofline_seconds(GPUS[target_name], computed[0], computed[1], computed[3])


def roofline_seconds(gpu: Gpu, flops: float, moved: float, peak: str) -> tuple[float, str]:
    """The lower bound max(FLOPs / peak, bytes / bandwidth) on ``gpu``, and which term binds."""
    hardware = HARDWARE[gpu.hardware]
    compute, memory = flops / (hardware.peak_tflops[peak] * 1e12), moved / (hardware.hbm_gbps * 1e9)
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
    gflop: float | None = None  # these five None: no cost model of the kernel (``cost``)
    compulsory_mb: float | None = None
    tile_traffic_gb: float | None = None
    roofline_us: float | None = None  # at the target's datasheet peaks: computed, not measured
    bound: str | None = None
    programs: int = 0
    sms: int = 0
    waves: float | None = None  # programs / (SMs x blocks per SM); None under one wave's SMs or uncompiled
    grid_use: str = ""
    atomics: tuple = ()  # PtxFacts.atomics
    f64: int | None = None
    f64_in_loop: int | None = None
    fp32_head: bool = False  # a linear-head launch without fp64 inputs: float64 in a loop fails it
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
        ordered = [a for a in self.atomics if a["in_loop"] and a["sem"] != "relaxed"]
        if ordered:
            out.append(f"{sum(a['count'] for a in ordered)} atomics stronger than relaxed inside a loop ("
                       + ", ".join(f"{a['count']} x {a['instruction']}" for a in ordered) + "): pass sem='relaxed'")
        if self.fp32_head and self.f64_in_loop:
            out.append(f"{self.f64_in_loop:,} float64 instructions inside a loop of a linear-head kernel")
        return out


_VARIANT_FLAGS = ("KL", "LOSS", "SAMPLE", "GRAD_H", "GRAD_W", "GRAD_B", "COMPUTE_GRAD", "HAS_BS", "HAS_B")


def variant(launch: Launch) -> str:
    """The specialization that tells one launch of a kernel from another: its flags and tiles."""
    kw = launch.kwargs
    flags = [k.lower() for k in _VARIANT_FLAGS if kw.get(k)]
    tiles = "x".join(str(v) for k, v in kw.items() if k.startswith("BLOCK_"))
    return " ".join([*([launch.label] if launch.label else []), *flags, tiles])


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


# PTX, one instruction or label a line once comments are dropped: `$L__BB0_2:` labels a basic block,
# `@%p3 bra $L__BB0_2;` branches to one (predicated or not), directives start with a dot.
_PTX_LABEL = re.compile(r"^(\$[\w$]+):$")
_PTX_BRANCH = re.compile(r"^(?:@!?%\w+\s+)?bra(?:\.uni)?\s+(\$[\w$]+)\s*;$")
_PTX_OPCODE = re.compile(r"^(?:@!?%\w+\s+)?([a-z][\w.:]*)")
ATOMIC_SEMANTICS = ("relaxed", "acquire", "release", "acq_rel")
ATOMIC_SCOPES = ("cta", "cluster", "gpu", "sys")
_F64_MOVES = {"ld", "st", "mov"}  # data movement: an fp64 load or store is no float64 arithmetic


@dataclass(frozen=True)
class PtxFacts:
    """What a GPU engineer reads off a kernel's PTX first: atomics and float64 work, and which a loop repeats."""

    atomics: tuple[dict, ...]  # one per distinct (instruction, sem, scope, in_loop): with its count
    f64: int  # float64 instructions: arithmetic, comparisons, selects, conversions to or from f64
    f64_in_loop: int


def ptx_lines(ptx: str) -> list[str]:
    """The labels and instructions of ``ptx`` in order, comments, directives and braces dropped."""
    out = []
    for line in ptx.splitlines():
        line = line.split("//", 1)[0].strip().strip("{}").strip()
        if line and not line.startswith("."):
            out.append(line)
    return out


def loop_lines(lines: list[str]) -> list[bool]:
    """For each of ``lines`` (:func:`ptx_lines`): whether a loop repeats it.

    A loop is a branch back to a label above it; every line from the label to the branch is inside.
    LLVM places some of a loop's blocks above its header and enters them by fall-through (a rotated
    loop: the sampler's), so the span starts at the branch's target, not at the header.
    """
    inside = [False] * len(lines)
    labels: dict[str, int] = {}
    for i, line in enumerate(lines):
        label, branch = _PTX_LABEL.match(line), _PTX_BRANCH.match(line)
        if label:
            labels[label.group(1)] = i
        elif branch and branch.group(1) in labels:  # only labels already seen: a backward branch
            inside[labels[branch.group(1)]:i + 1] = [True] * (i + 1 - labels[branch.group(1)])
    return inside


def read_ptx(ptx: str) -> PtxFacts:
    """Atomics and float64 instructions of one kernel's PTX. An ``atom``/``red`` without ``.sem`` is
    relaxed and without a scope ``.gpu``: the PTX ISA's defaults."""
    lines = ptx_lines(ptx)
    atomics: dict[tuple, int] = {}
    f64 = f64_in_loop = 0
    for line, in_loop in zip(lines, loop_lines(lines)):
        opcode = _PTX_OPCODE.match(line)
        if opcode is None:  # a label
            continue
        parts = opcode.group(1).split(".")
        if parts[0] in ("atom", "red"):
            sem = next((p for p in parts if p in ATOMIC_SEMANTICS), "relaxed")
            scope = next((p for p in parts if p in ATOMIC_SCOPES), "gpu")
            key = (opcode.group(1), sem, scope, in_loop)
            atomics[key] = atomics.get(key, 0) + 1
        elif "f64" in parts and parts[0] not in _F64_MOVES:
            f64 += 1
            f64_in_loop += in_loop
    return PtxFacts(tuple({"instruction": i, "sem": sem, "scope": scope, "in_loop": loop, "count": n}
                          for (i, sem, scope, loop), n in atomics.items()), f64, f64_in_loop)


def grid_use(grid: tuple, sms: int, blocks_per_sm: int | None) -> tuple[int, float | None, str]:
    """(programs, waves, a sentence): the grid against the target's SMs and the blocks each SM holds."""
    programs = math.prod(grid)
    said = f"{programs:,} programs"
    if len(grid) > 1:
        said = f"{' x '.join(f'{g:,}' for g in grid)} = {said}"
    if programs < sms:
        return programs, None, f"{said} on {sms} SMs: {100 * programs / sms:.0f} % of the SMs"
    if blocks_per_sm is None:  # listed, not compiled: no occupancy
        return programs, None, f"{said} on {sms} SMs"
    waves = programs / (sms * blocks_per_sm)
    return programs, waves, f"{said} = {waves:.3g} waves of {sms} SMs x {blocks_per_sm}"


_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_only(launch: Launch, target_name: str) -> tuple[object, str]:
    """(the compiled kernel, the compiler's output with ptxas -v's report) of ``launch`` for its target."""
    import triton
    from triton.runtime.driver import driver

    driver.set_active(CompileOnlyDriver(GPUS[target_name].target))
    triton.knobs.nvidia.dump_ptxas_log = True  # ptxas -v, printed to stdout
    log = io.StringIO()
    # Compiled afresh, whatever compiled before in this process or on disk: a cache hit skips ptxas and with
    # it the register report (the Lipschitz kernels of bf16 activations with fp32 weights are the fp32 ones).
    launch.kernel.device_caches.clear()
    with tempfile.TemporaryDirectory(prefix="megakd-compile-") as cache, contextlib.redirect_stdout(log):
        os.environ["TRITON_CACHE_DIR"] = cache
        compiled = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.kwargs)
    return compiled, log.getvalue()


def compile_launch(launch: Launch, target_name: str) -> Row:
    gpu = GPUS[target_name]
    row = listed(launch, target_name)
    start = time.perf_counter()
    try:
        compiled, text = compile_only(launch, target_name)
    except Exception as e:  # any compile failure is a row of the table, not the end of the run
        row.error = " ".join(str(e).split())[:300]
        return row
    finally:
        row.seconds = time.perf_counter() - start
    registers = [int(r) for r in _PTXAS_REGISTERS.findall(text)]
    spills = [tuple(map(int, s)) for s in _PTXAS_SPILLS.findall(text)]
    if not registers or not spills:
        row.error = f"no ptxas -v report in the compiler's output: {text[-200:]!r}"
        return row
    row.registers, (row.spill_stores, row.spill_loads) = registers[-1], spills[-1]
    meta = compiled.metadata
    row.shared, row.num_warps, row.num_stages = meta.shared, meta.num_warps, meta.num_stages
    row.blocks_per_sm, row.limited_by = occupancy(gpu, row.registers, row.num_warps, row.shared)
    row.programs, row.waves, row.grid_use = grid_use(row.grid, row.sms, row.blocks_per_sm)
    facts = read_ptx(compiled.asm["ptx"])
    row.atomics, row.f64, row.f64_in_loop = facts.atomics, facts.f64, facts.f64_in_loop
    return row


def listed(launch: Launch, target_name: str) -> Row:
    """The launch as a row of the table, compiled or not."""
    options = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in launch.kwargs.items()}
    sms = GPUS[target_name].target.multiprocessors
    programs, _, use = grid_use(tuple(launch.grid), sms, None)
    head = launch.kernel.fn.__module__.rsplit(".", 1)[-1] in ("linear_head_triton", "attention_triton")
    row = Row(launch.kernel.fn.__name__, variant(launch), "", target_name, tuple(launch.grid), options,
              programs=programs, sms=sms, grid_use=use, fp32_head=head and options.get("ACC") != "fp64")
    computed = launch_roofline(launch, target_name)
    if computed:
        row.roofline_us, row.bound = computed[0] * 1e6, computed[1]
        flops, compulsory, tiles, _ = cost(launch)
        row.gflop, row.compulsory_mb, row.tile_traffic_gb = flops / 1e9, compulsory / 1e6, tiles / 1e9
    return row


def _atomic_head_backward() -> contextlib.AbstractContextManager:
    from megakd.kernels.dispatch import head_backward

    return head_backward("atomic")


# Choices besides the default that production may still make, recorded too so that they keep compiling
# and being checked: (label, context) per workload. The head's atomic backward is kept as an option
# beside the default one (kernels.dispatch.HEAD_BACKWARDS); its launches are labelled "atomic-bwd".
ALSO_RECORDED: dict[str, tuple[tuple[str, Callable[[], contextlib.AbstractContextManager]], ...]] = {
    "head_ce": (("atomic-bwd", _atomic_head_backward),), "head_kl": (("atomic-bwd", _atomic_head_backward),),
}


def record(workload: str, dtype: str, target_name: str) -> list[Launch]:
    """The launches ``workload`` makes in ``dtype`` on ``target_name``'s GPU (distinct ones, in order),
    then those only its :data:`ALSO_RECORDED` choices make, labelled."""
    act, wdt, tf32 = DTYPES[dtype]
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    distinct: dict[tuple, Launch] = {}
    try:
        for label, choice in (("", contextlib.nullcontext), *ALSO_RECORDED.get(workload, ())):
            with compiling_for(GPUS[target_name].target), choice(), recorded_launches() as launches:
                WORKLOADS[workload](act, wdt)
            for launch in launches:
                if (launch.kernel.fn.__name__, variant(launch)) not in distinct:
                    distinct[launch.kernel.fn.__name__, variant(launch)] = launch
                    launch.label = label
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
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


def atomics_cell(atomics: tuple) -> str:
    """E.g. "6 acq_rel.gpu in loops, 1 acq_rel.gpu": atomic instructions by semantics, scope and loop."""
    counts: dict[str, int] = {}
    for a in atomics:
        key = f"{a['sem']}.{a['scope']}{' in loops' if a['in_loop'] else ''}"
        counts[key] = counts.get(key, 0) + a["count"]
    return ", ".join(f"{n} {key}" for key, n in counts.items()) or "none"


def _cost_cells(r: Row) -> str:
    if r.bound is None:
        return "no cost model | | |"
    return (f"{r.gflop:.1f} | {r.compulsory_mb:.0f} | {r.gflop * 1e3 / max(r.compulsory_mb, 1e-9):.3g} | "
            f"{r.roofline_us:.0f} ({r.bound})")


def markdown(rows: list[Row]) -> str:
    lines = ["| kernel | variant | dtype | target | registers | spill st / ld B | shared KiB | warps | stages "
             "| blocks / SM (limit) | grid on the SMs | atomics | f64 (in loops) | GFLOP | MB | FLOP/B | roofline µs "
             "| compile s | check |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        check = "; ".join(r.failures) or "ok"
        if r.error:
            blank = "| " * 13
            lines.append(f"| {r.kernel} | {r.variant} | {r.dtype} | {r.target} | {blank}{r.seconds:.1f} | {check} |")
            continue
        lines.append(f"| {r.kernel} | {r.variant} | {r.dtype} | {r.target} | {r.registers} | "
                     f"{r.spill_stores} / {r.spill_loads} | {r.shared / 1024:.0f} | {r.num_warps} | {r.num_stages} | "
                     f"{r.blocks_per_sm} ({r.limited_by}) | {r.grid_use} | {atomics_cell(r.atomics)} | "
                     f"{r.f64:,} ({r.f64_in_loop:,}) | {_cost_cells(r)} | {r.seconds:.1f} | {check} |")
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
            print(f"{r.kernel} [{r.variant}] {r.dtype} {r.target}: grid {r.grid_use} {r.options}")
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
    print(f"SUMMARY: {len(rows) - len(failed)}/{len(rows)} launches compile spill-free within shared memory, "
          "without ordered atomics or (the linear head) float64 in their loops")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
