"""Tiny Triton kernels for tests/kernels/test_compile.py: each makes one thing tools/compile_kernels.py
reads off the PTX (an atomic in a loop, float64 in a loop or after it). Run as a script, in a process of
its own (the kernel tests around it interpret, this must compile): compiles each for sm_90a with the
tool and prints {name: {"row": the tool's row, "failures_as_head": its failures were it a linear-head
launch, "ptx": the PTX}} as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before triton.jit decorates: compiled, never interpreted

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import compile_kernels  # noqa: E402


@triton.jit
def atomic_add_loop(x_ptr, out_ptr, n, RELAXED: tl.constexpr, BLOCK: tl.constexpr):
    """Adds every BLOCK-slice of x into out: one atomic a slice, Triton's default semantics or relaxed."""
    offs = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        x = tl.load(x_ptr + start + offs)
        if RELAXED:
            tl.atomic_add(out_ptr + offs, x, sem="relaxed")
        else:
            tl.atomic_add(out_ptr + offs, x)


@triton.jit
def float64_loop(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Sums log(x) in float64: a float64 logarithm per element, inside the loop."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float64)
    for start in range(0, n, BLOCK):
        acc += tl.log(tl.load(x_ptr + start + offs).to(tl.float64))
    tl.store(out_ptr + offs, acc.to(tl.float32))


@triton.jit
def float64_epilogue(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Sums x in float32, then takes one float64 logarithm of the sum: float64 only after the loop."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n, BLOCK):
        acc += tl.load(x_ptr + start + offs)
    tl.store(out_ptr + offs, tl.log(acc.to(tl.float64)).to(tl.float32))


KERNELS = {
    "atomic_default": (atomic_add_loop, {"RELAXED": False}),
    "atomic_relaxed": (atomic_add_loop, {"RELAXED": True}),
    "float64_loop": (float64_loop, {}),
    "float64_epilogue": (float64_epilogue, {}),
}


def main() -> None:
    x, out = torch.empty(4096), torch.empty(128)
    report = {}
    for name, (kernel, flags) in KERNELS.items():
        launch = compile_kernels.Launch(kernel, (1,), (x, out, x.numel()), {**flags, "BLOCK": 128})
        row = compile_kernels.compile_launch(launch, "sm_90a")
        assert not row.error, row.error
        compiled, _ = compile_kernels.compile_only(launch, "sm_90a")
        report[name] = {"row": {**dataclasses.asdict(row), "failures": row.failures},
                        "failures_as_head": dataclasses.replace(row, fp32_head=True).failures,
                        "ptx": compiled.asm["ptx"]}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
