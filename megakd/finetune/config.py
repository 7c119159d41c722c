"""The `megakd finetune` config tree: task, model initialisation, optimisation, and the methods on top.

Loaded with `megakd.config.load_config(path, overrides, cls=FinetuneConfig)` (the strict loader of
`megakd.configio`), so unknown keys and bad values fail with a one-line error naming the key, as for
pretraining recipes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from megakd.config import (
    BackendConfig,
    KernelsConfig,
    OptimizerSettings,
    RunConfig,
    TaskConfig,
    check_below_limit,
    check_count,
    check_seed,
)
from megakd.configio import ConfigError, check_literals, shown
from megakd.finish import device_type, finish_backend, resolve_precision
from megakd.launch import Launch
from megakd.models.encoder import EncoderConfig
from megakd.objectives.labelreg import TARGETS
from megakd.objectives.soteacher import CR_SCHEDULES


@dataclass
class FinetuneRunConfig(RunConfig):
    """The shared run section with fine-tuning's defaults."""

    dir: str = "runs/finetune"  # the run directory: one seed_<s>/ per seed, summary.json
    keep_last: int = 2


@dataclass
class ModelInitConfig:
    """Where the encoder comes from.

    `path` is an HF directory from `megakd convert to-hf` (ElectraForPreTraining, ElectraForMaskedLM,
    BertForMaskedLM, ElectraModel, BertModel), a megakd model directory, a megakd pretraining run or
    checkpoint (its discriminator; the generator of a BERT-MLM run), or a fine-tuned classifier
    directory. `init: random` keeps that architecture and tokenizer but re-initialises every weight
    (the label-regularisation paper's random-init student); without a `path` it needs `tokenizer`
    and `encoder.*`.
    """

    path: str = ""  # HF dir, megakd model dir, pretraining run or checkpoint, or fine-tuned classifier dir
    init: Literal["pretrained", "random"] = "pretrained"  # random: path's architecture, fresh weights
    tokenizer: str = ""  # a megakd tokenizer dir; "" = the one that comes with `path`
    # The architecture with init=random and no path
    encoder: EncoderConfig = field(default_factory=lambda: EncoderConfig(num_layers=2, hidden_size=64, num_heads=2,
                                                                          intermediate_size=256))

    def validate(self) -> None:
        """What a random init without a path builds from; whether a path is required depends on where
        this section sits (`model`, `soteacher.student`), so the tree checks that."""
        if self.init == "random" and not self.path:
            if not self.tokenizer:
                raise ConfigError("model.tokenizer: required with init=random and no model path")
            try:
                self.encoder.validate()
            except ValueError as err:
                raise ConfigError(str(err).replace("model.", "model.encoder.", 1)) from None


AUTO_LR_ANCHORS = ((128, 1e-3), (768, 1e-4))  # (hidden size, AdaMax peak rate); README: the sweep
AUTO_LR_MAX = 3e-3  # the largest rate the RT sweep measured as good


def auto_lr(hidden_size: int) -> float:
    """`finetune.lr: auto`: the AdaMax peak rate for an encoder of this width.

    A power law in the width through two anchors: 1e-4 at hidden 768 (the dissertation's Table A.2
    value for BERT-base) and 1e-3 at hidden 128 (the best rate of the RT sweep for the tiny demo
    discriminator and its random-init twin, in the README), capped at 3e-3 for narrower models.
    """
    (h0, lr0), (h1, lr1) = AUTO_LR_ANCHORS
    exponent = math.log(lr0 / lr1) / math.log(h1 / h0)
    return min(AUTO_LR_MAX, lr1 * (h1 / hidden_size) ** exponent)


@dataclass
class FinetuneSettings(OptimizerSettings):
    """How each seed fine-tunes: docs/methods.md § Fine-tuning (Table A.2): AdaMax, linear decay after a
    warm-up fraction, ε 1e-6, β (0.9, 0.98), clip 1.0.

    `lr` is a rate, `auto` (`auto_lr` of the encoder's width) or a list of rates chosen on a
    held-out `lr_select_frac` slice of the training split (megakd/finetune/trainer.py).
    """

    # peak AdaMax rate; auto = from the encoder's width (`auto_lr`); a list = the one that scores best on the
    # lr_select_frac slice
    lr: float | list[float] | str = "auto"
    lr_select_frac: float = 0.1  # with a list of rates: the held-out slice of train that picks one
    epochs: int = 3  # passes over the training split per seed
    batch_size: int = 32  # the global batch (split over the ranks)
    eval_batch_size: int = 64  # batch of the dev-set predictions
    warmup_frac: float = 0.1  # fraction of the optimizer steps of linear warm-up (then linear decay to 0)
    # weight decay of the matrices (adamax: coupled L2, as torch's Adamax; adamw: decoupled)
    weight_decay: float = 0.0
    optimizer: Literal["adamax", "adamw"] = "adamax"  # adamw: ELECTRA's GLUE setting (docs/glue.md)
    # < 1: layer-wise LR decay; the head trains at lr, encoder layer i of L at lr·decay^(L+1−i), the embeddings
    # at lr·decay^(L+2) (docs/glue.md)
    layer_lr_decay: float = 1.0
    clip_norm: float = 1.0  # gradient-norm clipping bound of the classifier's parameters; 0 = no clipping
    dropout: float = 0.1  # encoder hidden dropout and classifier dropout
    max_seq_len: int = 256  # tokens per example, [CLS] and [SEP] included; longer ones are truncated
    seeds: list[int] = field(default_factory=lambda: [0])  # one run per seed; summary.json pools them
    log_every: int = 50  # write metrics every N optimizer steps
    # auto: bf16 on a CUDA device that supports it (fp32 with backend.name=deepspeed), fp32 on the CPU; the
    # run's config.yaml records the choice. bf16 = torch.autocast on the device (CPU or CUDA)
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    tf32: bool = True  # fp32 matmuls and convolutions on a CUDA device run in TF32; false = IEEE fp32
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: the rank's GPU if there is one

    def validate(self) -> None:
        for key in ("epochs", "batch_size", "eval_batch_size", "max_seq_len", "log_every"):
            check_count(f"finetune.{key}", getattr(self, key))
        for i, seed in enumerate(self.seeds):
            check_seed(f"finetune.seeds[{i}]", seed)
        if self.max_seq_len < 3:
            raise ConfigError(f"finetune.max_seq_len: expected >= 3 ([CLS] x [SEP]), got {self.max_seq_len}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"finetune.seeds: expected distinct seeds (a non-empty list), got {self.seeds}")
        if not 0.0 <= self.warmup_frac < 1.0:
            raise ConfigError(f"finetune.warmup_frac: expected a value in [0, 1), got {self.warmup_frac}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"finetune.dropout: expected a probability in [0, 1), got {self.dropout}")
        if isinstance(self.lr, str) and self.lr != "auto":
            raise ConfigError(f"finetune.lr: expected a number, a list of numbers or auto, got {shown(self.lr)}")
        rates = self.lr if isinstance(self.lr, list) else [] if isinstance(self.lr, str) else [self.lr]
        if isinstance(self.lr, list) and (not rates or len(set(rates)) != len(rates)):
            raise ConfigError(f"finetune.lr: expected a non-empty list of distinct rates, got {self.lr}")
        if any(r <= 0 for r in rates):
            raise ConfigError(f"finetune.lr: expected rates > 0, got {self.lr}")
        if not 0.0 < self.lr_select_frac < 1.0:
            raise ConfigError(f"finetune.lr_select_frac: expected a fraction in (0, 1), got {self.lr_select_frac}")
        if not 0.0 < self.layer_lr_decay <= 1.0:
            raise ConfigError(f"finetune.layer_lr_decay: expected a factor in (0, 1], got {self.layer_lr_decay}")
        self.validate_optimizer("finetune")


def finish_settings(settings: FinetuneSettings, backend: BackendConfig, launch: Launch) -> None:
    """`backend.name: auto` (`megakd.finish.finish_backend`) and `finetune.precision: auto` made concrete in
    place: bf16 on a CUDA device that supports it, fp32 on the CPU and under DeepSpeed, which refuses bf16
    here (`megakd.finish.resolve_precision`); the run's config.yaml records both choices."""
    finish_backend(backend, launch)
    settings.precision = resolve_precision(settings.precision, device_type(settings.device),
                                           bf16_allowed=backend.name != "deepspeed")


@dataclass
class LabelregConfig:
    # the training target: onehot (plain CE) | ls (label smoothing) | tfreg (teacher-free) | kd | selfkd |
    # akd (annealing KD); megakd/objectives/labelreg.py
    target: Literal[TARGETS] = "onehot"
    alpha: float = 0.0  # weight of the smoothing distribution / of the KD term
    a: float = 0.95  # TF-reg: probability of the true class in the teacher-free distribution
    temperature: float = 1.0  # KD τ; akd: the maximum temperature τ_max
    akd_phase1_epochs: int = 0  # akd: epochs of phase I (logit regression, T from τ_max to 1); the rest is CE
    tau_squared: bool = False  # scale the KD term by τ²
    teacher: str = ""  # kd / selfkd: a fine-tuned classifier directory (selfkd: a same-architecture copy)

    def validate(self, epochs: int) -> None:
        """`epochs` (finetune.epochs) bounds akd's phase I."""
        check_below_limit("labelreg.akd_phase1_epochs", self.akd_phase1_epochs)
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"labelreg.alpha: expected a value in [0, 1], got {self.alpha}")
        if not 0.0 < self.a <= 1.0:
            raise ConfigError(f"labelreg.a: expected a value in (0, 1], got {self.a}")
        if self.temperature <= 0:
            raise ConfigError(f"labelreg.temperature: expected > 0, got {self.temperature}")
        if self.target == "akd" and not (1 <= self.akd_phase1_epochs <= epochs and self.temperature >= 1):
            raise ConfigError(f"labelreg.akd_phase1_epochs and labelreg.temperature: akd needs 1 <= phase-I epochs "
                              f"<= finetune.epochs={epochs} and τ_max >= 1, got {self.akd_phase1_epochs} and "
                              f"{self.temperature}")
        if self.target in ("kd", "selfkd", "akd") and not self.teacher:
            raise ConfigError(f"labelreg.teacher: required with labelreg.target={self.target} "
                              "(a fine-tuned classifier directory)")


@dataclass
class SoTeacherConfig:
    """Student-oriented teacher training (docs/methods.md § SoTeacher). `enabled` trains a teacher, then a
    student by KD."""

    enabled: bool = False  # train a SoTeacher teacher (then its student) instead of plain fine-tuning
    lambda_lr: float = 1e-5  # Lipschitz penalty weight
    lambda_cr: float = 1.0  # consistency weight at the last epoch (λ_CR^max)
    cr_schedule: Literal[CR_SCHEDULES] = "linear"  # how λ_CR rises from 0 to lambda_cr over the epochs
    student: ModelInitConfig = field(default_factory=ModelInitConfig)  # the KD student of the teacher
    student_alpha: float = 0.5  # RepDistiller: α·CE + (1−α)·τ²·KL, α = 0.5, τ = 4
    student_temperature: float = 4.0  # τ of the student's KD term
    distill_student: bool = True  # false: train the teacher only

    def validate(self) -> None:
        if self.lambda_lr < 0 or self.lambda_cr < 0:
            raise ConfigError("soteacher.lambda_lr and soteacher.lambda_cr: expected >= 0")
        if self.enabled and self.distill_student and self.student.init == "pretrained" and not self.student.path:
            raise ConfigError("soteacher.student.path: required with soteacher.student.init=pretrained")


@dataclass
class TGTConfig:
    """Teacher Guided Training (docs/methods.md § TGT): a frozen MLM generator + a frozen fine-tuned labeler."""

    enabled: bool = False  # train on the labeler's soft labels of real and MLM-generated examples
    generator: str = ""  # an MLM: pretraining run/checkpoint (its generator), megakd model dir, HF MLM dir
    labeler: str = ""  # a fine-tuned classifier directory
    # random: resample masked tokens from the MLM; gradient: ascent steps on its input embeddings first
    mode: Literal["random", "gradient"] = "random"
    mask_prob: float = 0.15  # fraction p of tokens resampled
    noise_std: float = 0.0  # σ of Gaussian noise on the generator's input embeddings
    # gradient mode: paper (η·∇ of Σ H(h, f), discrete forward, straight-through backward) | normalized
    # (η·∇/‖∇‖ of KL(h ‖ f) on the soft mixture π·W_emb)
    ascent: Literal["paper", "normalized"] = "paper"
    step_size: float = 1.0  # gradient mode: η of each ascent step
    steps: int = 1  # gradient mode: ascent steps
    sampling_temperature: float = 1.0  # random mode

    def validate(self) -> None:
        check_below_limit("tgt.steps", self.steps)
        if self.enabled and not (self.generator and self.labeler):
            raise ConfigError("tgt.generator and tgt.labeler: both are required with tgt.enabled=true")
        if not 0.0 < self.mask_prob < 1.0:
            raise ConfigError(f"tgt.mask_prob: expected a value in (0, 1), got {self.mask_prob}")
        if self.noise_std < 0 or self.steps < 1 or self.step_size < 0:
            raise ConfigError("tgt.noise_std and tgt.step_size: expected >= 0; tgt.steps: expected >= 1")


@dataclass
class FinetuneConfig:
    run: FinetuneRunConfig = field(default_factory=FinetuneRunConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelInitConfig = field(default_factory=ModelInitConfig)
    finetune: FinetuneSettings = field(default_factory=FinetuneSettings)
    labelreg: LabelregConfig = field(default_factory=LabelregConfig)
    soteacher: SoTeacherConfig = field(default_factory=SoTeacherConfig)
    tgt: TGTConfig = field(default_factory=TGTConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)  # single, ddp, deepspeed (ZeRO 0-2) or auto
    kernels: KernelsConfig = field(default_factory=KernelsConfig)  # backend of the Lipschitz / sampling kernels

    @property
    def metric(self) -> str:
        return self.task.metric or ("spearman" if self.task.num_labels == 1 else "accuracy")

    def finish(self, launch: Launch) -> FinetuneConfig:
        """This config finished in place, at the command's entry before anything is built (`finish_settings`)."""
        finish_settings(self.finetune, self.backend, launch)
        return self

    def validate(self) -> FinetuneConfig:
        """Each section's own checks, then those across sections.

        A config with errors in several sections reports the first section's (in this order)."""
        check_literals(self)
        self.task.validate("task")
        if self.model.init == "pretrained" and not self.model.path:
            raise ConfigError("model.path: required with model.init=pretrained (or set model.init=random)")
        self.finetune.validate()
        self.run.validate()
        self._validate_backend()
        self.labelreg.validate(self.finetune.epochs)
        if self.task.num_labels == 1 and (self.labelreg.target != "onehot" or self.soteacher.enabled
                                          or self.tgt.enabled):
            raise ConfigError("task.num_labels=1 (regression): labelreg, soteacher and tgt need a classification task")
        self.soteacher.validate()
        self.tgt.validate()
        if self.tgt.enabled and self.soteacher.enabled:
            raise ConfigError("tgt.enabled and soteacher.enabled: choose one method per run")
        self.model.validate()
        self.soteacher.student.validate()
        return self

    def _validate_backend(self) -> None:
        """What fine-tuning runs on: single, ddp, or DeepSpeed ZeRO 0-2 (fp32; `auto` precision is fp32 there)
        for plain and label-reg runs."""
        b = self.backend
        if b.pipeline_stages != 1:
            raise ConfigError(f"backend.pipeline_stages: fine-tuning has no pipeline parallelism, "
                              f"got {b.pipeline_stages}")
        if b.name != "deepspeed":
            if b.zero_stage or b.deepspeed_config or b.grad_comm_dtype != "auto":
                raise ConfigError(f"backend.zero_stage, backend.deepspeed_config and backend.grad_comm_dtype need "
                                  f"backend.name=deepspeed, got {b.name!r}")
            return
        if b.zero_stage not in (0, 1, 2):
            raise ConfigError(f"backend.zero_stage: fine-tuning supports DeepSpeed ZeRO 0, 1 or 2 (evaluation and "
                              f"the saved model need whole parameters on every rank), got {b.zero_stage}")
        if b.deepspeed_config:
            raise ConfigError("backend.deepspeed_config: not supported by megakd finetune (its AdaMax has no "
                              "DeepSpeed offload counterpart); remove it")
        if self.finetune.precision == "bf16":
            raise ConfigError("finetune.precision=bf16 with backend.name=deepspeed: not supported; "
                              "use backend.name=ddp (bf16 autocast) or finetune.precision=fp32")
        if self.soteacher.enabled or self.tgt.enabled:
            raise ConfigError("backend.name=deepspeed: SoTeacher and TGT fine-tuning run on the single and ddp "
                              "backends only; use backend.name=ddp")
