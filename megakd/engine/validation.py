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

import torch

from megakd.data.stream import PretrainingLoader
from megakd.engine.backends import Backend, Unit
from megakd.engine.tasks import TeacherKD
from megakd.objectives.electra import corrupt, precision_recall_f1, roc_auc, rtd_labels, sample_replacements

VALID_SEED = 0


class Validator:
    def __init__(self, loader: PretrainingLoader, num_samples: int, backend: Backend, units: dict[str, Unit],
                 kd: TeacherKD | None = None, kernel_backend: str = "auto"):
        self.loader = loader
        self.num_batches = max(1, min(num_samples, loader.num_samples) // loader.plan.micro_batch_size)
        self.batches: list[dict[str, torch.Tensor]] | None = None  # read once, then kept (they never change)
        self.backend = backend
        self.units = units
        self.kd = kd
        self.kernel_backend = kernel_backend

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """val_gen_loss/acc, and for ELECTRA val_disc_loss, val_rtd_f1, val_rtd_auc; DWT adds val_teacher_agreement."""
        b = self.backend
        if self.batches is None:
            self.batches = [batch for _, batch in zip(range(self.num_batches), self.loader)]
        rng = torch.Generator().manual_seed(VALID_SEED)
        teacher_rng = torch.Generator().manual_seed(VALID_SEED)
        sums: dict[str, float] = {}
        scores, labels = [], []
        for unit in self.units.values():
            unit.task.eval()
        try:
            for cpu_batch in self.batches:
                batch = {k: v.to(b.device) for k, v in cpu_batch.items()}
                if "electra" in self.units:
                    out = b.forward(self.units["electra"], batch, rng)
                    gen_out = disc_out = out
                    corrupted = out["corrupted"]
                else:
                    gen_out = b.forward(self.units["generator"], batch, rng)
                    disc_out, corrupted = None, None
                    if "discriminator" in self.units:
                        corrupted = corrupt(batch["input_ids"], batch["mlm_mask"], gen_out["samples"])
                        disc_out = b.forward(self.units["discriminator"], corrupted, batch["input_ids"],
                                             batch["attention_mask"], batch.get("segment_ids"))
                for key, value in gen_out["stats"].items():
                    sums[key] = sums.get(key, 0.0) + float(value)
                if self.kd is not None:
                    sums["teacher_agree"] = sums.get("teacher_agree", 0.0) + float(
                        (self._teacher_argmax(batch, teacher_rng) == gen_out["argmax"]).sum())
                if disc_out is not None:
                    if disc_out is not gen_out:
                        for key, value in disc_out["stats"].items():
                            sums[key] = sums.get(key, 0.0) + float(value)
                    valid = batch["attention_mask"].bool()
                    scores.append(disc_out["logits"][valid].float().cpu())
                    labels.append(rtd_labels(corrupted, batch["input_ids"])[valid].cpu())
        finally:
            for unit in self.units.values():
                unit.task.train()
        return self._summary(sums, scores, labels)

    def _teacher_argmax(self, batch: dict, rng: torch.Generator) -> torch.Tensor:
        teacher = self.kd.teacher
        hidden = teacher.masked_hidden(teacher(batch["masked_input_ids"], batch["attention_mask"]), batch["mlm_mask"])
        head = teacher.head
        _, argmax = sample_replacements(hidden, head.decoder_weight, head.bias, rng, 1.0, self.kernel_backend)
        return argmax

    @staticmethod
    def _summary(s: dict[str, float], scores: list[torch.Tensor], labels: list[torch.Tensor]) -> dict[str, float]:
        rec = {"val_gen_loss": s["gen_loss_sum"] / s["masked"], "val_gen_acc": s["gen_correct"] / s["masked"]}
        if "teacher_agree" in s:
            rec["val_teacher_agreement"] = s["teacher_agree"] / s["masked"]
        if scores:
            rec["val_disc_loss"] = s["disc_loss_sum"] / s["rtd_tokens"]
            rec["val_disc_acc"] = s["rtd_correct"] / s["rtd_tokens"]
            rec["val_rtd_f1"] = precision_recall_f1(s["rtd_tp"], s["rtd_fp"], s["rtd_fn"])[2]
            auc = roc_auc(torch.cat(scores), torch.cat(labels))
            if auc is not None:
                rec["val_rtd_auc"] = auc
        return rec
