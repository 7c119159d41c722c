"""Fused kernels for megakd: Triton on CUDA, chunked torch elsewhere, each beside its reference.

Every public kernel takes ``backend="auto" | "triton" | "torch"``; see :mod:`.dispatch` for how
``auto`` resolves. This package imports nothing from megakd and imports Triton only lazily.
"""

from .attention import attention_keep_mask, relative_attention, relative_attention_reference
from .dispatch import BACKENDS, HEAD_BACKWARDS, head_backward, resolve_backend
from .linear_head import (
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_and_sample,
    fused_linear_cross_entropy_reference,
    fused_linear_kl,
    fused_linear_kl_reference,
    fused_linear_sample,
    fused_linear_sample_reference,
)
from .lipschitz import lipschitz_1norm, lipschitz_1norm_reference
from .rtd_loss import fused_rtd_loss, fused_rtd_loss_reference

__all__ = [
    "BACKENDS",
    "HEAD_BACKWARDS",
    "attention_keep_mask",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_and_sample",
    "fused_linear_cross_entropy_reference",
    "fused_linear_kl",
    "fused_linear_kl_reference",
    "fused_linear_sample",
    "fused_linear_sample_reference",
    "fused_rtd_loss",
    "fused_rtd_loss_reference",
    "head_backward",
    "lipschitz_1norm",
    "lipschitz_1norm_reference",
    "relative_attention",
    "relative_attention_reference",
    "resolve_backend",
]
