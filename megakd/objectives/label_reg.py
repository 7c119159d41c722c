"""Label regularisation as one smoothed-target cross-entropy with pluggable targets (SPEC §2, §5).

Every method of Kobyzev et al. is "cross-entropy against a modified target":

- ``onehot``: H(q, p), q the one-hot label;
- ``ls``:     H((1−α)q + αu, p), u uniform over K classes;
- ``tfreg``:  H((1−α)q + α·p^d, p), p^d(k) = a on the true class and (1−a)/(K−1) elsewhere;
- ``kd``:     (1−α)·H(q, p) + α·s·KL(p^t_τ ‖ p_τ), s = τ² when ``tau_squared`` (Hinton's gradient
  rescaling, which RepDistiller and the SoTeacher code use) and 1 otherwise;
- ``selfkd``: ``kd`` with the teacher a frozen fine-tuned copy of the student.

With τ = 1, ``kd`` equals H((1−α)q + α·p^t, p) minus the teacher's entropy (a constant), so it
has the same gradient as the smoothed-target CE the paper writes; it is computed with the KL so
that τ ≠ 1 and τ² work too. Everything is a batch mean; the KL direction is teacher ‖ student.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

TARGETS = ("onehot", "ls", "tfreg", "kd", "selfkd")
TEACHER_TARGETS = ("kd", "selfkd")


def soft_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Batch mean of H(q, softmax(logits)) = −Σ_k q_k log p_k for target distributions q [B, K]."""
    return -(targets * F.log_softmax(logits, dim=-1)).sum(-1).mean()


def kl_divergence(teacher_logits: Tensor, student_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Batch mean of KL(softmax(teacher/τ) ‖ softmax(student/τ)); no τ² inside (the caller scales)."""
    log_pt = F.log_softmax(teacher_logits / temperature, dim=-1)
    log_ps = F.log_softmax(student_logits / temperature, dim=-1)
    return (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean()


def smoothed_targets(labels: Tensor, num_classes: int, target: str, alpha: float = 0.0,
                     a: float = 0.95, dtype: torch.dtype = torch.float32) -> Tensor:
    """The teacher-free targets q' [B, K] of ``onehot``, ``ls`` and ``tfreg``."""
    onehot = F.one_hot(labels.long(), num_classes).to(dtype)
    if target == "onehot":
        return onehot
    if target == "ls":
        return (1 - alpha) * onehot + alpha / num_classes
    if target == "tfreg":
        if num_classes < 2:
            raise ValueError("labelreg.target=tfreg: needs at least 2 classes")
        peaked = onehot * a + (1 - onehot) * (1 - a) / (num_classes - 1)
        return (1 - alpha) * onehot + alpha * peaked
    raise ValueError(f"labelreg.target: expected one of onehot, ls, tfreg here, got {target!r}")


def label_reg_loss(
    logits: Tensor,
    labels: Tensor,
    target: str = "onehot",
    *,
    alpha: float = 0.0,
    a: float = 0.95,
    temperature: float = 1.0,
    tau_squared: bool = False,
    teacher_logits: Tensor | None = None,
) -> Tensor:
    """The label-regularised loss of `logits` [B, K] for integer `labels` [B] (see module docstring)."""
    if target not in TARGETS:
        raise ValueError(f"labelreg.target: expected one of {', '.join(TARGETS)}, got {target!r}")
    if target in TEACHER_TARGETS:
        if teacher_logits is None:
            raise ValueError(f"labelreg.target={target}: needs teacher logits")
        ce = F.cross_entropy(logits, labels.long())
        scale = temperature**2 if tau_squared else 1.0
        return (1 - alpha) * ce + alpha * scale * kl_divergence(teacher_logits.detach(), logits, temperature)
    q = smoothed_targets(labels, logits.shape[-1], target, alpha, a, logits.dtype)
    return soft_cross_entropy(logits, q)
