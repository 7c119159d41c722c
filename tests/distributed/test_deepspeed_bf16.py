"""DeepSpeed with bf16 on one process: trains like fp32 (DeepSpeed keeps fp32 master weights)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import tiny_overrides


@pytest.mark.slow
def test_deepspeed_zero2_bf16_tracks_fp32(tiny_data, tmp_path):
    rows = {}
    for precision in ("fp32", "bf16"):
        run = tmp_path / precision
        cmd = [sys.executable, "-m", "megakd.cli", "pretrain", "-c", "configs/electra-tiny.yaml",
               *tiny_overrides(tiny_data, run), "run.export_hf=false", "train.max_steps=5",
               "backend.name=deepspeed", "backend.zero_stage=2", f"train.precision={precision}",
               "optim.schedule.warmup_steps=0", "optim.schedule.decay=constant"]
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows[precision] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    fp32, bf16 = rows["fp32"], rows["bf16"]
    assert [r["step"] for r in bf16] == [1, 2, 3, 4, 5]
    for a, b in zip(fp32, bf16):
        assert b["gen_loss"] == pytest.approx(a["gen_loss"], rel=0.02)
        assert b["disc_loss"] == pytest.approx(a["disc_loss"], rel=0.05)
    assert bf16[-1]["gen_loss"] < bf16[0]["gen_loss"] - 0.1  # it learns (updates are not lost to bf16 rounding)
    assert fp32[-1]["gen_loss"] != bf16[-1]["gen_loss"]
