"""DWT's soft loss and its weight schedule, as plain functions of tensors and numbers.

DWT (docs/methods.md § DWT) trains the student MLM with `α_h·CE + α_s(t)·τ²·KL(p_teacher^τ ‖ p_student^τ)`
over masked positions. The KL goes through the fused linear-KL kernel on the two models' masked
head features and tied decoder matrices, so [tokens × vocab] logits never exist. The τ² factor
keeps the soft gradient's scale independent of τ (Hinton et al.; none of the papers writes it,
docs/methods.md § The KD family): with it, raising τ for a very weak teacher changes the target's shape, not the
soft loss's weight against the hard loss.
"""

from __future__ import annotations

import math

import torch

from megakd.kernels import fused_linear_kl

ALPHA_SCHEDULES = ("constant", "linear", "cosine", "step")


def kd_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    student_bias: torch.Tensor | None,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    temperature: float = 1.0,
    backend: str = "auto",
) -> torch.Tensor:
    """τ²·mean over rows of KL(softmax(teacher/τ) ‖ softmax(student/τ)); no gradient reaches the teacher.

    Rows are the masked positions ([N, E_s] student and [N, E_t] teacher head features, in the same
    order); widths may differ, the vocabularies ([V, E] decoder matrices) must not. N = 0 gives 0.
    """
    kl = fused_linear_kl(
        student_hidden, student_weight, teacher_hidden, teacher_weight, temperature=temperature,
        student_bias=student_bias, teacher_bias=teacher_bias, backend=backend,
    )
    return kl * (temperature * temperature)


def alpha_schedule(kind: str, start: float, end: float, step: int, max_steps: int, step_at: float = 0.5) -> float:
    """α_s at 0-based optimizer step `step` of a `max_steps` run: `start` at the first step, `end` at the last.

    Progress is `step / (max_steps - 1)`, so both endpoints are actually used (a 1-step run uses
    `start`). constant: always `start`; linear and cosine: interpolate (cosine is flat at both
    ends); step: `start` while progress < `step_at`, then `end` — DWT's "Strong early, Normal
    later" finding (docs/methods.md § DWT) as a single switch.
    """
    if kind not in ALPHA_SCHEDULES:
        raise ValueError(f"distill.alpha_schedule: expected one of {', '.join(ALPHA_SCHEDULES)}, got {kind!r}")
    if kind == "constant":
        return start
    progress = min(1.0, max(0.0, step / (max_steps - 1))) if max_steps > 1 else 0.0
    if kind == "linear":
        return start + (end - start) * progress
    if kind == "cosine":
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return start if progress < step_at else end
