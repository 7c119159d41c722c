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


def matmul_peak_flops(dtype: torch.dtype, device: torch.device, n: int = 2048, iters: int = 3) -> float:
    """Dense-matmul FLOP/s this process reaches now (the roofline's compute ceiling)."""
    return 2 * n**3 / matmul_seconds(dtype, device, n, iters)


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
