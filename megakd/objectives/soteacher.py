"""SoTeacher's teacher regularisers as functions of modules and tensors (docs/methods.md § SoTeacher).

ℓ = ℓ_CE + λ_LR·ℓ_LR + λ_CR(t)·ℓ_CR:

- ℓ_LR is a *sum* of per-layer Lipschitz constants induced by the 1-norm: a Linear contributes the
  max column absolute sum of W (computed for all of them in one `lipschitz_1norm` call), a
  LayerNorm max|γ|, every other module 0. Embedding tables are lookups, not maps of the previous
  layer's output, so they contribute 0 as well.
- ℓ_CR is the squared error between this epoch's probabilities and the running mean of the same
  example's probabilities from earlier epochs (summed over classes, batch mean).
- λ_CR(t) follows one of four schedules over the epoch number t = 1..T (T epochs). The papers
  write λ_CR(t) = (t/T)·λ_max, "linearly interpolated from 0 to its maximum", and the piecewise
  schedule's intervals (0, T/3], (T/3, 2T/3], (2T/3, T] cover t = 1..T but not 0: the epoch number
  is 1-based, so the last epoch trains with exactly λ_max under every schedule. (Epoch 1 has no
  earlier prediction to be consistent with, so its CR term is skipped whatever its weight.)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from megakd.kernels import lipschitz_1norm

CR_SCHEDULES = ("linear", "cosine", "cyclic", "piecewise")


def lipschitz_penalty(model: nn.Module, backend: str = "auto") -> Tensor:
    """Σ over the model's Linear layers of max_j Σ_i |W_ij| plus Σ over its LayerNorms of max|γ|."""
    linears = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    norms = [m.weight.abs().max() for m in model.modules() if isinstance(m, nn.LayerNorm) and m.weight is not None]
    total = lipschitz_1norm(linears, backend=backend) if linears else torch.zeros(())
    return total + (torch.stack(norms).sum() if norms else 0.0)


def consistency_loss(probs: Tensor, targets: Tensor, has_target: Tensor) -> Tensor:
    """(1/B) Σ_i ‖p_i − p̄_i‖² over the rows that have a running mean (`has_target`); others add 0."""
    sq = ((probs - targets.to(probs.dtype)) ** 2).sum(-1)
    return (sq * has_target.to(probs.dtype)).sum() / probs.shape[0]


def cr_weight(schedule: str, t: float, total: float, lam_max: float) -> float:
    """λ_CR(t) for the 1-based epoch number t of T; every schedule is 0 at t = 0 and λ_max at t = T."""
    if schedule not in CR_SCHEDULES:
        raise ValueError(f"soteacher.cr_schedule: expected one of {', '.join(CR_SCHEDULES)}, got {schedule!r}")
    r = min(max(t / total, 0.0), 1.0)
    if schedule == "linear":
        return r * lam_max
    if schedule == "cosine":
        return lam_max * math.cos((1 - r) * math.pi / 2)
    if schedule == "cyclic":
        return lam_max * math.sqrt(1 - (1 - r) ** 2)
    if r <= 1 / 3:
        return 0.0
    return lam_max / 2 if r <= 2 / 3 else lam_max


def cr_weight_for_epoch(schedule: str, epoch: int, num_epochs: int, lam_max: float) -> float:
    """λ_CR of the 0-based training epoch `epoch` of `num_epochs`: the last epoch gets λ_max."""
    return cr_weight(schedule, epoch + 1, num_epochs, lam_max)
