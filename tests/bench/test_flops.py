"""The analytic ELECTRA step FLOPs against torch's FlopCounterMode on real tiny models and real batches."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, addmm_flop, sdpa_flop, sdpa_flop_count

from megakd.bench.flops import step_flops
from megakd.config import load_config
from megakd.data.stream import PretrainingLoader
from megakd.data.tokenizer import Tokenizer
from megakd.engine.pretrain import build_models
from megakd.engine.tasks import DiscriminatorTask, GeneratorTask
from megakd.objectives.electra import corrupt
from tests.helpers import tiny_overrides


def _counter() -> FlopCounterMode:
    """FlopCounterMode plus two ops it misses: the in-place addmm_ with which the fused
    cross-entropy accumulates its weight gradient, and the fused CPU attention kernel that SDPA
    picks for boolean masks. Both get torch's own formulas for the equivalent ops; the attention
    backward counts its four gradient matmuls (model FLOPs) but not the kernel's recomputation of
    QKᵀ, which is hardware work like activation checkpointing."""
    aten = torch.ops.aten

    def attention_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return 2 * sdpa_flop_count(query, key, value)

    return FlopCounterMode(display=False, custom_mapping={
        aten.addmm_: addmm_flop.__wrapped__,
        aten._scaled_dot_product_flash_attention_for_cpu: sdpa_flop.__wrapped__,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: attention_backward,
    })


@pytest.mark.parametrize("position_encoding", ["absolute", "t5_relative"])
def test_step_flops_match_flop_counter(tiny_data, tmp_path, position_encoding):
    extra = {f"model.{m}.position_encoding": position_encoding for m in ("generator", "discriminator")}
    cfg = load_config("configs/electra-tiny.yaml", tiny_overrides(tiny_data, tmp_path, **extra))
    generator, discriminator = build_models(cfg)
    loader = PretrainingLoader(tiny_data[1], Tokenizer.load(tiny_data[0]), micro_batch_size=4)
    batch = next(iter(loader))
    gen_task, disc_task = GeneratorTask(generator, "torch"), DiscriminatorTask(discriminator, "torch")

    counted = {}
    with _counter() as c:
        out = gen_task(batch)
    counted["gen_forward"] = c.get_total_flops()
    with _counter() as c:
        out["loss"].backward()
    counted["gen_backward"] = c.get_total_flops()
    corrupted = corrupt(batch["input_ids"], batch["mlm_mask"], out["samples"])
    with _counter() as c:
        d = disc_task(corrupted, batch["input_ids"], batch["attention_mask"])
    counted["disc_forward"] = c.get_total_flops()
    with _counter() as c:
        d["loss"].backward()
    counted["disc_backward"] = c.get_total_flops()

    sequences, seq_len = batch["input_ids"].shape
    f = step_flops(cfg, sequences, seq_len, masked=int(batch["mlm_mask"].sum()))
    p = f.parts
    # The fused loss computes the projection's gradients inside its forward pass.
    assert counted["gen_forward"] == pytest.approx(
        p["generator_encoder"]["forward"] + p["generator_head"]["forward"]
        + p["generator_mlm_projection"]["forward"] + p["generator_mlm_projection"]["backward"]
        + p["generator_sampling"]["forward"], rel=1e-9)
    assert counted["gen_backward"] == pytest.approx(
        p["generator_encoder"]["backward"] + p["generator_head"]["backward"], rel=1e-9)
    # The fused RTD loss applies the H→1 projection as a dot product (not a matmul) and its
    # gradient as an outer product; the counter sees the projection once, in the no-grad statistics.
    h = cfg.model.discriminator.hidden_size
    tokens = sequences * seq_len
    disc_fwd = p["discriminator_encoder"]["forward"] + p["discriminator_head"]["forward"]
    disc_bwd = p["discriminator_encoder"]["backward"] + p["discriminator_head"]["backward"]
    assert counted["disc_forward"] == pytest.approx(disc_fwd, rel=1e-9)
    assert counted["disc_backward"] == pytest.approx(disc_bwd - 4 * h * tokens, rel=1e-9)
    assert f.model == pytest.approx(sum(counted.values()) + 4 * h * tokens, rel=1e-9)


def test_checkpointing_adds_one_forward_of_the_layers(tiny_data, tmp_path):
    base = load_config("configs/electra-tiny.yaml", tiny_overrides(tiny_data, tmp_path))
    ckpt = load_config("configs/electra-tiny.yaml", tiny_overrides(
        tiny_data, tmp_path, **{"model.discriminator.activation_checkpointing": True}))
    discriminator = build_models(ckpt)[1].train()
    ids = torch.randint(5, 500, (2, 64))
    with _counter() as c:
        discriminator(ids, torch.ones_like(ids)).sum().backward()
    measured_extra = c.get_total_flops()
    with _counter() as c:
        build_models(base)[1].train()(ids, torch.ones_like(ids)).sum().backward()
    measured_extra -= c.get_total_flops()
    assert step_flops(base, 2, 64).recompute == 0
    assert step_flops(ckpt, 2, 64).recompute == pytest.approx(measured_extra, rel=1e-9)
    assert step_flops(ckpt, 2, 64).model == step_flops(base, 2, 64).model
