"""DWT: distillation from a weak (smaller) teacher into a larger student (Lee et al., ACL'23; docs/methods.md § DWT).

`megakd distill -c configs/dwt-*.yaml` is the pretraining trainer with a frozen teacher attached
to the student's MLM loss (`engine.tasks.TeacherKD`): the same data, masking, backends,
checkpoints, resume and metrics, plus `kd_loss` and `alpha_soft` in metrics.jsonl.

The student is `model.generator`: a BERT-MLM (`model.objective=mlm`, DWT as published) or an
ELECTRA generator (`model.objective=electra`). For ELECTRA the KD goes into the generator's MLM
head only — the direct analogue of the paper (which is plain BERT-MLM; docs/methods.md § DWT); the discriminator
trains on the distilled generator's samples as usual, and no RTD teacher is involved.
"""

from __future__ import annotations

from megakd.config import Config, ConfigError
from megakd.engine.pretrain import run_pretraining
from megakd.engine.trainer import TrainResult


def run_distill(cfg: Config, resume: str | None = None, allow_change: tuple[str, ...] = ()) -> TrainResult:
    """`megakd distill`: pretraining with `distill.teacher` attached (required here).

    The teacher is loaded, frozen, checked against the data's tokenizer and optionally remapped
    into the student by `megakd.engine.pretrain.attach_teacher`.
    """
    if not cfg.distill.teacher:
        raise ConfigError("distill.teacher: expected a teacher (run, checkpoint, model dir or HF MLM dir); "
                          "without one use `megakd pretrain`")
    return run_pretraining(cfg, resume=resume, allow_change=allow_change)
