"""Training layouts: everything that differs between the ways megakd trains its models, in one place.

A layout owns its units (their names, the model each one checkpoints, its optimizer, clipping and
loss scale), the work of one micro-batch (which unit runs forward on what, which losses go
backward), and how the summed statistics of its loss modules become logged ratios. The trainer, every
backend, validation, the pipeline stages and the benchmark ask the layout; none of them branches
on unit names. Adding an objective means adding a layout here (and its tests).

    DecoupledElectra  units generator + discriminator: two optimizers, λ folded into the
                      discriminator's clipping (docs/decisions.md § λ is folded into the
                      discriminator's clipping threshold)
    JointElectra      unit electra: one ElectraPair with shared embeddings, one optimizer on
                      L_MLM + λ·L_RTD (original ELECTRA)
    MaskedLMOnly      unit generator: BERT-MLM

DWT attaches a frozen teacher (`TeacherKD`) to the generator's MLM loss in any of them.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor, nn

from megakd.config import Config, OptimConfig, OptimizerConfig
from megakd.engine.losses import DiscriminatorLoss, GeneratorLoss, JointElectraLoss, TeacherKD
from megakd.engine.optim import build_optimizer, build_scheduler
from megakd.engine.profiling import phase
from megakd.engine.units import MicroBatchRun, StepContext, Unit
from megakd.models.electra import Discriminator, ElectraPair, MaskedLM
from megakd.objectives.electra import corrupt
from megakd.store.checkpoint_models import JOINT_UNIT

log = logging.getLogger(__name__)


@dataclass
class MicroStepOutput:
    """What one micro-batch produced: detached losses (checked for finiteness) and summed statistics."""

    losses: list[Tensor]
    stats: dict[str, Tensor]
    rtd_logits: Tensor | None = None  # the discriminator's logits (validation's ROC AUC reads them)
    corrupted: Tensor | None = None  # the ids the discriminator saw


class Layout:
    """The units of one training layout and how a micro-batch runs through them.

    `micro_step` drives a `MicroBatchRun`: a backend's `MicroBatch` (forward/backward for one micro-batch);
    validation drives the same `micro_step` with a run whose backward does nothing.
    """

    name: ClassVar[str]

    def __init__(self, units: list[Unit], kd: TeacherKD | None):
        self.units = {u.name: u for u in units}
        self.kd = kd  # DWT's teacher, attached to the generator's MLM loss

    @classmethod
    def build(cls, cfg: Config, generator: MaskedLM, discriminator: Discriminator | None,
              kd: TeacherKD | None) -> Layout:
        raise NotImplementedError

    def micro_step(self, run: MicroBatchRun, batch: dict[str, Tensor], step: StepContext) -> MicroStepOutput:
        raise NotImplementedError

    def loss_modules(self) -> list[nn.Module]:
        """The loss modules whose statistics this layout's steps return (their `ratios` read them)."""
        raise NotImplementedError

    def ratios(self, sums: dict[str, float]) -> dict[str, float]:
        """Ratios from statistics summed over micro-batches, steps and ranks (training and validation); a
        training log line adds `steps`, the applied steps the sums cover."""
        out: dict[str, float] = {}
        for module in self.loss_modules():
            out.update(module.ratios(sums))
        return out

    def optimizer_metrics(self, mean_norms: dict[str, float], step_lrs: dict[str, float]) -> dict[str, float]:
        """lr_<unit> (the rate of the step after the line) and grad_norm_<unit> (the mean over the interval's
        applied steps); `step_lrs` are the rates the last step used."""
        out = {}
        for name, unit in self.units.items():
            out[f"lr_{name}"] = unit.lr
            out[f"grad_norm_{name}"] = mean_norms.get(name, 0.0)
        return out

    def throughput(self, sums: dict[str, float], seconds: float) -> dict[str, float]:
        """The log line's rate over `seconds` of training (`sums`: the interval's statistics over all ranks)."""
        return {"tokens_per_s": sums.get("tokens", 0.0) / max(seconds, 1e-9)}

    def probe_encoder(self) -> nn.Module:
        """The encoder a downstream task would fine-tune."""
        raise NotImplementedError

    def pipeline_units(self) -> tuple[Unit, Unit | None]:
        """(generator unit, discriminator unit or None): the models a pipeline runs one after the other.

        The pipeline's heads (megakd/engine/pipeline.py) compute what `micro_step` computes through the
        layout's pieces (`generator_inputs`, and with a discriminator `corrupted`, `discriminator_inputs`
        and `combined_loss`), so a change to the step is made here once.
        """
        raise NotImplementedError(f"{self.name}: no pipeline-parallel form")

    @staticmethod
    def generator_inputs(batch: dict[str, Tensor], step: StepContext) -> tuple:
        """The generator's loss module's arguments (the joint one's too): the micro-batch, the sampling
        stream and the step index (DWT's α_s(t), the sampling temperature)."""
        return batch, step.rng, step.index

    def train(self, mode: bool = True) -> None:
        for unit in self.units.values():
            unit.loss_module.train(mode)


def _unit(cfg: Config, name: str, loss_module: nn.Module, model: nn.Module, opt_cfg: OptimizerConfig,
          loss_scale: float = 1.0) -> Unit:
    optimizer = build_optimizer(model.named_parameters(), opt_cfg)
    return Unit(name=name, loss_module=loss_module, model=model, optimizer=optimizer,
                scheduler=build_scheduler(optimizer, cfg.optim.schedule, cfg.train.max_steps),
                clip_norm=opt_cfg.clip_norm, loss_scale=loss_scale)


def _generator_loss(cfg: Config, generator: MaskedLM, kd: TeacherKD | None) -> GeneratorLoss:
    return GeneratorLoss(generator, cfg.kernels.backend, cfg.electra.temperature_schedule(cfg.train.max_steps), kd)


def _generator_pass(layout: Layout, run: MicroBatchRun, batch: dict[str, Tensor], step: StepContext) -> dict:
    """The `generator` unit's forward and backward on a micro-batch; its loss module's output."""
    gen = layout.units["generator"]
    with phase("generator"), run.unit(gen):
        g = run.forward(gen, *layout.generator_inputs(batch, step))
        run.backward(gen, g["loss"])
    return g


class MaskedLMOnly(Layout):
    """BERT-MLM: the generator alone, one unit."""

    name = "mlm"

    @classmethod
    def build(cls, cfg, generator, discriminator, kd):
        return cls([_unit(cfg, "generator", _generator_loss(cfg, generator, kd), generator, cfg.optim.generator)], kd)

    @property
    def generator(self) -> Unit:
        return self.units["generator"]

    def micro_step(self, run, batch, step):
        g = _generator_pass(self, run, batch, step)
        return MicroStepOutput([g["loss"].detach()], g["stats"])

    def loss_modules(self):
        return [self.generator.loss_module]

    def probe_encoder(self):
        return self.generator.model.encoder

    def pipeline_units(self):
        return self.generator, None


class DecoupledElectra(Layout):
    """DecoupledOptim ELECTRA: generator and discriminator units, each with its own backward and AdamW.

    The discriminator's loss is scaled by λ before backward and clipped at λ·clip_norm, so λ
    changes no update (docs/decisions.md § λ is folded into the discriminator's clipping threshold).
    """

    name = "electra-decoupled"

    @classmethod
    def build(cls, cfg, generator, discriminator, kd):
        return cls([
            _unit(cfg, "generator", _generator_loss(cfg, generator, kd), generator, cfg.optim.generator),
            _unit(cfg, "discriminator", DiscriminatorLoss(discriminator, cfg.kernels.backend,
                                                          cfg.electra.rtd_positions), discriminator,
                  cfg.optim.discriminator, loss_scale=cfg.electra.loss_weight),
        ], kd)

    @property
    def generator(self) -> Unit:
        return self.units["generator"]

    @property
    def discriminator(self) -> Unit:
        return self.units["discriminator"]

    def micro_step(self, run, batch, step):
        g = _generator_pass(self, run, batch, step)
        disc = self.discriminator
        with phase("discriminator"), run.unit(disc):
            corrupted = self.corrupted(batch, g)
            d = run.forward(disc, *self.discriminator_inputs(batch, corrupted))
            run.backward(disc, d["loss"])
        return MicroStepOutput([g["loss"].detach(), d["loss"].detach()], {**g["stats"], **d["stats"]},
                               rtd_logits=d["logits"], corrupted=corrupted)

    @staticmethod
    def corrupted(batch: dict[str, Tensor], g: dict) -> Tensor:
        """The discriminator's input: the batch's ids with the generator's samples (`g`, its loss module's
        output) at the masked positions."""
        return corrupt(batch["input_ids"], batch["mlm_mask"], g["samples"], g["positions"])

    @staticmethod
    def discriminator_inputs(batch: dict[str, Tensor], corrupted: Tensor) -> tuple:
        """The discriminator's loss module's arguments: RTD on `corrupted` against the batch's ids (and its
        masked positions, where electra.rtd_positions=masked takes the loss; the pipeline carries them too)."""
        return corrupted, batch["input_ids"], batch["attention_mask"], batch.get("segment_ids"), batch["mlm_mask"]

    def combined_loss(self, mlm_loss: Tensor, rtd_loss: Tensor) -> Tensor:
        """L_MLM + λ·L_RTD (λ: the discriminator's loss_scale), for a backend that runs both models in one
        graph (the pipeline): its one backward gives both models the gradients of `micro_step`'s two (the
        corrupted ids are integers, so no gradient crosses from the discriminator to the generator)."""
        return mlm_loss + self.discriminator.loss_scale * rtd_loss

    def loss_modules(self):
        return [self.generator.loss_module, self.discriminator.loss_module]

    def probe_encoder(self):
        return self.discriminator.model.encoder

    def pipeline_units(self):
        return self.generator, self.discriminator


class JointElectra(Layout):
    """Original ELECTRA: one ElectraPair (shared embeddings), one optimizer on L_MLM + λ·L_RTD.

    Configured by optim.discriminator.*; optim.joint_clip=unweighted clips the unweighted loss
    (the unit's loss_scale is then λ, and the loss module returns L_MLM/λ + L_RTD).
    """

    name = "electra-joint"

    @classmethod
    def build(cls, cfg, generator, discriminator, kd):
        ignored = _changed_keys(cfg.optim.generator, OptimConfig().generator, "optim.generator")
        if ignored:
            log.warning("%s: ignored with electra.decoupled=false (one optimizer, configured by "
                        "optim.discriminator.*)", ", ".join(ignored))
        pair = ElectraPair(generator, discriminator, share_embeddings=True)
        unweighted = cfg.optim.joint_clip == "unweighted"
        loss_module = JointElectraLoss(pair, cfg.electra.loss_weight, cfg.kernels.backend,
                                cfg.electra.temperature_schedule(cfg.train.max_steps),
                                kd, unweighted=unweighted, rtd_positions=cfg.electra.rtd_positions)
        return cls([_unit(cfg, JOINT_UNIT, loss_module, pair, cfg.optim.discriminator,
                          loss_scale=cfg.electra.loss_weight if unweighted else 1.0)], kd)

    @property
    def electra(self) -> Unit:
        return self.units[JOINT_UNIT]

    def micro_step(self, run, batch, step):
        unit = self.electra
        with run.unit(unit):
            out = run.forward(unit, *self.generator_inputs(batch, step))
            run.backward(unit, out["loss"])
        return MicroStepOutput([out["loss"].detach()], out["stats"], rtd_logits=out["logits"],
                               corrupted=out["corrupted"])

    def loss_modules(self):
        return list(self.electra.loss_module.parts)

    def optimizer_metrics(self, mean_norms, step_lrs):
        """One optimizer drives both models: logged under both names, as the decoupled layout logs them."""
        unit = self.electra
        norm = mean_norms.get(JOINT_UNIT, 0.0)
        return {"lr_discriminator": unit.lr, "grad_norm_discriminator": norm,
                "lr_generator": unit.lr, "grad_norm_generator": norm}

    def probe_encoder(self):
        return self.electra.model.discriminator.encoder


def layout_class(cfg: Config) -> type[Layout]:
    """The layout `model.objective` and `electra.decoupled` select."""
    if cfg.model.objective == "mlm":
        return MaskedLMOnly
    return DecoupledElectra if cfg.electra.decoupled else JointElectra


def build_layout(cfg: Config, generator: MaskedLM, discriminator: Discriminator | None,
                 kd: TeacherKD | None = None) -> Layout:
    """The layout of `cfg` over models already built and initialized (units not yet wrapped by a backend)."""
    return layout_class(cfg).build(cfg, generator, discriminator, kd)


def _changed_keys(value: OptimizerConfig, default: OptimizerConfig, prefix: str) -> list[str]:
    """`prefix.field=value` for every field of `value` that differs from `default`."""
    return [f"{prefix}.{f.name}={getattr(value, f.name)}" for f in dataclasses.fields(value)
            if getattr(value, f.name) != getattr(default, f.name)]

