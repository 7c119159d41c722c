"""Admin initialisation (Liu et al. 2020, "Understanding the Difficulty of Training Transformers").

Variant implemented: the Post-LN form with a profiling pass. Each of the 2N sublayers (attention,
then FFN, per layer) computes x_i = LN(ω_i ⊙ x_{i−1} + f_i(x_{i−1})) with

    ω_i = sqrt(Var[x_0] + Σ_{j<i} Var[f_j(x_{j−1})]),

x_0 being the embedding output. This is the variance a Pre-LN residual stream x_0 + Σ f_j would
have reached, so early in training each sublayer depends on its input about as little as in
Pre-LN (stable), while the model stays Post-LN (better final quality). Variances are scalars over
all channels of the non-padding tokens of one batch, measured without dropout, in a single pass in
which each ω_i is set before its sublayer runs. ω stays a learnable per-channel parameter
afterwards. The weights keep their normal init.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
from torch import Tensor

from megakd.models.encoder import Encoder

logger = logging.getLogger(__name__)


@torch.no_grad()
def admin_initialize(
    model: Encoder, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
) -> list[float]:
    """Set every ω from one profiling batch; returns the 2N values (attention, FFN per layer) for logging."""
    if model.config.init != "admin":
        raise ValueError(f"model.init: admin_initialize needs 'admin', got {model.config.init!r}")
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()

    def variance(t: Tensor) -> Tensor:
        return t[real].double().var(correction=0)

    was_training = model.training
    model.eval()
    try:
        x, key_mask, position_bias = model.prepare(input_ids, attention_mask, token_type_ids)
        accumulated = variance(x)
        omegas: list[float] = []
        for layer in model.layers:
            sublayers = (
                (layer.attention_omega, partial(layer.attention_branch, key_mask=key_mask, position_bias=position_bias),
                 layer.attention_norm),
                (layer.ffn_omega, layer.ffn_branch, layer.ffn_norm),
            )
            for omega, branch, norm in sublayers:
                f = branch(x)
                omega.fill_(accumulated.sqrt().item())
                x = norm(omega * x + f)
                accumulated = accumulated + variance(f)
                omegas.append(omega[0].item())
    finally:
        model.train(was_training)
    logger.info("Admin init: ω from %.3f (first sublayer) to %.3f (last)", omegas[0], omegas[-1])
    return omegas
