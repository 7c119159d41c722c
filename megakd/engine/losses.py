"""Loss-computing wrappers that a backend can wrap (DDP, DeepSpeed engines call `forward`).

Backends require the loss to come out of a module's `forward` so their gradient hooks and
accumulation logic see the whole computation; the math itself lives in `megakd.objectives`.
Each loss module returns its loss plus detached statistics as *sums/counts*, so the trainer can sum
them over micro-batches and ranks before dividing; the module's `ratios` turns those sums into
the logged ratios, so a statistic's name and its meaning live in one class.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megakd.models.electra import Discriminator, ElectraPair, MaskedLM
from megakd.objectives.distill import alpha_schedule, kd_loss
from megakd.objectives.electra import (
    SamplingTemperature,
    batch_positions,
    corrupt,
    mlm_loss_and_replacements,
    precision_recall_f1,
    rtd_counts,
    rtd_labels,
    rtd_loss,
    sample_replacements,
)


@dataclass
class TeacherKD:
    """DWT's frozen teacher and weights: loss = α_h·CE + α_s(t)·τ²·KL(p_teacher^τ ‖ p_student^τ).

    A plain object, not an nn.Module, so the teacher is no submodule of the loss module: backends
    (DDP, DeepSpeed ZeRO-3) never wrap, shard or synchronise it, `loss.train()` never switches
    it out of eval mode and checkpoints hold the student only.
    """

    teacher: MaskedLM
    temperature: float
    alpha_hard: float
    alpha_soft_start: float
    alpha_soft_end: float
    schedule: str
    max_steps: int
    step_at: float = 0.5

    def alpha_soft(self, step: int) -> float:
        """α_s at the 0-based optimizer step `step`."""
        return alpha_schedule(self.schedule, self.alpha_soft_start, self.alpha_soft_end, step, self.max_steps,
                              self.step_at)


class GeneratorLoss(nn.Module):
    """MLM over masked positions (sparse head) + sampling of replacement tokens.

    With a `TeacherKD` this is DWT: the teacher sees the same masked input and the KL runs over
    the same masked positions through the fused kernel. Under ELECTRA the KD goes into the
    generator's MLM head (the direct analogue of BERT-MLM DWT; docs/methods.md § DWT); the discriminator
    still learns from the student generator's samples. In eval mode (validation) it also counts
    where the teacher's argmax agrees with the student's, from the teacher pass the KD term made.
    """

    def __init__(self, model: MaskedLM, kernel_backend: str = "auto",
                 temperature: float | SamplingTemperature = 1.0, kd: TeacherKD | None = None):
        super().__init__()
        self.model = model
        self.kernel_backend = kernel_backend
        self.temperature = temperature if isinstance(temperature, SamplingTemperature) else \
            SamplingTemperature(temperature)
        self.kd = kd

    def with_model(self, model: MaskedLM) -> GeneratorLoss:
        """This loss (kernel backend, temperature, teacher) around another model: the pipeline's head
        module, whose model's encoder ran on earlier stages."""
        return type(self)(model, self.kernel_backend, self.temperature, self.kd)

    def forward(self, batch: dict[str, torch.Tensor], rng: torch.Generator | None = None, step: int = 0) -> dict:
        """`rng` draws the replacements; `step` (the 0-based optimizer step) sets DWT's α_s(t) and
        the sampling temperature."""
        positions = batch_positions(batch)  # the collate's, copied with the batch: no host sync
        segment_ids = batch.get("segment_ids")  # packed samples only
        hidden = self.model(batch["masked_input_ids"], batch["attention_mask"], segment_ids=segment_ids)
        masked_hidden = self.model.hidden_at(hidden, positions)
        targets = batch["input_ids"].reshape(-1).index_select(0, positions)
        head = self.model.head
        temperature = self.temperature.at(step)
        loss, samples, argmax = mlm_loss_and_replacements(masked_hidden, head.decoder_weight, head.bias, targets,
                                                          rng, temperature, self.kernel_backend)
        n = targets.numel()
        device = targets.device
        stats = {
            "gen_loss_sum": loss.detach().float() * n,
            "gen_correct": (argmax == targets).sum(),
            "masked": torch.full((), n, device=device),
        }
        if self.temperature.annealed:
            stats["temperature_sum"] = torch.full((), float(temperature), device=device)
            stats["gen_batches"] = torch.ones((), device=device)
        if self.kd is not None:
            teacher = self.kd.teacher
            with torch.no_grad():
                t_hidden = teacher.hidden_at(teacher(batch["masked_input_ids"], batch["attention_mask"],
                                                     segment_ids=segment_ids), positions)
            soft = kd_loss(masked_hidden, head.decoder_weight, head.bias, t_hidden, teacher.head.decoder_weight,
                           teacher.head.bias, self.kd.temperature, self.kernel_backend)
            alpha_soft = self.kd.alpha_soft(step)
            loss = self.kd.alpha_hard * loss + alpha_soft * soft
            stats["kd_loss_sum"] = soft.detach().float() * n
            stats["alpha_soft_sum"] = torch.full((), float(alpha_soft), device=device)
            stats["kd_batches"] = torch.ones((), device=device)
            if not self.training:
                # Only the argmax is read; the draw uses a throwaway generator, not a training stream.
                _, teacher_argmax = sample_replacements(
                    t_hidden, teacher.head.decoder_weight, teacher.head.bias,
                    torch.Generator(t_hidden.device).manual_seed(0), 1.0, self.kernel_backend)
                stats["teacher_agree"] = (teacher_argmax == argmax).sum()
        return {"loss": loss, "samples": samples, "argmax": argmax, "positions": positions, "stats": stats}

    @staticmethod
    def ratios(s: dict[str, float]) -> dict[str, float]:
        """gen_loss (CE per masked token), gen_acc; with an annealed temperature the interval's mean
        sampling_temperature; under DWT kd_loss (τ²·KL per masked token), the interval's mean
        alpha_soft and, in validation, teacher_agreement."""
        if not s.get("masked"):
            return {}
        out = {"gen_loss": s["gen_loss_sum"] / s["masked"], "gen_acc": s["gen_correct"] / s["masked"]}
        if s.get("gen_batches"):
            out["sampling_temperature"] = s["temperature_sum"] / s["gen_batches"]
        if s.get("kd_batches"):
            out["kd_loss"] = s["kd_loss_sum"] / s["masked"]
            out["alpha_soft"] = s["alpha_soft_sum"] / s["kd_batches"]
        if "teacher_agree" in s:
            out["teacher_agreement"] = s["teacher_agree"] / s["masked"]
        return out


class DiscriminatorLoss(nn.Module):
    """RTD over all non-padding tokens of the corrupted sequence (`segment_ids` for packed samples).

    `rtd_positions="masked"` (electra.rtd_positions) takes the loss over the masked positions only
    (`mlm_mask`), ELECTRA 15 %: the encoder still attends over the whole sequence, and the RTD counts
    (accuracy, F1) still cover every non-padding token, so runs of both settings log comparable metrics.
    """

    def __init__(self, model: Discriminator, kernel_backend: str = "auto", rtd_positions: str = "all"):
        super().__init__()
        self.model = model
        self.kernel_backend = kernel_backend
        self.rtd_positions = rtd_positions

    def with_model(self, model: Discriminator) -> DiscriminatorLoss:
        """This loss around another model (see `GeneratorLoss.with_model`)."""
        return type(self)(model, self.kernel_backend, self.rtd_positions)

    def loss_mask(self, attention_mask: torch.Tensor, mlm_mask: torch.Tensor | None) -> torch.Tensor:
        """The positions the loss is taken over: non-padding tokens, or under "masked" those also masked."""
        if self.rtd_positions == "all":
            return attention_mask
        if mlm_mask is None:
            raise ValueError("DiscriminatorLoss: rtd_positions='masked' needs the batch's mlm_mask")
        return attention_mask.bool() & mlm_mask.bool()

    def forward(self, corrupted: torch.Tensor, original: torch.Tensor, attention_mask: torch.Tensor,
                segment_ids: torch.Tensor | None = None, mlm_mask: torch.Tensor | None = None) -> dict:
        hidden = self.model(corrupted, attention_mask, segment_ids=segment_ids)
        transformed = self.model.head.transform(hidden)
        proj = self.model.head.prediction
        loss_mask = self.loss_mask(attention_mask, mlm_mask)
        loss = rtd_loss(transformed, proj.weight, proj.bias, corrupted, original, loss_mask, self.kernel_backend)
        with torch.no_grad():  # functional, not proj(...): under ZeRO-3 the module's forward hooks would
            # release proj.weight, which the loss's backward still needs (seen after a resume)
            logits = nn.functional.linear(transformed, proj.weight, proj.bias).squeeze(-1)
            counts = rtd_counts(logits, rtd_labels(corrupted, original), attention_mask)
        stats = {f"rtd_{k}": v for k, v in counts.items()}
        if self.rtd_positions == "all":
            stats["disc_loss_sum"] = loss.detach().float() * counts["tokens"]
        else:  # the loss is a mean over fewer positions: its own count keeps disc_loss a per-position BCE
            stats["disc_loss_tokens"] = loss_mask.sum()
            stats["disc_loss_sum"] = loss.detach().float() * stats["disc_loss_tokens"]
        stats["replaced"] = counts["tp"] + counts["fn"]
        return {"loss": loss, "logits": logits, "stats": stats}

    @staticmethod
    def ratios(s: dict[str, float]) -> dict[str, float]:
        """disc_loss (BCE per position of the loss: every non-padding token, or under rtd_positions=masked
        every masked one), disc_acc, RTD precision/recall/F1, replaced_frac (over non-padding tokens)."""
        if not s.get("rtd_tokens"):
            return {}
        p, r, f1 = precision_recall_f1(s["rtd_tp"], s["rtd_fp"], s["rtd_fn"])
        loss_tokens = max(s["disc_loss_tokens"], 1) if "disc_loss_tokens" in s else s["rtd_tokens"]
        return {"disc_loss": s["disc_loss_sum"] / loss_tokens, "disc_acc": s["rtd_correct"] / s["rtd_tokens"],
                "rtd_precision": p, "rtd_recall": r, "rtd_f1": f1, "replaced_frac": s["replaced"] / s["rtd_tokens"]}


class JointElectraLoss(nn.Module):
    """Original ELECTRA: one module, one optimizer, loss L_MLM + λ·L_RTD, shared embeddings allowed.

    `unweighted=True` returns L_MLM/λ + L_RTD instead, for a unit whose loss_scale is λ: the
    backward pass still sees L_MLM + λ·L_RTD, but the unit's clipping and its logged gradient norm
    are on the unweighted scale (optim.joint_clip=unweighted).
    """

    def __init__(self, pair: ElectraPair, loss_weight: float, kernel_backend: str = "auto",
                 temperature: float | SamplingTemperature = 1.0, kd: TeacherKD | None = None,
                 unweighted: bool = False, rtd_positions: str = "all"):
        super().__init__()
        self.model = pair
        # The per-model losses share the pair's parameters. A tuple keeps them out of the module tree,
        # so a wrapping engine's state dict names each parameter once, as "model.*" (what
        # megakd.convert reads from DeepSpeed checkpoints).
        self._parts = (GeneratorLoss(pair.generator, kernel_backend, temperature, kd),
                       DiscriminatorLoss(pair.discriminator, kernel_backend, rtd_positions))
        self.loss_weight = loss_weight
        self.unweighted = unweighted

    @property
    def parts(self) -> tuple[GeneratorLoss, DiscriminatorLoss]:
        return self._parts

    def train(self, mode: bool = True) -> JointElectraLoss:
        for part in self._parts:  # outside the module tree, so `nn.Module.train` would not reach them
            part.train(mode)
        return super().train(mode)

    def forward(self, batch: dict[str, torch.Tensor], rng: torch.Generator | None = None, step: int = 0) -> dict:
        generator_loss, discriminator_loss = self._parts
        gen = generator_loss(batch, rng, step)
        corrupted = corrupt(batch["input_ids"], batch["mlm_mask"], gen["samples"], gen["positions"])
        disc = discriminator_loss(corrupted, batch["input_ids"], batch["attention_mask"], batch.get("segment_ids"),
                                  batch["mlm_mask"])
        loss = gen["loss"] / self.loss_weight + disc["loss"] if self.unweighted else \
            gen["loss"] + self.loss_weight * disc["loss"]
        return {
            "loss": loss,
            "stats": {**gen["stats"], **disc["stats"]},
            "argmax": gen["argmax"], "corrupted": corrupted, "logits": disc["logits"],
        }
