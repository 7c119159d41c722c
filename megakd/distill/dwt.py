"""DWT: distillation from a weak (smaller) teacher into a larger student (Lee et al., ACL'23; SPEC §4).

`megakd distill -c configs/dwt-*.yaml` is the pretraining trainer with a frozen teacher attached
to the student's MLM loss (`engine.tasks.TeacherKD`): the same data, masking, backends,
checkpoints, resume and metrics, plus `kd_loss` and `alpha_soft` in metrics.jsonl.

The student is `model.generator`: a BERT-MLM (`model.objective=mlm`, DWT as published) or an
ELECTRA generator (`model.objective=electra`). For ELECTRA the KD goes into the generator's MLM
head only — the direct analogue of the paper (SPEC §4.4 leaves it open); the discriminator
trains on the distilled generator's samples as usual, and no RTD teacher is involved.
"""

from __future__ import annotations

import logging

import torch

from megakd.config import Config, ConfigError
from megakd.data.tokenizer import Tokenizer
from megakd.distill.pretrained import check_tokenizer, load_pretrained
from megakd.engine.pretrain import run_pretraining
from megakd.engine.tasks import TeacherKD
from megakd.engine.trainer import TrainResult
from megakd.models.electra import MaskedLM
from megakd.models.remap import remap_masked_lm

log = logging.getLogger(__name__)


def attach_teacher(cfg: Config, tokenizer: Tokenizer, student: MaskedLM, device: torch.device) -> TeacherKD:
    """Load `distill.teacher` frozen on `device`, check it shares `tokenizer`, optionally remap `student` from it."""
    d = cfg.distill
    teacher = load_pretrained(d.teacher, "masked_lm", "distill.teacher")
    check_tokenizer(teacher, tokenizer, "distill.teacher")
    model: MaskedLM = teacher.model.to(device)
    if d.init == "remap":
        try:
            remap_masked_lm(model, student, d.remap_width)
        except ValueError as err:
            raise ConfigError(f"distill.init=remap with distill.teacher={d.teacher}: {err}") from None
    t, s = model.config, student.config
    log.info("DWT teacher %s: %d layers x %d hidden (%.1fM params) -> student %d x %d (%.1fM), init %s",
             d.teacher, t.num_layers, t.hidden_size, _millions(model), s.num_layers, s.hidden_size,
             _millions(student), d.init)
    return TeacherKD(model, d.temperature, d.alpha_hard, d.alpha_soft_start, d.alpha_soft_end, d.alpha_schedule,
                     cfg.train.max_steps, d.alpha_step_at)


def _millions(model: torch.nn.Module) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e6


def run_distill(cfg: Config, resume: str | None = None) -> TrainResult:
    """`megakd distill`: pretraining with `distill.teacher` attached (required here)."""
    if not cfg.distill.teacher:
        raise ConfigError("distill.teacher: expected a teacher (run, checkpoint, model dir or HF MLM dir); "
                          "without one use `megakd pretrain`")
    return run_pretraining(cfg, resume=resume)
