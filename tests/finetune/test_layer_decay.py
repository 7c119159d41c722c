"""ELECTRA's layer-wise learning-rate decay (`finetune.layer_lr_decay`) and AdamW (`finetune.optimizer`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megakd.config import ScheduleConfig
from megakd.engine.optim import build_scheduler
from megakd.finetune.config import FinetuneSettings
from megakd.finetune.optim import build_optimizer
from megakd.models.electra import SequenceClassifier
from megakd.models.encoder import EncoderConfig


def _model(position_encoding: str = "absolute") -> SequenceClassifier:
    config = EncoderConfig(num_layers=3, hidden_size=32, num_heads=2, intermediate_size=64, vocab_size=50,
                           embedding_size=16, position_encoding=position_encoding)
    return SequenceClassifier(config, 3)


@pytest.mark.parametrize("position_encoding", ["absolute", "t5_relative"])
def test_each_parameter_trains_at_its_layers_rate(position_encoding):
    model, lr, decay = _model(position_encoding), 1e-3, 0.8
    optimizer = build_optimizer(model, dataclasses.replace(FinetuneSettings(), optimizer="adamw", layer_lr_decay=decay,
                                                           weight_decay=0.01), lr)
    assert isinstance(optimizer, torch.optim.AdamW)
    rate = {id(p): (g["lr"], g["weight_decay"]) for g in optimizer.param_groups for p in g["params"]}
    names = dict(model.named_parameters())
    assert len(rate) == len(names)
    for name, p in names.items():
        if name.startswith("head."):
            want = lr  # the task head: the full rate
        elif name.startswith("encoder.layers."):
            want = lr * decay ** (3 + 1 - int(name.split(".")[2]))  # layer 2 (the top): lr·0.8²
        else:
            want = lr * decay ** 5  # embeddings (and the relative-position table below every layer)
        assert rate[id(p)] == (pytest.approx(want, rel=1e-12), 0.01 if p.ndim >= 2 else 0.0), name
    # The schedule scales each group's own peak: after warm-up, every parameter is at its layer's rate.
    scheduler = build_scheduler(optimizer, ScheduleConfig(warmup_steps=2, decay="linear"), 10)
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    top = [g for g in optimizer.param_groups if any(p is names["head.out_proj.weight"] for p in g["params"])][0]
    bottom = [g for g in optimizer.param_groups if any(p is names["encoder.embeddings.word_embeddings.weight"]
                                                       for p in g["params"])][0]
    assert bottom["lr"] / top["lr"] == pytest.approx(decay ** 5)


def test_no_decay_keeps_the_two_adamax_groups():
    optimizer = build_optimizer(_model(), FinetuneSettings(), 1e-4)
    assert isinstance(optimizer, torch.optim.Adamax) and len(optimizer.param_groups) == 2
