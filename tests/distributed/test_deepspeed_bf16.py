"""DeepSpeed with bf16 on one process: trains like fp32 (fp32 master weights, fp32 gradient accumulation)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megakd.store.checkpoint import latest_checkpoint
from megakd.store.checkpoint_models import read_unit_state
from tests.distributed.harness import CONFIG, child_env
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


# Run in a child process: DeepSpeed caches its process groups, so a second set of engines built in
# a process whose group was destroyed (by an earlier test) cannot broadcast.
ACCUMULATION_PROBE = """
import json, sys
import torch
from megakd.config import load_config
from megakd.engine.pretrain import open_trainer
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

trainer = open_trainer(load_config(sys.argv[1], sys.argv[2:]))
out = {}
for unit in trainer.units.values():
    engine = unit.wrapped
    optimizer = engine.optimizer
    if isinstance(optimizer, BF16_Optimizer):  # ZeRO-1: fp32 gradient buffers beside the bf16 weights
        buffers = {str(g.dtype) for g in optimizer.fp32_groups_gradients_flat}
    else:  # ZeRO-2/3: the partitions the micro-batches are summed into
        buffers = {str(optimizer.gradient_accumulation_dtype)}
    out[unit.name] = {"types": [str(t) for t in engine.get_data_types()], "buffers": sorted(buffers),
                      "optimizer": type(optimizer).__name__, "accumulation": engine.gradient_accumulation_steps()}
out["step"] = trainer.train().step
print("RESULT", json.dumps(out))
trainer.close()
"""


# A DeepSpeed engine per case (~5 s each): ZeRO-2 in the fast tier, the other two wrappers in the slow one.
@pytest.mark.parametrize("stage, wrapper", [pytest.param(1, "BF16_Optimizer", marks=pytest.mark.slow),
                                            (2, "DeepSpeedZeroOptimizer"),
                                            pytest.param(3, "DeepSpeedZeroOptimizer_Stage3", marks=pytest.mark.slow)])
def test_bf16_accumulates_micro_batch_gradients_in_fp32(tiny_data, tmp_path, stage, wrapper):
    """DeepSpeed's default (grad_accum_dtype None) sums the micro-batches' gradients in bf16.

    Checked on the engines megakd builds (one process, gloo): the dtypes they resolved, the buffer
    the gradients accumulate in, and one full step with its checkpoint.
    """
    run = tmp_path / "run"
    args = tiny_overrides(tiny_data, run, **{"backend.name": "deepspeed", "backend.zero_stage": stage,
                                             "train.precision": "bf16", "train.max_steps": 1, "run.export_hf": "false"})
    proc = subprocess.run([sys.executable, "-c", ACCUMULATION_PROBE, str(CONFIG), *args], capture_output=True,
                          text=True, env=child_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    for unit in ("generator", "discriminator"):
        assert result[unit] == {"types": ["torch.bfloat16", "torch.float32"], "buffers": ["torch.float32"],
                                "optimizer": wrapper, "accumulation": 2}, unit
    assert result["step"] == 1
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert all(0 < first[f"grad_norm_{u}"] < float("inf") for u in ("generator", "discriminator"))
    # the checkpoint consolidates to the fp32 master weights (BF16_Optimizer's shards are no ZeRO
    # checkpoint to zero_to_fp32), which round to the bf16 weights the engine trained with
    step_dir = latest_checkpoint(run)
    master = read_unit_state(step_dir, "generator")
    assert {t.dtype for t in master.values()} == {torch.float32}
    if stage < 3:  # (ZeRO-3 keeps no whole bf16 weights in the model file)
        module = torch.load(step_dir / "generator" / "ds" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
        for name, weight in module.items():
            assert torch.equal(master[name.removeprefix("model.")].bfloat16(), weight), name
