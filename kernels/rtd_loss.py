"""Fused replaced-token-detection loss: head projection -> logit -> masked BCE, one pass.

Labels follow HF ``ElectraForPreTraining``: 1 = replaced (``corrupted != original``), 0 = original.
The loss is the mean BCE-with-logits over positions where ``mask`` is true, and exactly 0 (with
zero gradients) when no position is masked in, instead of the NaN a plain mean would give.

The logits are only ``[N]``, so the torch path is already memory-bound by ``hidden`` itself and is
written with plain autograd; the Triton kernel computes loss and all gradients in a single read of
``hidden`` during the forward and only rescales them in backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import check_float, check_tensor, resolve_backend

_OP = "fused_rtd_loss"


def fused_rtd_loss_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    corrupted: torch.Tensor,
    original: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Naive reference: materialize logits, select the masked-in positions, mean BCE."""
    logits = hidden @ weight + bias
    keep = mask.bool()
    labels = (corrupted != original).to(logits.dtype)
    if not bool(keep.any()):
        return logits.sum() * 0.0
    return F.binary_cross_entropy_with_logits(logits[keep], labels[keep])


def _rtd_torch(hidden, weight, bias, corrupted, original, mask):
    # In fp32 like the Triton kernel (a 16-bit loss would resolve only ~3 digits); the [N, H] upcast is
    # one more pass over memory this memory-bound head reads anyway.
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = hidden.to(acc) @ weight.to(acc) + bias.to(acc)
    keep = mask.to(acc)
    labels = (corrupted != original).to(acc)
    per_pos = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    return (per_pos * keep).sum() / keep.sum().clamp(min=1.0)


def _check(hidden, weight, bias, corrupted, original, mask) -> None:
    check_tensor("hidden", hidden, 2, _OP)
    check_tensor("weight", weight, 1, _OP)
    check_float("hidden", hidden, _OP)
    n, h = hidden.shape
    if weight.shape != (h,):
        raise ValueError(f"{_OP}: weight must have shape ({h},) to match hidden, got {tuple(weight.shape)}")
    if not isinstance(bias, torch.Tensor) or bias.numel() != 1:
        raise ValueError(f"{_OP}: bias must be a one-element tensor, got {bias!r}")
    for name, t in (("corrupted", corrupted), ("original", original), ("mask", mask)):
        check_tensor(name, t, 1, _OP)
        if t.shape[0] != n:
            raise ValueError(f"{_OP}: {name} must have shape ({n},) to match hidden, got {tuple(t.shape)}")


def fused_rtd_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    corrupted: torch.Tensor,
    original: torch.Tensor,
    mask: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """Mean RTD BCE over masked-in positions; ``hidden`` [N,H], ``weight`` [H], ``bias`` scalar.

    Gradients flow to ``hidden``, ``weight`` and ``bias``. Flatten [B,T,H] inputs to [B*T,H]. Any
    float dtypes (bf16 activations with fp32 weights too); the loss is fp32 (fp64 for fp64 inputs).
    """
    _check(hidden, weight, bias, corrupted, original, mask)
    if resolve_backend(backend, hidden.device, _OP) == "torch":
        return _rtd_torch(hidden, weight, bias, corrupted, original, mask)
    from .rtd_loss_triton import rtd_loss_triton

    return rtd_loss_triton(hidden, weight, bias.reshape(()), corrupted, original, mask)
