"""`train.compile=true`: the compiled encoders train like the eager ones and resume exactly."""

from __future__ import annotations

import json

import pytest
import torch
import torch._inductor.config as inductor_config

from megakd.config import load_config
from tests.helpers import tiny_overrides, trained


def _train(tiny_data, run_dir, resume=None, **extra):
    return trained(load_config("configs/electra-tiny.yaml", tiny_overrides(tiny_data, run_dir, **extra)), resume)


def _losses(run_dir) -> list[tuple[float, float]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["gen_loss"], r["disc_loss"]) for r in rows]


@pytest.mark.slow
def test_compiled_training_tracks_eager(tiny_data, tmp_path, monkeypatch):
    """20 steps with dropout on: inductor draws dropout masks from torch's own RNG here
    (`fallback_random`), so the two runs see the same masks and differ only by rounding."""
    monkeypatch.setattr(inductor_config, "fallback_random", True)
    steps = {"train.max_steps": 20}
    _train(tiny_data, tmp_path / "eager", **steps)
    compiled = _train(tiny_data, tmp_path / "compiled", **steps, **{"train.compile": True})
    # In place: the encoders really are compiled, and the parameter names are the eager ones.
    assert all(layer._compiled_call_impl is not None
               for u in compiled.units.values() for layer in u.model.encoder.layers)
    assert not any("_orig_mod" in k for u in compiled.units.values() for k in u.model.state_dict())
    eager, comp = _losses(tmp_path / "eager"), _losses(tmp_path / "compiled")
    assert len(eager) == len(comp) == 20
    for (ge, de), (gc, dc) in zip(eager, comp):
        assert gc == pytest.approx(ge, rel=1e-5) and dc == pytest.approx(de, rel=1e-5)


@pytest.mark.slow
def test_compiled_resume_is_bit_exact(tiny_data, tmp_path):
    steps = {"train.max_steps": 4, "run.save_every": 2, "run.keep_last": 5, "train.compile": True}
    full = _train(tiny_data, tmp_path / "full", **steps)
    resumed = _train(tiny_data, tmp_path / "resumed", resume=str(tmp_path / "full/checkpoints/step_00000002"),
                     **steps)
    assert resumed.step == 4
    rows = [json.loads(x) for x in (tmp_path / "resumed/metrics.jsonl").read_text().splitlines()]
    full_rows = [json.loads(x) for x in (tmp_path / "full/metrics.jsonl").read_text().splitlines()][2:]
    for row in (*rows, *full_rows):
        row.pop("tokens_per_s")
    assert rows == full_rows
    for name, unit in full.units.items():
        other = resumed.units[name].model.state_dict()
        for key, value in unit.model.state_dict().items():
            assert torch.equal(value, other[key]), f"{name}.{key}"
