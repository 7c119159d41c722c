"""How far a training step is from the machine: model FLOPs against a measured dense-matmul peak.

The peak is what this process gets from one large square matmul at the step's dtype and thread
count (`matmul_seconds`), measured in the same run as the step so that both share the machine's
load; MFU = (model FLOPs per step / step time) / peak. Model FLOPs come from
`megakd.bench.flops` (the count the planner checks against torch's FLOP counter). The step's time
is split into the phases of `megakd.engine.profiling` by a short `torch.profiler` pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from megakd.bench.hardware import Hardware
from megakd.engine.profiling import PHASES, PREFIX


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_seconds(dtype: torch.dtype, device: torch.device, n: int = 2048, iters: int = 3) -> float:
    """Fastest of `iters` timed [n x n] @ [n x n] products (after one warm-up): 2n^3 FLOPs each."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def phase_seconds(step: Callable[[], None], steps: int, device: torch.device) -> dict[str, float]:
    """Seconds per step spent in each phase label, from a `torch.profiler` pass of `steps` calls.

    On CUDA the device time of each range
    is used, on CPU its wall time on the calling thread. Profiling adds overhead, so use the
    result as a split of the step, and time the step itself without the profiler.
    """
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    totals = dict.fromkeys(PHASES, 0.0)
    for event in prof.key_averages():
        if event.key.startswith(PREFIX) and event.key[len(PREFIX):] in totals:
            device_us = getattr(event, "device_time_total", 0.0) if device.type == "cuda" else 0.0
            totals[event.key[len(PREFIX):]] += (device_us or event.cpu_time_total) / 1e6 / steps
    return totals


def op_shares(step: Callable[[], None], steps: int, device: torch.device) -> dict[str, float]:
    """Each operator's share of the step's self time (CPU; device time on CUDA), largest first.

    Self time counts an op once, where its own work is done (a `linear` shows as the `addmm` it
    calls), so the shares add up to 1 and say where a step goes whatever the machine's load.
    """
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    own = {}
    for event in prof.key_averages():
        if not event.key.startswith(PREFIX):
            device_us = getattr(event, "self_device_time_total", 0.0) if device.type == "cuda" else 0.0
            own[event.key] = device_us or event.self_cpu_time_total
    total = sum(own.values()) or 1.0
    return {k: v / total for k, v in sorted(own.items(), key=lambda kv: -kv[1])}


def roofline(model_flops_per_step: float, tokens_per_step: float, step_s: float, peak_flops: float) -> dict:
    """FLOPs per token, achieved FLOP/s and MFU of a step that took `step_s` seconds."""
    achieved = model_flops_per_step / step_s
    return {"flops_per_token": model_flops_per_step / tokens_per_step, "achieved_flops": achieved,
            "peak_flops": peak_flops, "mfu": achieved / peak_flops}


def format_phases(phases: dict[str, float]) -> str:
    """`generator 812 ms (41%), discriminator ...`: phase times and their share of the profiled step.

    The shares are of the phases' sum, not of the step timed without the profiler: profiling slows
    every range, so against the unprofiled step they would add up to more than 100 %.
    """
    total = sum(phases.values()) or 1.0
    return ", ".join(f"{name} {s * 1e3:.0f} ms ({s / total:.0%})" for name, s in phases.items())


def head_backward_roofline(hw: Hardware, n: int = 2458, h: int = 768, v: int = 128_000, matmul: str = "bf16",
                           peak_fraction: float = 1.0, bandwidth_fraction: float = 1.0) -> dict:
    """Predicted seconds of the head cross-entropy backward on `hw`, chunked and atomic
    (kernels/linear_head_triton.py), at `peak_fraction` of the `matmul` peak and `bandwidth_fraction` of
    the memory bandwidth (1: the roofline; megakd/bench/step_time.py passes its assumptions).

    The default shape is electra-base's generator head in bf16: 2,458 masked rows a micro-batch (32 x 512
    tokens at 15 %), H = 768, V = 128,000. Each kernel is timed at max(FLOPs / peak, HBM bytes /
    bandwidth, atomic bytes / atomic throughput) and the kernels of a variant add up (they do not
    overlap). Both recompute the logits and do the two gradient products: 3 x 2NVH FLOPs.

    - atomic: one kernel of ceil(N/64) x ceil(V/128) programs (the shipped tiles); each adds its
      [64, H] block to grad_hidden, its [128, H] block to grad_weight and its 128 bias sums atomically,
      so grad_weight is read-modified-written once per row block, grad_hidden once per vocabulary tile.
      Its fp32 gradients are zero-filled before and cast to the inputs' dtype after. The atomics run
      between `hw.l2_atomic_tbps`'s best and worst (megakd/bench/hardware.py says why a bracket).
    - chunked: per chunk of ``kernels.linear_head_triton._BACKWARD_CHUNK_ELEMS // V`` rows, the
      d(loss)/d(logits) kernel writes the chunk's [rows, V] dz in the activations' dtype (and fp32
      per-row-block bias sums), one GEMM reads it for grad_hidden and one for grad_weight, which is read
      and rewritten per chunk (fp32); the weight is read once per chunk by the first two.

    Returns {variant: {"flops", "compulsory_bytes", "extra_bytes" (other HBM traffic: temporaries, re-reads,
    zero-fills, casts), "atomic_adds" (fp32), "atomic_bytes" (their read-modify-writes at the L2),
    "seconds": (best, worst)}} (chunked's best = worst: no atomics).
    """
    from megakd.kernels.linear_head_triton import _BACKWARD_CHUNK_ELEMS, HEAD_CONFIGS

    act_bytes = 2 if matmul in ("bf16", "fp16") else 4
    tiles = HEAD_CONFIGS["backward", "16bit", "sm90"]
    row_blocks, v_tiles = -(-n // tiles["BLOCK_N"]), -(-v // tiles["BLOCK_V"])
    product = 2.0 * n * v * h
    grads = (n * h + v * h + v) * 4.0  # fp32 accumulators
    compulsory = (n * h + v * h + v) * act_bytes * 2.0  # inputs read once, gradients written once
    cast = grads + (n * h + v * h + v) * act_bytes  # fp32 gradients read, written in the inputs' dtype
    adds = float(n * h * v_tiles + v * h * row_blocks + v * row_blocks)
    chunk = max(1, min(n, _BACKWARD_CHUNK_ELEMS // v))
    chunks = -(-n // chunk)
    dz = n * v * float(act_bytes)
    weight, hidden, gw = v * h * float(act_bytes), n * h * float(act_bytes), v * h * 4.0
    phases = {  # (FLOPs, HBM bytes, atomic bytes) per kernel
        "atomic": [(0.0, grads, 0.0), (3 * product, hidden + weight, 8 * adds), (0.0, cast, 0.0)],
        "chunked": [
            (product, hidden + chunks * weight + dz + 2 * row_blocks * v * 4.0, 0.0),  # dz and bias sums
            (product, dz + chunks * weight + n * h * 4.0, 0.0),  # grad_hidden = dz @ W
            (product, dz + hidden + gw + 2 * chunks * gw, 0.0),  # grad_weight: zero-filled, then += per chunk
            (0.0, cast, 0.0),
        ],
    }
    peak = hw.peak_tflops[matmul] * 1e12 * peak_fraction
    bandwidth = hw.hbm_gbps * 1e9 * bandwidth_fraction
    atomics = hw.l2_atomic_tbps or (hw.hbm_gbps / 1e3,) * 2
    out: dict = {}
    for variant, kernels in phases.items():
        moved = sum(b for _, b, _ in kernels)
        seconds = tuple(sum(max(f / peak, b / bandwidth, a / (tbps * 1e12 * bandwidth_fraction))
                            for f, b, a in kernels) for tbps in atomics)
        out[variant] = {"flops": sum(f for f, _, _ in kernels), "compulsory_bytes": compulsory,
                        "extra_bytes": moved - compulsory, "atomic_adds": adds if variant == "atomic" else 0.0,
                        "atomic_bytes": sum(a for _, _, a in kernels), "seconds": seconds}
    return out

