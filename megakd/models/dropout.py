"""Dropout with a cheap mask on CPU, for the hidden states and for the attention probabilities.

On CPU, `torch.bernoulli_` draws one Mersenne-Twister number per element, which made it the largest
non-matmul cost of an ELECTRA-small training step (docs/decisions.md, "Dropout on CPU"). Here one 64-bit draw
gives four 16-bit lanes, each kept when it is at or above `round(p * 65536)`: the drop probability is
`p` rounded to a multiple of 1/65536 (0.1 becomes 0.10000610), and the kept values are scaled by
the exact inverse of that rounded keep probability, so the expectation is preserved. The draws come
from torch's default CPU generator, so seeding, checkpointed RNG state and exact resume work as
with `nn.Dropout`, and the mask does not depend on the thread count.

Elsewhere (CUDA, or outside training) these functions are `F.dropout` and
`F.scaled_dot_product_attention`, whose fused kernels are already fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LANES = 65536  # values of one 16-bit lane


def uses_cpu_mask(x: Tensor, p: float, training: bool) -> bool:
    return training and 0.0 < p < 1.0 and x.device.type == "cpu"


def keep_mask(shape: torch.Size, p: float) -> tuple[Tensor, float]:
    """Bool mask of `shape` (True = keep) from the default CPU generator, and the scale of kept values."""
    drop_lanes = round(p * LANES)
    numel = shape.numel()
    words = torch.empty((numel + 3) // 4, dtype=torch.int64).random_(-(2 ** 63), None)
    lanes = words.view(torch.int16)[:numel].view(shape)  # uniform on [-32768, 32767]
    return lanes >= drop_lanes - LANES // 2, LANES / (LANES - drop_lanes)


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """`F.dropout(x, p, training)`, with the cheap CPU mask when training on CPU."""
    if not uses_cpu_mask(x, p, training):
        return F.dropout(x, p, training)
    keep, scale = keep_mask(x.shape, p)
    return x * keep.to(x.dtype).mul_(scale)


class Dropout(nn.Dropout):
    """`nn.Dropout` (its validation of p, its repr, no parameters) with the cheap CPU mask."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)


class _AttentionWithDropout(torch.autograd.Function):
    """softmax(q·kᵀ·scale + bias) with dropout, times v.

    Runs in the inputs' dtype with autocast off inside, as SDPA does under autocast (the caller
    passes q, k, v and the bias in one dtype).

    The 1/keep-probability scale is applied to the [.., L, head_dim] output (and its gradient)
    rather than to the [.., L, L] probabilities.
    """

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, p: float) -> Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # head views: copy once, not per matmul
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)
        if bias is not None:
            scores = scores.add_(bias)
        probs = torch.softmax(scores, dim=-1)
        keep, scale = keep_mask(probs.shape, p)
        keep = keep.to(probs.dtype)  # one conversion, not one per multiply
        dropped = probs * keep
        ctx.save_for_backward(q, k, v, probs, keep, dropped)
        ctx.scale = scale
        return torch.matmul(dropped, v).mul_(scale)

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    def backward(ctx, grad_out: Tensor):
        q, k, v, probs, keep, dropped = ctx.saved_tensors
        grad_out = grad_out * ctx.scale
        grad_v = torch.matmul(dropped.transpose(-1, -2), grad_out)
        grad_probs = torch.matmul(grad_out, v.transpose(-1, -2)).mul_(keep)
        grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
        grad_bias = grad_scores if ctx.needs_input_grad[3] else None
        grad_scores = grad_scores * q.shape[-1] ** -0.5
        return torch.matmul(grad_scores, k), torch.matmul(grad_scores.transpose(-1, -2), q), grad_v, grad_bias, None


def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, p: float, training: bool) -> Tensor:
    """`F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p=p if training else 0)`, with the
    cheap CPU mask when training on CPU.

    `attn_mask` is SDPA's: bool (True = attend) or an additive float bias. A bool mask becomes the
    dtype's minimum rather than -inf, so a row with at least one visible key gets exactly SDPA's
    probabilities (the masked ones underflow to 0) and a fully masked row cannot give NaN.
    """
    if not uses_cpu_mask(q, p, training):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p if training else 0.0)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype).masked_fill_(~attn_mask, torch.finfo(q.dtype).min)
    return _AttentionWithDropout.apply(q, k, v, attn_mask, p)
