"""The GPUs megakd plans for and computes steps on: datasheet peaks, bandwidths, and what `megakd bench` measured.

One table, read by the planner (`megakd plan`), the computed step (megakd/bench/step_time.py), the head
backward's roofline (megakd/bench/roofline.py) and the kernel compile report (tools/compile_kernels.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megakd.config import ConfigError


@dataclass
class Hardware:
    """One accelerator type and its interconnect."""

    name: str
    peak_tflops: dict[str, float]  # dense matmul peak per matmul class (fp32, tf32, bf16, fp16)
    busbw_intra: float  # GB/s all-reduce bus bandwidth within a node
    busbw_inter: float  # GB/s all-reduce bus bandwidth across nodes
    hbm_gbps: float  # device memory bandwidth, GB/s
    gpus_per_node: int = 8
    source: str = ""
    # fp32 atomic adds at the L2, TB/s of read-modify-write bytes (8 per add): (best, worst). No datasheet
    # or whitepaper gives it, so it is bracketed: at best the L2's bandwidth, at worst the HBM's.
    l2_atomic_tbps: tuple[float, float] | None = None


# Peaks and memory bandwidth: NVIDIA datasheets, dense tensor-core math (no sparsity); fp32 is IEEE
# FP32 on the CUDA cores, tf32 the TF32 tensor cores (what fp32 matmuls use when TF32 is allowed).
# Bus bandwidths: typical nccl-tests all_reduce_perf results for standard 8-GPU servers with a full
# set of NICs (DGX-1 V100: NVLink2, 4x EDR; DGX A100: NVLink3, 8x HDR; DGX H100: NVLink4, 8x NDR).
# L2 atomics at best: the A100 whitepaper's L2 read bandwidth, 5,120 B/clk x 1.41 GHz = 7.2 TB/s; for the
# H100 no figure is published: the same 5,120 B/clk assumed at 1.98 GHz = 10.1 TB/s.
# Measure yours with `megakd bench` and pass --bench.
GPUS: dict[str, Hardware] = {
    "v100": Hardware("V100-SXM2", {"fp32": 15.7, "fp16": 125.0}, 130.0, 45.0, 900.0,
                     source="V100 datasheet; DGX-1 NVLink2 + 4x100Gb/s EDR"),
    "a100": Hardware("A100-SXM4", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}, 230.0, 180.0,
                     2039.0, source="A100 80GB datasheet; DGX A100 NVLink3 + 8x200Gb/s HDR",
                     l2_atomic_tbps=(7.2, 2.039)),
    "h100": Hardware("H100-SXM5", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.0, "fp16": 989.0}, 370.0, 360.0,
                     3350.0, source="H100 datasheet; DGX H100 NVLink4 + 8x400Gb/s NDR",
                     l2_atomic_tbps=(10.1, 3.35)),
}


def hardware_from_bench(path: str | Path, preset: Hardware) -> Hardware:
    """Peak and bandwidth measured by `megakd bench` (its JSON): matmul TFLOP/s, largest all-reduce busbw.
    What it does not measure (memory bandwidth, a matmul class it did not time) comes from `preset`."""
    try:
        data = json.loads(Path(path).read_text())
        peaks = {p: r["tflops"] for p, r in data["matmul"].items()}
        busbw = max(r["busbw_GBps"] for r in data["collectives"]["all_reduce"])
        world = data["world_size"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"--bench {path}: expected a JSON written by `megakd bench` "
                          f"with matmul and all_reduce results ({type(err).__name__}: {err})") from None
    # One measurement, at the world size it ran at, stands for both levels of the network.
    return Hardware(f"measured ({data.get('device', '?')} x{world})", preset.peak_tflops | peaks, busbw, busbw,
                    preset.hbm_gbps, max(world, 1), source=f"{path}; memory bandwidth: {preset.name} datasheet",
                    l2_atomic_tbps=preset.l2_atomic_tbps)
