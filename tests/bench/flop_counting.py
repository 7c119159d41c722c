"""Counting the FLOPs of real training work with torch's FlopCounterMode (independent of megakd.bench.flops)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode, addmm_flop, sdpa_flop, sdpa_flop_count

from megakd.engine.losses import DiscriminatorLoss, GeneratorLoss
from megakd.objectives.electra import corrupt


def flop_counter() -> FlopCounterMode:
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


def counted_electra_step(generator, discriminator, batch: dict) -> dict[str, int]:
    """Counted FLOPs of one ELECTRA micro-step on `batch`: generator and discriminator, forward and backward."""
    gen_task, disc_task = GeneratorLoss(generator, "torch"), DiscriminatorLoss(discriminator, "torch")
    counted = {}
    with flop_counter() as c:
        out = gen_task(batch)
    counted["gen_forward"] = c.get_total_flops()
    with flop_counter() as c:
        out["loss"].backward()
    counted["gen_backward"] = c.get_total_flops()
    corrupted = corrupt(batch["input_ids"], batch["mlm_mask"], out["samples"])
    with flop_counter() as c:
        d = disc_task(corrupted, batch["input_ids"], batch["attention_mask"])
    counted["disc_forward"] = c.get_total_flops()
    with flop_counter() as c:
        d["loss"].backward()
    counted["disc_backward"] = c.get_total_flops()
    return counted


def rtd_projection_correction(hidden_size: int, tokens: int) -> int:
    """What the counter misses of the model FLOPs: the fused RTD loss applies the H→1 projection as
    a dot product (not a matmul) and its gradient as an outer product, so the counter sees the
    projection once (in the no-grad statistics) instead of forward + two gradients: 4·H per token."""
    return 4 * hidden_size * tokens
