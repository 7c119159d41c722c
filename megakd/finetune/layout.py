"""The classifier as the engine trains it: its loss module and its training layout."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from megakd.engine.layouts import Layout, MicroStepOutput
from megakd.engine.units import Unit
from megakd.finetune.objectives import Objective
from megakd.models.electra import SequenceClassifier

UNIT = "classifier"  # the backend unit's name: checkpoint files classifier.safetensors, classifier.optim.pt


class ClassifierLoss(nn.Module):
    """What the backend wraps: the classifier, with the objective's loss as its forward.

    Every forward pass an objective makes (TGT's generated batch, SoTeacher's penalty) then runs
    inside one DDP/DeepSpeed forward, so gradients are synchronised once per step.
    """

    def __init__(self, model: SequenceClassifier, objective: Objective):
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, batch: dict[str, Tensor], epoch: int) -> dict:
        loss, logits, logs = self.objective.loss(self.model, batch, epoch)
        return {"loss": loss, "logits": logits, "logs": logs}


class ClassifierLayout(Layout):
    """Fine-tuning as a training layout: one unit (the classifier), one micro-batch per step.

    So a fine-tuning step goes through the same `backend.train_step` as pretraining (one agreement
    all-reduce on finiteness and stop signals, all-or-nothing update). The micro-batch is this
    rank's rows of the global batch; its loss is weighted by its share (`StepContext.loss_weight`,
    `Runtime.local_rows`), and the objectives' schedules read `StepContext.epoch`. The statistics are
    the logs' contributions to the global-batch means, in float64, and the rows trained (`samples`).
    """

    name = "classifier"

    def __init__(self, unit: Unit, world_size: int):
        super().__init__([unit], kd=None)
        self.unit = unit
        self.world_size = world_size

    def micro_step(self, run, batch, step):
        out = run.forward(self.unit, batch, step.epoch)
        run.backward(self.unit, out["loss"] * step.loss_weight)
        share = step.loss_weight / self.world_size  # this rank's part of a global-batch mean
        logs = {"loss": out["loss"].detach(), **out["logs"]}
        stats = {k: torch.as_tensor(v, dtype=torch.float64).detach() * share for k, v in logs.items()}
        return MicroStepOutput([out["loss"].detach()], {**stats, "samples": batch["real"].double()})

    def loss_modules(self):
        return []

    def ratios(self, sums):
        """Each logged value's mean over the interval's applied steps (`steps`)."""
        return {k: v / sums["steps"] for k, v in sums.items() if k not in _COUNTS}

    def optimizer_metrics(self, mean_norms, step_lrs):
        """The rate the last step used, and the mean gradient norm."""
        return {"lr": step_lrs[UNIT], "grad_norm": mean_norms.get(UNIT, 0.0)}

    def throughput(self, sums, seconds):
        return {"samples_per_s": sums["samples"] / max(seconds, 1e-9)}


_COUNTS = ("tokens", "samples", "steps")  # statistics that count rather than average
