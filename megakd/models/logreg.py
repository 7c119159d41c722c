"""Multinomial logistic regression fitted deterministically in float64: the frozen-feature probe and
the tf-idf baseline share it.

Minimises mean cross-entropy + `l2`/2·‖W‖² (bias unpenalised) with torch's full-batch L-BFGS and a
strong-Wolfe line search: no sampling, no shuffling, so the same inputs give the same weights on
every run. `features` may be a dense [N, D] tensor or a sparse COO one (tf-idf).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _logits(features: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    product = torch.sparse.mm(features, weight) if features.is_sparse else features @ weight
    return product + bias


def fit_logistic_regression(features: Tensor, labels: Tensor, num_classes: int, l2: float = 1e-3,
                            max_iter: int = 200) -> tuple[Tensor, Tensor]:
    """(weight [D, K], bias [K]) in float64 minimising the L2-regularised mean cross-entropy."""
    x = features.double()
    weight = torch.zeros(x.shape[1], num_classes, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(num_classes, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], lr=1.0, max_iter=max_iter, history_size=20,
                                  tolerance_grad=1e-9, tolerance_change=1e-12, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(_logits(x, weight, bias), labels) + 0.5 * l2 * weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return weight.detach(), bias.detach()


def predict_logistic_regression(features: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """Class ids [N]."""
    return _logits(features.double(), weight, bias).argmax(-1)
