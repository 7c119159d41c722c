"""Admin initialisation (Liu et al. 2020, "Understanding the Difficulty of Training Transformers").

Variant implemented: the Post-LN form with a profiling pass. Each of the 2N sublayers (attention,
then FFN, per layer) computes x_i = LN(ω_i ⊙ x_{i−1} + f_i(x_{i−1})), with ω_i set from the output
variances of the sublayers before it, so that early in training each sublayer depends on its
input about as little as in Pre-LN (stable), while the model stays Post-LN (better final
quality). One profiling batch, a single pass in which each ω_i is set before its sublayer's
output is formed; ω stays a learnable per-channel parameter afterwards. Pretraining runs the pass
once per run, on rank 0 and the run's device (`admin_profile` in megakd/engine/pretrain.py).

`model.*.admin_profile` chooses how the pass is run (the paper leaves it to its code):

- ``reference`` — as the Admin authors' fairseq code: the layers are Xavier-initialised
  (`encoder.xavier_init_layer`), the pass runs in training mode (dropout on, so Var[f] includes
  dropout's 1/(1−p)), variances are over every position including padding, and
  ω_1 = 1, ω_{i+1} = sqrt(Var[ω_i·x_{i−1}] + Var[f_i]).
- ``bert`` — on BERT's N(0, 0.02) init, in eval mode, over real (non-padding) tokens only, with
  ω_i = sqrt(Var[x_0] + Σ_{j<i} Var[f_j]), x_0 the embedding output: the variance a Pre-LN
  residual stream x_0 + Σ f_j would have reached.

The two formulas agree when every LN output has unit variance; the profiles differ in the weights
(Xavier's branch outputs are larger) and in dropout. On 12 × 768 layers the last ω is 2.80 with
`reference` and 1.71 with `bert` (`tools/admin_omega.py`: one random 8 × 128 batch).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor

from megakd.models.encoder import Encoder

logger = logging.getLogger(__name__)


@torch.no_grad()
def admin_initialize(
    model: Encoder, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
    seed: int = 0, device: torch.device | str | None = None,
) -> list[float]:
    """Set every ω from one profiling batch; returns the 2N values (attention, FFN per layer).

    The `reference` profile's dropout masks come from the generator of the device the pass runs on,
    seeded with `seed` inside a forked RNG state, so ω depends only on (weights, batch, seed, device)
    and the caller's RNG stream is left as it was.

    `device`: where the pass runs (default: where `model` is). Another device profiles a copy of
    `model` there and only the ω scalars come back, so the weights of `model` are untouched and its ω
    are what the device's arithmetic gave (on CUDA its own dropout masks, so the `reference` ω
    differ from the CPU's by the profile's sampling noise).
    """
    if model.config.init != "admin":
        raise ValueError(f"model.init: admin_initialize needs 'admin', got {model.config.init!r}")
    here = next(model.parameters()).device
    device = here if device is None else torch.device(device)
    profiled = model if device == here else copy.deepcopy(model).to(device)
    input_ids, attention_mask, token_type_ids = (None if t is None else t.to(device)
                                                 for t in (input_ids, attention_mask, token_type_ids))
    reference = model.config.admin_profile == "reference"
    counted = torch.ones_like(input_ids, dtype=torch.bool)  # positions the variances run over
    if attention_mask is not None and not reference:
        counted = attention_mask.bool()
    was_training = profiled.training
    profiled.train(reference)
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device], device_type=device.type):
        torch.manual_seed(seed)
        try:
            omegas = _profile(profiled, input_ids, attention_mask, token_type_ids, counted, reference)
        finally:
            profiled.train(was_training)
    if profiled is not model:
        set_omegas(model, omegas)
    logger.info("Admin init (%s profile): ω from %.3f (first sublayer) to %.3f (last)", model.config.admin_profile,
                omegas[0], omegas[-1])
    return omegas


def set_omegas(model: Encoder, omegas: Sequence[float]) -> None:
    """Give every sublayer its ω (attention, FFN per layer, as `admin_initialize` returns them): a profile
    computed elsewhere (on another device, or saved by an earlier start of the run) applied to `model`."""
    sublayers = [omega for layer in model.layers for omega in (layer.attention_omega, layer.ffn_omega)]
    if len(omegas) != len(sublayers):
        raise ValueError(f"Admin ω: expected {len(sublayers)} values (2 per layer), got {len(omegas)}")
    with torch.no_grad():
        for omega, value in zip(sublayers, omegas):
            omega.fill_(value)


def _profile(model: Encoder, input_ids: Tensor, attention_mask: Tensor | None, token_type_ids: Tensor | None,
             counted: Tensor, reference: bool) -> list[float]:
    """The single pass: each sublayer's ω is set, then its output formed with it."""

    def variance(t: Tensor) -> Tensor:
        return t[counted].double().var(correction=0)

    x, key_mask, position_bias = model.prepare(input_ids, attention_mask, token_type_ids)
    accumulated = variance(x)  # bert: Var[x_0] + Σ Var[f_j]
    ratio = torch.ones((), dtype=torch.float64)  # reference: the next ω
    omegas: list[float] = []
    for layer in model.layers:
        sublayers = (
            (layer.attention_omega, partial(layer.attention_branch, key_mask=key_mask, position_bias=position_bias),
             layer.attention_norm),
            (layer.ffn_omega, layer.ffn_branch, layer.ffn_norm),
        )
        for omega, branch, norm in sublayers:
            f = branch(x)
            omega.fill_((ratio if reference else accumulated.sqrt()).item())
            kept = omega * x
            ratio = (variance(kept) + variance(f)).sqrt()
            accumulated = accumulated + variance(f)
            x = norm(kept + f)
            omegas.append(omega[0].item())
    return omegas
