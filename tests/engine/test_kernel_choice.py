"""`kernels.head_backward` reaches the fused head of a pretraining run (kernels/dispatch.py reads it)."""

from __future__ import annotations

import pytest
from megakd.kernels.dispatch import chosen_head_backward

from megakd.config import load_config
from megakd.engine.pretrain import run_pretraining
from megakd.engine.trainer import Trainer
from tests.helpers import tiny_overrides


@pytest.mark.parametrize("choice", ["atomic", "chunked"])
def test_the_run_trains_under_its_configured_head_backward(tiny_data, tmp_path, monkeypatch, choice):
    seen = []
    monkeypatch.setattr(Trainer, "train", lambda self, export=None: seen.append(chosen_head_backward()))
    cfg = load_config("configs/electra-tiny.yaml", tiny_overrides(tiny_data, tmp_path / "run", **{
        "kernels.head_backward": choice, "train.max_steps": 1}))
    run_pretraining(cfg)
    assert seen == [choice]
    assert chosen_head_backward() == "chunked"  # the default again once the run is over
