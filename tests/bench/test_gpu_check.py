"""tools/gpu_check.py's CPU rehearsal: the kernel-parity step under the Triton interpreter at small shapes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megakd.kernels import fused_linear_cross_entropy, fused_linear_cross_entropy_reference
from megakd.kernels.dispatch import triton_available

from megakd.bench.kernel_parity import Mismatch, check_against_reference

REPO = Path(__file__).parents[2]
OPS = ("ce", "kl", "sample", "rtd", "lip1")


def gpu_check(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py"), "--device", "cpu", "--only",
                           "parity", "--small", "--out", str(out), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # two interpreter runs of every kernel: ~20 s
@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_every_kernel_passes_and_a_planted_failure_fails(tmp_path):
    proc = gpu_check(tmp_path / "ok", "--dtypes", "fp32,bf16")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "| parity | PASS |" in (tmp_path / "ok" / "summary.md").read_text()
    log = (tmp_path / "ok" / "parity.log").read_text().splitlines()
    for op in OPS:
        for dtype in ("fp32", "bf16"):
            for backend in ("triton", "torch"):
                rows = [x for x in log if x.split()[1:4] == [op, dtype, backend]]
                assert rows and all(x.startswith("PASS") for x in rows), (op, dtype, backend, rows)

    proc = gpu_check(tmp_path / "planted", "--dtypes", "fp32", "--tol-scale", "0")  # no error is < 0
    assert proc.returncode == 1
    assert "| parity | FAIL |" in (tmp_path / "planted" / "summary.md").read_text()
    rows = [x for x in (tmp_path / "planted" / "parity.log").read_text().splitlines() if x[:4] in ("PASS", "FAIL")]
    assert {x.split()[1] for x in rows} == set(OPS) and all(x.startswith("FAIL") for x in rows), rows
    assert "FAIL parity" in proc.stdout


def test_a_wrong_reference_is_a_mismatch():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 16, generator=g), torch.randn(50, 16, generator=g), None]
    target = torch.randint(0, 50, (8,), generator=g)

    def kernel(h, w, b):
        return fused_linear_cross_entropy(h, w, b, target, backend="torch")

    assert "loss_err" in check_against_reference(
        kernel, lambda h, w, b: fused_linear_cross_entropy_reference(h, w, b, target), xs, torch.float32)
    with pytest.raises(Mismatch, match="loss_err"):
        check_against_reference(
            kernel, lambda h, w, b: 1.001 * fused_linear_cross_entropy_reference(h, w, b, target), xs, torch.float32)
