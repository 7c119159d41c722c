"""Sum over Linear weights of their 1-norm Lipschitz constant (SoTeacher's LR penalty).

For ``W`` laid out [out, in] as in ``nn.Linear``, the operator norm induced by the vector 1-norm is
the maximum over columns ``j`` of ``sum_i |W[i, j]|``. Backward uses the subgradient ``sign(W)`` on
the maximizing column and 0 elsewhere (first maximal column on ties, as ``torch.max``).

The Triton path reads every matrix of one dtype in a single launch through a table of data pointers;
the torch path reduces each matrix without materializing ``|W|``. Column sums run in fp32 (fp64 for
fp64 weights) whatever the weights' dtype, and the value is returned in that dtype; neither path
reads a number back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .dispatch import resolve_backend

_OP = "lipschitz_1norm"


def lipschitz_1norm_reference(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """Naive reference: plain autograd over ``|W|.sum(0).max()`` per matrix."""
    return sum(w.abs().sum(0).max() for w in weights)


class _Lipschitz1Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, use_triton, *weights):
        if use_triton:
            from .lipschitz_triton import column_abs_sums_triton

            values, argmax = column_abs_sums_triton(weights)
        else:
            acc = torch.float64 if any(w.dtype == torch.float64 for w in weights) else torch.float32
            maxes = [torch.linalg.vector_norm(w, ord=1, dim=0, dtype=acc).max(0) for w in weights]
            values = torch.stack([m.values for m in maxes])
            argmax = torch.stack([m.indices for m in maxes])
        ctx.use_triton = use_triton
        ctx.save_for_backward(argmax, *weights)
        return values.sum()

    @staticmethod
    def backward(ctx, grad_out):
        argmax, *weights = ctx.saved_tensors
        if ctx.use_triton:
            from .lipschitz_triton import column_sign_grads_triton

            grads = column_sign_grads_triton(weights, argmax, grad_out)
        else:
            grads = []
            for w, j in zip(weights, argmax):  # 0-d tensors: the column index stays on the device
                column = j.view(1)
                grads.append(torch.zeros_like(w).index_copy_(
                    1, column, torch.sign(w.index_select(1, column)) * grad_out.to(w.dtype)))
        return (None, *grads)


def lipschitz_1norm(weights: Sequence[torch.Tensor], backend: str = "auto") -> torch.Tensor:
    """Sum over matrices of max_j sum_i |W[i, j]|, differentiable (subgradient) in every weight."""
    if isinstance(weights, torch.Tensor) or not isinstance(weights, Sequence) or len(weights) == 0:
        raise ValueError(f"{_OP}: weights must be a non-empty list of 2-D tensors, got {type(weights).__name__}")
    for i, w in enumerate(weights):
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point() or w.numel() == 0:
            desc = f"{w.dtype} {tuple(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"{_OP}: weights[{i}] must be a non-empty 2-D floating tensor, got {desc}")
    if len({w.device for w in weights}) > 1:
        raise ValueError(f"{_OP}: all weights must be on one device, got {sorted({str(w.device) for w in weights})}")
    use_triton = resolve_backend(backend, weights[0].device, _OP) == "triton"
    return _Lipschitz1Norm.apply(use_triton, *weights)
