"""What a fine-tuning objective is, and plain fine-tuning with the label-regularisation targets.

Objectives see the batch (with the examples' stable `index` and their `row` in the train split)
and the epoch, and return (loss, logits, logs). `LabelregObjective` is plain fine-tuning and every
label-regularisation target; SoTeacher and TGT (finetune/soteacher.py, finetune/tgt.py) supply their own.
An objective with state that must survive a restart (SoTeacher's store, TGT's sampling generator)
has `state_dict`/`load_state_dict`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from megakd.config import ConfigError
from megakd.data.tasks import EncodedTask
from megakd.data.tokenizer import Tokenizer
from megakd.finetune.config import LabelregConfig
from megakd.finetune.predict import predict
from megakd.finetune.runtime import Runtime
from megakd.models.electra import SequenceClassifier
from megakd.objectives.labelreg import akd_temperature, annealing_kd_loss, labelreg_loss
from megakd.store import check_same_tokenizer, freeze
from megakd.store.model_dir import load_classifier


class Objective(Protocol):
    def loss(self, model: SequenceClassifier, batch: dict[str, Tensor], epoch: int
             ) -> tuple[Tensor, Tensor, dict[str, float]]: ...


ObjectiveFactory = Callable[[int, SequenceClassifier, Tokenizer, EncodedTask, Path], Objective]


class LabelregObjective:
    """Plain fine-tuning (one-hot CE, or MSE for regression) and the label-regularisation targets.

    KD/self-KD teacher logits are computed once for the whole train split before training (the
    teacher is frozen and in eval mode, so they would be the same at every step).
    """

    def __init__(self, cfg: LabelregConfig, num_labels: int, teacher_logits: Tensor | None = None):
        self.cfg, self.num_labels, self.teacher_logits = cfg, num_labels, teacher_logits

    def loss(self, model: SequenceClassifier, batch: dict[str, Tensor], epoch: int
             ) -> tuple[Tensor, Tensor, dict[str, float]]:
        logits = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        return self.loss_from_logits(logits, batch, epoch), logits, {}

    def loss_from_logits(self, logits: Tensor, batch: dict[str, Tensor], epoch: int = 0) -> Tensor:
        if self.num_labels == 1:
            return F.mse_loss(logits.squeeze(-1), batch["labels"])
        c = self.cfg
        teacher = None if self.teacher_logits is None else self.teacher_logits[batch["row"].cpu()].to(logits.device)
        if c.target == "akd":
            temperature = akd_temperature(epoch, c.akd_phase1_epochs, c.temperature)
            if temperature is None:  # phase II
                return F.cross_entropy(logits, batch["labels"])
            return annealing_kd_loss(logits, teacher, temperature, c.temperature)
        return labelreg_loss(logits, batch["labels"], c.target, alpha=c.alpha, a=c.a, temperature=c.temperature,
                              tau_squared=c.tau_squared, teacher_logits=teacher)


def teacher_logits_for(path: str, key: str, student_tokenizer: Tokenizer, train: EncodedTask, num_labels: int,
                       batch_size: int, runtime: Runtime) -> Tensor:
    """Logits of a fine-tuned classifier directory on every train example (checked to share the tokenizer)."""
    teacher, tokenizer = load_classifier(path)
    check_same_tokenizer(student_tokenizer, tokenizer, key)
    if teacher.num_labels != num_labels:
        raise ConfigError(f"{key}: {path} has {teacher.num_labels} labels, the task {num_labels}")
    teacher.to(runtime.device)
    return torch.from_numpy(predict(freeze(teacher), train, batch_size, runtime))
