"""The Triton kernels as a GPU compiles them: tools/compile_kernels.py, on this CPU machine.

Each test runs the tool in a fresh process (the kernel tests around it run under ``TRITON_INTERPRET=1``,
which the tool must not see). The launches it compiles are recorded from the wrappers themselves, so
these tests see any change to a tile, ``num_warps``, ``num_stages`` or specialization in kernels/.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "compile_kernels.py"
KERNELS = {"_forward_kernel", "_backward_kernel", "_sample_kernel", "_uniform_kernel", "_rtd_kernel",
           "_colsum_kernel", "_sign_grad_kernel"}
TARGETS = {"sm_80", "sm_90a"}


def _tool(tmp_path: Path, *args: str, pythonpath: str | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, env.get("PYTHONPATH", "")])
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(TOOL), *args, "--json", str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert out.is_file(), proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


@pytest.mark.slow  # a fresh process importing torch and triton: 5-12 s on 2 shared cores
def test_recorded_launches_are_what_the_wrappers_choose_for_each_gpu(tmp_path):
    """No compiling: the forward's vocabulary splits follow the target's SM count (4 programs per SM),
    TF32 follows torch's flag, and tiles and warps are the head's table entries."""
    from megakd.kernels.linear_head_triton import HEAD_CONFIGS

    proc, report = _tool(tmp_path, "--list", "--only", "head_ce", "--dtypes", "bf16", "tf32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["kernel"], r["dtype"], r["target"]): r for r in report["rows"]}
    assert len(rows) == 2 * 2 * 2
    row_blocks = -(-2458 // HEAD_CONFIGS["forward", "16bit", "sm80"]["BLOCK_N"])
    for target, generation, sms in (("sm_80", "sm80", 108), ("sm_90a", "sm90", 132)):
        v_tiles = -(-128_000 // HEAD_CONFIGS["forward", "16bit", generation]["BLOCK_V"])
        per_split = -(-v_tiles // -(-4 * sms // row_blocks))
        assert rows["_forward_kernel", "bf16", target]["grid"] == [row_blocks, -(-v_tiles // per_split)]
        for kernel, entry in (("_forward_kernel", "forward"), ("_backward_kernel", "backward")):
            for dtype, matmul, precision in (("bf16", "16bit", "ieee"), ("tf32", "tf32", "tf32")):
                options = rows[kernel, dtype, target]["options"]
                assert options["PREC"] == precision
                expected = HEAD_CONFIGS[entry, matmul, generation].kwargs()
                assert {k: options[k] for k in expected} == expected, (kernel, dtype, target)


def _check_compiled(proc: subprocess.CompletedProcess, report: dict, dtypes: set[str]) -> None:
    failures = [f"{r['kernel']} [{r['variant']}] {r['dtype']} {r['target']}: {r['failures']}"
                for r in report["rows"] if r["failures"]]
    assert not failures, "\n".join(failures)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {r["kernel"] for r in report["rows"]} == KERNELS
    head = {(r["dtype"], r["target"]) for r in report["rows"] if r["kernel"] == "_forward_kernel"}
    assert head == {(d, t) for d in dtypes for t in TARGETS}
    for r in report["rows"]:
        assert r["registers"] > 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0
        assert r["blocks_per_sm"] >= 1
        # FMA fusion said by every launch, so that Triton's default (off from 3.10) cannot change the rounding
        assert r["options"]["enable_fp_fusion"] is True, r["kernel"]


@pytest.mark.slow
def test_every_launch_compiles_spill_free_for_a100_and_h100(tmp_path):
    """Every kernel and launch variant the wrappers make at production shapes, one dtype per matmul class
    (fp32, tf32, bf16; `--quick`), for sm_80 and sm_90a: no compile error, no spill, shared memory
    within a block's limit. The tool without `--quick` adds fp16 and bf16 with fp32 weights."""
    proc, report = _tool(tmp_path, "--quick")
    _check_compiled(proc, report, {"fp32", "tf32", "bf16"})


def _triton_floor() -> Version:
    """The lowest Triton pyproject's ``triton`` extra allows (the line .ci/run reads too)."""
    return Version(re.search(r'^triton = \["triton>=([\d.]+)"\]', (REPO / "pyproject.toml").read_text(), re.M).group(1))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MEGAKD_TRITON_FLOOR"),
                    reason="MEGAKD_TRITON_FLOOR (a folder with pyproject's lowest Triton) is unset; .ci/run sets it")
def test_every_kernel_compiles_under_the_lowest_triton_pyproject_allows(tmp_path):
    """pyproject's floor is a version that compiles: .ci/run installs its wheel into a side folder."""
    proc, report = _tool(tmp_path, "--dtypes", "bf16", pythonpath=os.environ["MEGAKD_TRITON_FLOOR"])
    assert Version(report["triton"]) == _triton_floor()
    _check_compiled(proc, report, {"bf16"})
