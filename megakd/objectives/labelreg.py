"""Label regularisation as one smoothed-target cross-entropy with pluggable targets
(docs/methods.md § The KD family, § Label regularization for fine-tuning).

Every method of Kobyzev et al. is "cross-entropy against a modified target":

- ``onehot``: H(q, p), q the one-hot label;
- ``ls``:     H((1−α)q + αu, p), u uniform over K classes;
- ``tfreg``:  H((1−α)q + α·p^d, p), p^d(k) = a on the true class and (1−a)/(K−1) elsewhere;
- ``kd``:     (1−α)·H(q, p) + α·s·KL(p^t_τ ‖ p_τ), s = τ² when ``tau_squared`` (Hinton's gradient
  rescaling, which RepDistiller and the SoTeacher code use) and 1 otherwise;
- ``selfkd``: ``kd`` with the teacher a frozen fine-tuned copy of the student;
- ``akd``:    Annealing KD (Jafari et al. 2021), which the label-regularisation paper runs on SST-5
  (its Table 11: maximum temperature 10, 20 epochs of phase I, 10 of phase II). Phase I regresses
  the student's logits onto the teacher's scaled by Φ(T) = 1 − (T − 1)/τ_max,
  ‖z_s − Φ(T)·z_t‖² (summed over classes, batch mean), with no labels; T falls from τ_max in the
  first epoch to 1 in the last phase-I epoch, linearly over epochs (`akd_temperature`), so the
  target sharpens from z_t/τ_max to z_t. Phase II is plain CE on the labels. It is not a
  smoothed-target CE, so it has its own functions below instead of a branch of `labelreg_loss`.

With τ = 1, ``kd`` equals H((1−α)q + α·p^t, p) minus the teacher's entropy (a constant), so it
has the same gradient as the smoothed-target CE the paper writes; it is computed with the KL so
that τ ≠ 1 and τ² work too. Everything is a batch mean; the KL direction is teacher ‖ student.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

TARGETS = ("onehot", "ls", "tfreg", "kd", "selfkd", "akd")
TEACHER_TARGETS = ("kd", "selfkd", "akd")


def soft_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Batch mean of H(q, softmax(logits)) = −Σ_k q_k log p_k for target distributions q [B, K]."""
    return -(targets * F.log_softmax(logits, dim=-1)).sum(-1).mean()


def kl_divergence(teacher_logits: Tensor, student_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Batch mean of KL(softmax(teacher/τ) ‖ softmax(student/τ)); no τ² inside (the caller scales)."""
    log_pt = F.log_softmax(teacher_logits / temperature, dim=-1)
    log_ps = F.log_softmax(student_logits / temperature, dim=-1)
    return (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean()


def akd_temperature(epoch: int, phase1_epochs: int, max_temperature: float) -> float | None:
    """Annealing KD's T in 0-based `epoch`: τ_max in epoch 0, 1 in epoch `phase1_epochs` − 1, linear in
    between; None from epoch `phase1_epochs` on (phase II)."""
    if epoch >= phase1_epochs:
        return None
    if phase1_epochs == 1:
        return 1.0
    return max_temperature - (max_temperature - 1.0) * epoch / (phase1_epochs - 1)


def annealing_kd_loss(logits: Tensor, teacher_logits: Tensor, temperature: float, max_temperature: float) -> Tensor:
    """Phase I of Annealing KD: batch mean of ‖z_s − Φ(T)·z_t‖², Φ(T) = 1 − (T − 1)/τ_max."""
    phi = 1.0 - (temperature - 1.0) / max_temperature
    return ((logits - phi * teacher_logits.detach().to(logits.dtype)) ** 2).sum(-1).mean()


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


def labelreg_loss(
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
    if target == "akd":
        raise ValueError("labelreg.target=akd depends on the epoch: use akd_temperature and annealing_kd_loss")
    if target in TEACHER_TARGETS:
        if teacher_logits is None:
            raise ValueError(f"labelreg.target={target}: needs teacher logits")
        ce = F.cross_entropy(logits, labels.long())
        scale = temperature**2 if tau_squared else 1.0
        return (1 - alpha) * ce + alpha * scale * kl_divergence(teacher_logits.detach(), logits, temperature)
    q = smoothed_targets(labels, logits.shape[-1], target, alpha, a, logits.dtype)
    return soft_cross_entropy(logits, q)
