"""The analytic ELECTRA step FLOPs against torch's FlopCounterMode on real tiny models and real batches."""

from __future__ import annotations

import pytest
import torch

from megakd.bench.flops import step_flops
from megakd.config import load_config
from megakd.data.loader import PretrainingLoader
from megakd.data.tokenizer import Tokenizer
from megakd.engine.pretrain import build_models
from tests.bench.flop_counting import counted_electra_step, flop_counter, rtd_projection_correction
from tests.helpers import tiny_overrides


@pytest.mark.parametrize("position_encoding", ["absolute", "t5_relative"])
def test_step_flops_match_flop_counter(tiny_data, tmp_path, position_encoding):
    extra = {f"model.{m}.position_encoding": position_encoding for m in ("generator", "discriminator")}
    cfg = load_config("configs/electra-tiny.yaml", tiny_overrides(tiny_data, tmp_path, **extra))
    generator, discriminator = build_models(cfg)
    loader = PretrainingLoader(tiny_data[1], Tokenizer.load(tiny_data[0]), micro_batch_size=4)
    batch = next(iter(loader))
    counted = counted_electra_step(generator, discriminator, batch)

    sequences, seq_len = batch["input_ids"].shape
    f = step_flops(cfg, sequences, seq_len, masked=int(batch["mlm_mask"].sum()))
    p = f.parts
    # The fused loss computes the projection's gradients inside its forward pass and samples the
    # replacements from the same logits.
    assert counted["gen_forward"] == pytest.approx(
        p["generator_encoder"]["forward"] + p["generator_head"]["forward"]
        + p["generator_mlm_projection"]["forward"] + p["generator_mlm_projection"]["backward"], rel=1e-9)
    assert counted["gen_backward"] == pytest.approx(
        p["generator_encoder"]["backward"] + p["generator_head"]["backward"], rel=1e-9)
    h = cfg.model.discriminator.hidden_size
    tokens = sequences * seq_len
    disc_fwd = p["discriminator_encoder"]["forward"] + p["discriminator_head"]["forward"]
    disc_bwd = p["discriminator_encoder"]["backward"] + p["discriminator_head"]["backward"]
    assert counted["disc_forward"] == pytest.approx(disc_fwd, rel=1e-9)
    assert counted["disc_backward"] == pytest.approx(disc_bwd - rtd_projection_correction(h, tokens), rel=1e-9)
    assert f.model == pytest.approx(sum(counted.values()) + rtd_projection_correction(h, tokens), rel=1e-9)


def test_checkpointing_adds_one_forward_of_the_layers(tiny_data, tmp_path):
    base = load_config("configs/electra-tiny.yaml", tiny_overrides(tiny_data, tmp_path))
    ckpt = load_config("configs/electra-tiny.yaml", tiny_overrides(
        tiny_data, tmp_path, **{"model.discriminator.activation_checkpointing": True}))
    discriminator = build_models(ckpt)[1].train()
    ids = torch.randint(5, 500, (2, 64))
    with flop_counter() as c:
        discriminator(ids, torch.ones_like(ids)).sum().backward()
    measured_extra = c.get_total_flops()
    with flop_counter() as c:
        build_models(base)[1].train()(ids, torch.ones_like(ids)).sum().backward()
    measured_extra -= c.get_total_flops()
    assert step_flops(base, 2, 64).recompute == 0
    assert step_flops(ckpt, 2, 64).recompute == pytest.approx(measured_extra, rel=1e-9)
    assert step_flops(ckpt, 2, 64).model == step_flops(base, 2, 64).model
