"""Held-out validation during pretraining: fixed samples, fixed masks, fixed sampling seed.

Every `train.eval_every` steps the models are scored on the first `train.eval_samples` samples
of the validation shards in one fixed order (the loader's epoch-0 order for `VALID_SEED`), read
once at the first evaluation and kept in memory (a few MB at seq 512). Masks
are a pure function of (seed, sample index) and the generator's replacements are drawn from a
generator reseeded with `VALID_SEED` before each evaluation, so two evaluations of the same
weights give the same numbers, and runs with different `train.seed` see the same samples and
masks. Nothing here touches the training RNG streams (dropout is off in eval mode; the loader
and the sampler own their generators), so a run with validation trains exactly as one without.

Every rank evaluates the same batches through its backend (so ZeRO-3's gathered forward works
and no result depends on the world size); rank 0 logs. The work is redundant across ranks, which
costs one evaluation's time on every rank: `megakd bench` style numbers are in tools/bench_validation.py.
"""

from __future__ import annotations

import contextlib

import torch

from megakd.data.loader import PretrainingLoader
from megakd.engine.backends import TrainingBackend, stat_sums, to_device
from megakd.engine.layouts import Layout
from megakd.engine.units import StepContext, Unit
from megakd.objectives.electra import roc_auc, rtd_labels

VALID_SEED = 0


class ForwardOnly:
    """A micro-batch run for scoring: the layout's forward passes through the backend, no backward."""

    def __init__(self, backend: TrainingBackend):
        self.backend = backend

    def unit(self, _unit: Unit) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def forward(self, unit: Unit, *args, **kwargs) -> dict:
        return self.backend.forward(unit, *args, **kwargs)

    def backward(self, _unit: Unit, _loss: torch.Tensor) -> None:
        pass


class Validator:
    def __init__(self, loader: PretrainingLoader, num_samples: int, backend: TrainingBackend, layout: Layout):
        self.loader = loader
        self.num_batches = max(1, min(num_samples, loader.num_samples) // loader.plan.micro_batch_size)
        self.batches: list[dict[str, torch.Tensor]] | None = None  # read once, then kept (they never change)
        self.backend = backend
        self.layout = layout

    @torch.no_grad()
    def evaluate(self, step: int = 0) -> dict[str, float]:
        """The layout's metrics on the held-out batches, prefixed val_ (val_gen_loss, val_gen_acc; ELECTRA adds
        val_disc_loss, val_rtd_f1, ..., and val_rtd_auc; DWT adds val_teacher_agreement). `step` is the
        training step (DWT's α_s)."""
        if self.batches is None:
            self.batches = [batch for _, batch in zip(range(self.num_batches), self.loader)]
        context = StepContext(index=step, rng=torch.Generator().manual_seed(VALID_SEED))
        run = ForwardOnly(self.backend)
        totals = stat_sums(self.backend.device)  # read once at the end, not per batch and statistic
        scores, labels = [], []
        self.layout.train(False)
        try:
            for cpu_batch in self.batches:
                batch = to_device(cpu_batch, self.backend.device)
                out = self.layout.micro_step(run, batch, context)
                for key, value in out.stats.items():
                    totals[key] += value.double()
                if out.rtd_logits is not None:  # to the host whole, then selected there
                    valid = cpu_batch["attention_mask"].bool()
                    scores.append(out.rtd_logits.float().cpu()[valid])
                    labels.append(rtd_labels(out.corrupted, batch["input_ids"]).cpu()[valid])
        finally:
            self.layout.train(True)
        names = sorted(totals)
        sums = dict(zip(names, torch.stack([totals[k] for k in names]).tolist())) if names else {}
        rec = {f"val_{k}": v for k, v in self.layout.ratios(sums).items()}
        auc = roc_auc(torch.cat(scores), torch.cat(labels)) if scores else None
        if auc is not None:
            rec["val_rtd_auc"] = auc
        return rec
