"""Configuration: one dataclass tree, YAML recipes with inheritance, `a.b=c` overrides.

Every key is checked: an unknown or mistyped key, or a value of the wrong type, raises
`ConfigError` with a one-line message naming the key (and the file it came from), so a typo in a
125K-step job fails in the first second instead of silently training the wrong model.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import keyword
import math
import reprlib
import tokenize
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from megakd.errors import UserError
from megakd.kernels import BACKENDS
from megakd.models.encoder import EncoderConfig
from megakd.objectives.distill import ALPHA_SCHEDULES
from megakd.objectives.electra import SamplingTemperature

JOINT_CLIPS = ("weighted", "unweighted")


class ConfigError(UserError):
    """A config file or override is invalid; the message names the key."""


SHOWN_CHARS = 200
_shown = reprlib.Repr()
_shown.maxstring = _shown.maxother = _shown.maxlong = SHOWN_CHARS
_shown.maxlist = _shown.maxtuple = _shown.maxdict = 8
_shown.maxlevel = 3


def shown(value: Any) -> str:
    """`repr(value)` for an error message, at most ~SHOWN_CHARS characters: a 1 MB string or a deeply
    shared YAML structure would otherwise make the one-line message megabytes (or gigabytes) long."""
    text = _shown.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


# Seeds feed numpy's legacy seeding (np.random.seed takes [0, 2**32)), and the derived per-rank
# seeds (seed * 1_000_003 + rank, megakd/engine/pretrain.py) must stay inside torch.manual_seed's
# 64-bit range. Step counts, batch sizes and intervals beyond 2**31 are typos, and some end up in
# 32-bit tensors.
SEED_LIMIT = 2**32
COUNT_LIMIT = 2**31


def check_seed(key: str, value: int) -> None:
    if not 0 <= value < SEED_LIMIT:
        raise ConfigError(f"{key}: expected a seed in [0, 2**32), got {value}")


def check_count(key: str, value: int) -> None:
    """`value` in [1, 2**31); the message for a value below 1 is the one these keys always had."""
    if value < 1:
        raise ConfigError(f"{key}: expected a positive integer, got {value}")
    if value >= COUNT_LIMIT:
        raise ConfigError(f"{key}: expected an integer below 2**31, got {value}")


@dataclass
class RunConfig:
    dir: str = "runs/electra-tiny"  # the run directory: config, metrics, checkpoints, plots, HF export
    keep_last: int = 3  # checkpoints kept in run.dir/checkpoints (older ones are deleted)
    tensorboard: bool = True  # write TensorBoard events to run.dir/tb
    wandb: bool = False  # log to Weights & Biases too (one wandb run per run directory, resumed on requeue)
    wandb_project: str = "megakd"  # the wandb project
    wandb_mode: Literal["offline", "online"] = "offline"  # offline keeps the run on disk; WANDB_MODE wins
    plots: bool = True  # draw loss and RTD plots into run.dir/plots at the end of training
    export_hf: bool = True  # write run.dir/hf (HuggingFace format) at the end of training
    progress_bar: bool = True  # a tqdm bar on rank 0
    overwrite: bool = False  # a new run into a used run.dir moves its contents to <run.dir>.old-<time>/


@dataclass
class DataConfig:
    tokenizer: str = ""  # `megakd data tokenizer` dir or an HF tokenizer dir; empty = built from the bundled corpus
    shards: str = ""  # directory from `megakd data shards`; empty = built from the bundled corpus
    corpus: Literal["classic", "mixed"] = "classic"  # bundled corpus when tokenizer/shards are unset: classic (Austen + KJV) | mixed (+ modern text + RT train)
    # Size of the bundled-corpus tokenizer (unused with data.tokenizer); "auto" = the models'
    # explicit vocab_size if one is given, else BUNDLED_VOCAB_SIZE.
    vocab_size: int | str = "auto"
    seq_len: int = 128  # only used when building the bundled-corpus default (shards carry their own)
    # Where the bundled-corpus default is built once and fetched shard indexes are kept (put it on
    # node-local disk on a cluster); "" = $MEGAKD_CACHE or ~/.cache/megakd
    cache_dir: str = ""
    mask_prob: float = 0.15  # fraction of tokens masked for the MLM (and replaced for RTD)
    num_workers: int = 0  # DataLoader worker processes per rank (0 = load in the training process)
    # Shards whose samples are interleaved in one seeded permutation (held in memory together, per
    # rank and per worker): shards are written in input order, so with 1 a batch is a few pages of
    # one book, and a masked LM on the bundled corpus left its unigram plateau ~200 steps later.
    shuffle_shards: int = 16
    skip_bad_shards: bool = False  # log, count and skip a missing or corrupt shard instead of stopping
    # Consecutive samples of a shard kept together in the order, so that each is fetched with fewer,
    # larger reads (object stores); 1 = every sample placed on its own. Pair > 1 with shards written
    # by `megakd data shards --shuffle`. Part of the order: a resume must keep it.
    read_block: int = 1
    # Bytes of gaps between its samples that a ranged read may read through to save requests, as a
    # fraction of the bytes it needs (a reader fetches at most 1 + this times its share).
    read_overfetch: float = 0.2
    # Tries after a transient storage error (connection reset, timeout, 5xx, throttling), with
    # backoff from 0.25 s doubling to 30 s (8: about a minute); then the run saves and stops.
    read_retries: int = 8
    # Held-out shards for train.eval_every; "auto" = <data.shards>/valid when it exists
    # (`megakd data shards --valid-fraction`), "" = none.
    valid_shards: str = "auto"


BUNDLED_VOCAB_SIZE = 8000


def _auto_vocab_encoder() -> EncoderConfig:
    return EncoderConfig(vocab_size="auto")


@dataclass
class ModelConfig:
    objective: Literal["electra", "mlm"] = "electra"  # electra (generator + discriminator); mlm (BERT-MLM: the generator alone)
    # The generator (ELECTRA), the masked LM (BERT-MLM) or the DWT student. vocab_size "auto" (the
    # default) = the tokenizer's size, filled in by `resolve_vocab_sizes`.
    generator: EncoderConfig = field(default_factory=_auto_vocab_encoder)
    discriminator: EncoderConfig = field(default_factory=_auto_vocab_encoder)  # the ELECTRA discriminator

    def built_models(self) -> tuple[str, ...]:
        return ("generator",) if self.objective == "mlm" else ("generator", "discriminator")


@dataclass
class ElectraConfig:
    decoupled: bool = True  # DecoupledOptim: separate embeddings, two optimizers
    loss_weight: float = 50.0  # λ in L_MLM + λ·L_RTD
    sampling_temperature: float = 1.0  # temperature of the generator's samples that replace masked tokens
    # Anneal linearly from sampling_temperature to this over the first sampling_anneal_steps
    # optimizer steps (0 = train.max_steps), then hold it; null = constant.
    sampling_temperature_end: float | None = None
    sampling_anneal_steps: int = 0  # length of the anneal to sampling_temperature_end (0 = train.max_steps)

    def temperature_schedule(self, max_steps: int) -> SamplingTemperature:
        return SamplingTemperature(self.sampling_temperature, self.sampling_temperature_end,
                                   self.sampling_anneal_steps or max_steps)


@dataclass
class OptimizerConfig:
    lr: float = 5e-4  # peak learning rate (Adam), reached after optim.schedule.warmup_steps
    betas: tuple[float, float] = (0.9, 0.98)  # Adam β1, β2
    eps: float = 1e-6  # Adam ε
    weight_decay: float = 0.01  # decoupled (AdamW) weight decay
    clip_norm: float = 2.0  # gradient-norm clipping bound of this model's parameters; 0 = no clipping


@dataclass
class ScheduleConfig:
    warmup_steps: int = 0  # linear warm-up from 0 to the peak LR, shared by both optimizers
    # After warm-up; linear and cosine: to 0 at max_steps
    decay: Literal["linear", "cosine", "constant"] = "linear"


@dataclass
class OptimConfig:
    # The generator's (or masked LM's) optimizer
    generator: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=2e-4))
    # The discriminator's optimizer
    discriminator: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1.5e-3))
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)  # the LR schedule of both
    # Original ELECTRA (electra.decoupled=false) only: what optim.discriminator.clip_norm bounds.
    # weighted = ∇(L_MLM + λ·L_RTD), as original ELECTRA clips; unweighted = ∇(L_MLM/λ + L_RTD), the
    # scale DecoupledOptim clips the discriminator at (README: "λ, clipping and DecoupledOptim").
    joint_clip: Literal[JOINT_CLIPS] = "weighted"


BUILTIN_TASKS = ("rt", "rt_score", "corpus_pairs")
TASK_METRICS = ("accuracy", "f1", "mcc", "spearman")


@dataclass
class TaskConfig:
    """A built-in task (`name`) or your own GLUE-style TSV / JSONL files (`name: files`)."""

    # rt (Rotten Tomatoes sentiment), rt_score (the same sentences, regressing the crowd score),
    # corpus_pairs (does sentence b follow a in the bundled corpus), files (your own: train and dev)
    name: Literal[(*BUILTIN_TASKS, "files")] = "rt"
    train: str = ""  # files: the training split, .tsv/.tsv.gz (header row) or .jsonl/.jsonl.gz
    dev: str = ""  # files: the dev split, in the same format
    text_a: str = "sentence"  # files: column / field of the first sentence
    text_b: str = ""  # files: column / field of the second sentence; "" = single-sentence task
    label: str = "label"  # files: column / field of the label
    labels: list[str] = field(default_factory=list)  # class names in id order; [] = integer labels 0..K-1
    num_labels: int = 2  # 1 = regression (MSE, Spearman)
    metric: str = ""  # the headline metric; "" = spearman for regression, accuracy otherwise
    max_train_examples: int = 0  # 0 = all; otherwise a fixed subset spread evenly over the split
    max_dev_examples: int = 0  # 0 = all; otherwise a fixed subset of the dev split, as max_train_examples

    def validate(self, key: str) -> TaskConfig:
        """Check the task section found under config key `key` (`task`, `train.probe.task`)."""
        if self.name == "files" and not (self.train and self.dev):
            raise ConfigError(f"{key}.train and {key}.dev: both are required with {key}.name=files")
        if self.metric:
            check_choice(f"{key}.metric", self.metric, TASK_METRICS)
        if self.num_labels < 1:
            raise ConfigError(f"{key}.num_labels: expected >= 1 (1 = regression), got {self.num_labels}")
        if self.labels and len(self.labels) != self.num_labels:
            raise ConfigError(f"{key}.labels: expected {self.num_labels} names ({key}.num_labels), "
                              f"got {len(self.labels)}")
        for name in ("max_train_examples", "max_dev_examples"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{key}.{name}: expected >= 0 (0 = all), got {getattr(self, name)}")
        return self



@dataclass
class TrainConfig:
    max_steps: int = 1000  # optimizer steps of the whole run (the LR schedule ends here)
    seed: int = 0  # model init, data order, masks and dropout
    global_batch_size: int = 32  # samples per optimizer step, over all ranks and accumulation steps
    micro_batch_size: int = 32  # samples per rank per forward pass; accumulation fills the global batch
    log_every: int = 10  # write metrics every N steps
    save_every: int = 0  # also checkpoint every N steps; 0 = only the final checkpoint
    # bf16 / fp16: mixed precision (autocast; fp16 with loss scaling)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    max_bad_steps: int = 10  # stop after this many non-finite losses in a row
    # Downstream probe (megakd/engine/probe.py): logistic regression on frozen encoder features of
    # a fixed slice of a task's training split, logged as probe_acc every probe_every steps.
    probe_every: int = 500  # 0 = off; README: cost measured at this interval
    probe_task: TaskConfig = field(default_factory=TaskConfig)  # a classification task; rt by default
    probe_fit_examples: int = 2000  # examples the probe's logistic regression is fitted on
    probe_eval_examples: int = 500  # other examples of the same split it is scored on (probe_acc)
    probe_max_seq_len: int = 128  # capped by the model's max_position_embeddings
    eval_every: int = 0  # score the validation shards every N steps (0 = never)
    eval_samples: int = 512  # how many validation samples (whole micro-batches) each evaluation scores
    compile: bool = False  # torch.compile each encoder (generator, discriminator) in place


@dataclass
class BackendConfig:
    # auto: single in one process, ddp when a launcher started several ranks (WORLD_SIZE, or
    # SLURM_NTASKS under srun); resolved at start-up, so --print-config and the run's config.yaml
    # show the backend it chose
    name: Literal["auto", "single", "ddp", "deepspeed"] = "auto"
    zero_stage: int = 0  # DeepSpeed ZeRO stage 0-3 (backend.name=deepspeed)
    pipeline_stages: int = 1  # DeepSpeed pipeline stages (> 1 needs backend.name=deepspeed)
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on CUDA, gloo otherwise
    deepspeed_config: str = ""  # JSON merged into megakd's DeepSpeed config ("auto" = megakd's value)


@dataclass
class KernelsConfig:
    # The fused loss kernels: auto (Triton on CUDA if installed, else torch) | triton | torch
    backend: Literal[BACKENDS] = "auto"


@dataclass
class DistillConfig:
    """DWT: distil a frozen (possibly weaker) teacher MLM into the generator/BERT-MLM student."""

    teacher: str = ""  # run dir, checkpoint, megakd model dir or HF BERT/ELECTRA-MLM dir; "" = no teacher
    temperature: float = 1.0  # τ of both softmaxes; the soft loss is scaled by τ²
    alpha_hard: float = 1.0  # α_h on the MLM cross-entropy
    alpha_soft_start: float = 4.0  # α_s, the weight of the soft (KD) loss, at the first step ...
    alpha_soft_end: float = 1.0  # ... and at the last
    alpha_schedule: Literal[ALPHA_SCHEDULES] = "linear"  # α_s from start to end; constant = start throughout
    alpha_step_at: float = 0.5  # step schedule: fraction of the run after which α_s = end
    init: Literal["random", "remap"] = "random"  # remap: student initialised from the teacher (docs/methods.md § DWT)
    remap_width: Literal["net2wider", "zero"] = "net2wider"  # how remap widens a narrower teacher


@dataclass
class InitConfig:
    """Warm start: the models begin from stored weights instead of random init, with fresh optimizer
    state, at step 0. A path is a megakd run or checkpoint dir, a megakd model dir, or a local HF
    ELECTRA/BERT dir (`ElectraForPreTraining`, `ElectraForMaskedLM`, `BertForMaskedLM`,
    `BertForPreTraining`), or a dir with `generator/` and `discriminator/` HF subdirs (`convert to-hf`)."""

    from_: str = ""  # YAML key `from`: every model the path holds (discriminator, masked LM -> generator)
    generator: str = ""  # the generator / BERT-MLM / DWT student from this path (wins over `from`)
    discriminator: str = ""  # the discriminator from this path (wins over `from`)

    def source(self, model: str) -> tuple[str, str]:
        """(path, config key naming it) for `model` ("generator" | "discriminator"); ("", "") if none."""
        own = getattr(self, model)
        if own:
            return own, f"init.{model}"
        return (self.from_, "init.from") if self.from_ else ("", "")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    electra: ElectraConfig = field(default_factory=ElectraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    init: InitConfig = field(default_factory=InitConfig)

    def validate(self) -> Config:
        check_literals(self)
        self._validate_distill()
        self._validate_init()
        if self.data.vocab_size != "auto" and (isinstance(self.data.vocab_size, str) or self.data.vocab_size < 1):
            raise ConfigError(f"data.vocab_size: expected a positive integer or auto, "
                              f"got {shown(self.data.vocab_size)}")
        if self.backend.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"backend.zero_stage: expected 0, 1, 2 or 3, got {self.backend.zero_stage}")
        for key, value in (
            ("train.max_steps", self.train.max_steps),
            ("train.global_batch_size", self.train.global_batch_size),
            ("train.micro_batch_size", self.train.micro_batch_size),
            ("train.log_every", self.train.log_every),
            ("train.max_bad_steps", self.train.max_bad_steps),
            ("backend.pipeline_stages", self.backend.pipeline_stages),
            ("data.shuffle_shards", self.data.shuffle_shards),
            ("data.read_block", self.data.read_block),
        ):
            check_count(key, value)
        if not 0.0 <= self.data.read_overfetch <= 1e6:
            raise ConfigError(f"data.read_overfetch: expected a fraction >= 0 (extra bytes per byte needed), "
                              f"got {shown(self.data.read_overfetch)}")
        for key, value in (
            ("train.save_every", self.train.save_every),
            ("train.eval_every", self.train.eval_every),
            ("train.eval_samples", self.train.eval_samples),
            ("train.probe_every", self.train.probe_every),
            ("data.num_workers", self.data.num_workers),
            ("data.read_retries", self.data.read_retries),
            ("optim.schedule.warmup_steps", self.optim.schedule.warmup_steps),
            ("electra.sampling_anneal_steps", self.electra.sampling_anneal_steps),
            ("run.keep_last", self.run.keep_last),
        ):
            if value >= COUNT_LIMIT:
                raise ConfigError(f"{key}: expected an integer below 2**31, got {value}")
        if self.data.read_retries < 0:
            raise ConfigError(f"data.read_retries: expected an integer >= 0, got {self.data.read_retries}")
        check_seed("train.seed", self.train.seed)
        if self.train.probe_every < 0:
            raise ConfigError(f"train.probe_every: expected >= 0 (0 = off), got {self.train.probe_every}")
        if self.train.probe_every:
            self.train.probe_task.validate("train.probe_task")
            if self.train.probe_task.num_labels < 2:
                raise ConfigError("train.probe_task.num_labels: the probe needs a classification task (>= 2)")
            for key in ("probe_fit_examples", "probe_eval_examples", "probe_max_seq_len"):
                if getattr(self.train, key) < (3 if key == "probe_max_seq_len" else 1):
                    raise ConfigError(f"train.{key}: expected a positive integer, got {getattr(self.train, key)}")
                check_count(f"train.{key}", getattr(self.train, key))
        if not 0.0 < self.data.mask_prob < 1.0:
            raise ConfigError(f"data.mask_prob: expected a value in (0, 1), got {self.data.mask_prob}")
        if self.electra.loss_weight <= 0:
            raise ConfigError(f"electra.loss_weight: expected > 0, got {self.electra.loss_weight}")
        for key in ("sampling_temperature", "sampling_temperature_end"):
            value = getattr(self.electra, key)
            if value is not None and not value > 0:
                raise ConfigError(f"electra.{key}: expected > 0, got {value}")
        if self.electra.sampling_anneal_steps < 0:
            raise ConfigError(f"electra.sampling_anneal_steps: expected >= 0 (0 = train.max_steps), "
                              f"got {self.electra.sampling_anneal_steps}")
        for name in ("generator", "discriminator"):
            opt: OptimizerConfig = getattr(self.optim, name)
            if opt.lr < 0 or opt.clip_norm < 0 or opt.eps <= 0:
                raise ConfigError(f"optim.{name}: lr and clip_norm must be >= 0 and eps > 0")
            try:
                getattr(self.model, name).validate(allow_auto_vocab=True)
            except ValueError as err:
                # EncoderConfig names its fields "model.<field>"; qualify them with the model.
                raise ConfigError(str(err).replace("model.", f"model.{name}.", 1)) from None
        if self.model.objective == "electra" and not self.electra.decoupled:
            gen, disc = self.model.generator, self.model.discriminator
            if gen.embed_dim != disc.embed_dim:
                raise ConfigError(
                    "model.generator.embedding_size: shared embeddings (electra.decoupled=false) need the "
                    "generator and discriminator to have the same embedding size"
                )
        if self.train.eval_every < 0 or self.train.eval_samples < 1:
            raise ConfigError(f"train.eval_every={self.train.eval_every}, train.eval_samples={self.train.eval_samples}: "
                              f"expected >= 0 and >= 1")
        if self.train.eval_every and self.backend.pipeline_stages > 1:
            raise ConfigError("train.eval_every: validation is not supported with backend.pipeline_stages > 1 yet")
        if self.backend.deepspeed_config and self.backend.name != "deepspeed":
            raise ConfigError(f"backend.deepspeed_config needs backend.name=deepspeed, got {self.backend.name!r}")
        if self.backend.pipeline_stages > 1:
            self._validate_pipeline()
        return self

    def _validate_pipeline(self) -> None:
        """What megakd's DeepSpeed pipeline supports (megakd/engine/pipeline.py says why)."""
        p = f"backend.pipeline_stages={self.backend.pipeline_stages}"
        if self.backend.name != "deepspeed":
            raise ConfigError(f"{p} needs backend.name=deepspeed, got {self.backend.name!r}")
        if self.backend.deepspeed_config:
            raise ConfigError(f"{p}: backend.deepspeed_config is not supported with the pipeline engine yet")
        if self.backend.zero_stage != 0:
            raise ConfigError(f"{p} needs backend.zero_stage=0 (DeepSpeed's pipeline engine allows <= 1, and "
                              f"per-model clipping runs on unpartitioned gradients), got {self.backend.zero_stage}")
        if self.train.precision != "fp32":
            raise ConfigError(f"{p} needs train.precision=fp32 (per-model clipping runs on fp32 gradients), "
                              f"got {self.train.precision!r}")
        if self.model.objective == "electra" and not self.electra.decoupled:
            raise ConfigError(f"{p} needs electra.decoupled=true (one pipeline, two optimizers), got false")
        layers = self.model.generator.num_layers
        where = f"model.generator.num_layers={layers}"
        if self.model.objective == "electra":
            layers += self.model.discriminator.num_layers
            where += f" + model.discriminator.num_layers={self.model.discriminator.num_layers}"
        if self.backend.pipeline_stages > layers:
            raise ConfigError(f"{p} exceeds the {layers} encoder layers to split ({where})")

    def _validate_distill(self) -> None:
        d = self.distill
        if not d.temperature > 0:
            raise ConfigError(f"distill.temperature: expected > 0, got {d.temperature}")
        for key in ("alpha_hard", "alpha_soft_start", "alpha_soft_end"):
            if getattr(d, key) < 0:
                raise ConfigError(f"distill.{key}: expected >= 0, got {getattr(d, key)}")
        if not 0.0 < d.alpha_step_at < 1.0:
            raise ConfigError(f"distill.alpha_step_at: expected a fraction in (0, 1), got {d.alpha_step_at}")
        if d.init == "remap" and not d.teacher:
            raise ConfigError("distill.init=remap: needs distill.teacher (the model to remap from)")

    def _validate_init(self) -> None:
        if self.init.discriminator and self.model.objective == "mlm":
            raise ConfigError(f"init.discriminator={self.init.discriminator}: model.objective=mlm builds no "
                              "discriminator")
        path, key = self.init.source("generator")
        if path and self.distill.init == "remap":
            raise ConfigError(f"{key}={path} and distill.init=remap both initialize the student (model.generator); "
                              "choose one")

    def batch_layout(self, world_size: int) -> tuple[int, int]:
        """(micro_batch_size, gradient accumulation steps) for `world_size` data-parallel ranks."""
        t = self.train
        per_step = t.micro_batch_size * world_size
        if t.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size={t.global_batch_size} is not divisible by "
                f"train.micro_batch_size={t.micro_batch_size} x world_size={world_size}"
            )
        return t.micro_batch_size, t.global_batch_size // per_step


def bundled_vocab_size(cfg: Config) -> int:
    """Size of the bundled-corpus tokenizer: data.vocab_size, or under "auto" the one the models ask for."""
    if cfg.data.vocab_size != "auto":
        return cfg.data.vocab_size
    explicit = {getattr(cfg.model, name).vocab_size for name in cfg.model.built_models()} - {"auto"}
    if len(explicit) > 1:
        raise ConfigError(f"model.generator.vocab_size and model.discriminator.vocab_size differ "
                          f"({sorted(explicit)}): one tokenizer serves both models")
    return explicit.pop() if explicit else BUNDLED_VOCAB_SIZE


def resolve_vocab_sizes(cfg: Config, tokenizer_size: int, tokenizer_name: str, pad_id: int = 0) -> None:
    """Put the tokenizer's size into every `vocab_size: auto`; refuse an explicit size that differs.

    `pad_token_id` (the embedding row that never trains) follows the tokenizer's pad id too: left
    at its default 0 it takes the tokenizer's (e.g. 1 for a RoBERTa-style BPE); another explicit
    value that differs is refused.
    """
    default_pad = EncoderConfig().pad_token_id
    for name in cfg.model.built_models():
        model = getattr(cfg.model, name)
        if model.vocab_size == "auto":
            model.vocab_size = tokenizer_size
        elif model.vocab_size != tokenizer_size:
            raise ConfigError(f"model.{name}.vocab_size={model.vocab_size} but the tokenizer at {tokenizer_name} "
                              f"has {tokenizer_size} pieces (leave it at auto to take the tokenizer's size)")
        if model.pad_token_id != pad_id:
            if model.pad_token_id != default_pad:
                raise ConfigError(f"model.{name}.pad_token_id={model.pad_token_id} but the tokenizer at "
                                  f"{tokenizer_name} pads with id {pad_id}")
            model.pad_token_id = pad_id
    if cfg.model.objective == "mlm" and cfg.model.discriminator.vocab_size == "auto":
        cfg.model.discriminator.vocab_size = tokenizer_size  # unused by MLM; keeps the saved config numeric


def check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: expected one of {', '.join(map(str, choices))}, got {shown(value)}")


def check_literals(obj: Any, prefix: str = "") -> None:
    """Every `Literal[...]`-typed field in a config dataclass tree holds one of its choices.

    The one place choices are checked: `_coerce` applies the same rule while parsing, and this
    covers values set in code before `validate()`.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, tp = getattr(obj, f.name), hints[f.name]
        if typing.get_origin(tp) is Literal:
            check_choice(prefix + f.name, value, typing.get_args(tp))
        elif dataclasses.is_dataclass(value):
            check_literals(value, f"{prefix}{f.name}.")


# ---------------------------------------------------------------------------------------------
# Building dataclasses from nested dicts, strictly.


def _coerce(value: Any, tp: Any, key: str, default: Any = None) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        check_choice(key, value, typing.get_args(tp))
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, default)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{key}: unexpected value {shown(value)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {shown(value)}")
        return _build(tp, value, key, default if isinstance(default, tp) else None)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {shown(value)}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is list:
        (arg,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {shown(value)}")
        return [_coerce(v, arg, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {shown(value)}")
    if tp is int:
        number = None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, float) and value.is_integer():
            number = int(value)
        if number is None:
            raise ConfigError(f"{key}: expected an integer, got {shown(value)}")
        # Every integer key is used as a 64-bit value somewhere (seeds, tensor sizes, counters); a
        # larger one would only fail later as an OverflowError deep inside torch or numpy.
        if not -2**63 <= number < 2**63:
            raise ConfigError(f"{key}: expected a 64-bit integer, got {shown(value)}")
        return number
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an integer beyond the float range: as good as inf
                number = math.inf
        elif isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {shown(value)}")
        # No key means anything with inf or nan (clip_norm uses 0 for "off"): a non-finite loss
        # weight, LR or temperature would only surface as NaN gradients hours into a run.
        if not math.isfinite(number):
            raise ConfigError(f"{key}: expected a finite number, got {shown(value)}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {shown(value)}")
    if tp is Any:
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")


def config_key(field_name: str) -> str:
    """The config key of a dataclass field: a Python keyword is spelled with a trailing _ (`from_` → `from`)."""
    bare = field_name.removesuffix("_")
    return bare if bare != field_name and keyword.iskeyword(bare) else field_name


def _build(cls: type, data: dict, prefix: str = "", base: Any = None) -> Any:
    """Instantiate `cls` from `data`, starting from `base` (or the class defaults) field by field.

    Starting from the parent's default object keeps section-specific defaults (e.g. the
    generator's own peak LR) when an override touches only one key of that section.
    """
    hints = typing.get_type_hints(cls)
    fields = {config_key(f.name): f.name for f in dataclasses.fields(cls)}
    obj = copy.deepcopy(base) if base is not None else cls()
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            close = difflib.get_close_matches(str(name), list(fields), n=1)
            hint = f"; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{key}'{hint}")
        attr = fields[name]
        setattr(obj, attr, _coerce(value, hints[attr], key, getattr(obj, attr)))
    return obj


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_recipe(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """Read a YAML recipe, resolving `inherit: other.yaml` (relative to the file) recursively."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: circular 'inherit'")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    data = read_yaml_file(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    parents = data.pop("inherit", None) or []
    if isinstance(parents, str):
        parents = [parents]
    merged: dict = {}
    for parent in parents:
        merged = _merge(merged, read_recipe(path.parent / parent, (*seen, path)))
    return _merge(merged, data)


# Values a config may hold once YAML aliases are expanded. A recipe has a few hundred; anchors and
# aliases stay allowed (configs/electra-base.yaml shares one model section as `*base`), but a
# "billion laughs" document of a few hundred bytes would expand to billions.
MAX_YAML_VALUES = 100_000


class _Refused(Exception):
    """A YAML document megakd will not construct: (line, reason), named by the caller."""


class _ConfigLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` with a bound on alias expansion and on integer length, checked before any
    value is built (the composed node graph shares aliased nodes, so checking it is cheap)."""

    def compose_document(self):
        node = super().compose_document()
        _count_values(node, {}, set())
        return node

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # Python refuses int() of more than 4300 digits
            reason = f"an integer of {len(node.value)} characters is too long (expected a config value)"
            raise _Refused(node.start_mark.line + 1, reason) from None


_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _ConfigLoader.construct_yaml_int)


def _count_values(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """How many values `node` expands to, each shared (aliased) node counted at every use."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_nodes:
        raise _Refused(node.start_mark.line + 1, "a YAML alias refers to a node that contains it")
    open_nodes.add(id(node))
    children = node.value if isinstance(node, yaml.SequenceNode) else (
        [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else [])
    total = 1 + sum(_count_values(child, sizes, open_nodes) for child in children)
    if total > MAX_YAML_VALUES:
        raise _Refused(node.start_mark.line + 1, f"YAML aliases expand this node to more than "
                       f"{MAX_YAML_VALUES} values (expected a config; share settings with inherit:)")
    open_nodes.discard(id(node))
    sizes[id(node)] = total
    return total


def load_yaml(text: str) -> Any:
    """Parse YAML as `yaml.safe_load` does, within `_ConfigLoader`'s bounds (raises `_Refused`)."""
    return yaml.load(text, Loader=_ConfigLoader)


def read_yaml_file(path: Path) -> Any:
    """Parse a YAML file with `load_yaml`, with anything unreadable as a one-line `ConfigError` naming it."""
    try:
        return load_yaml(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a YAML text file (not UTF-8)") from None
    except _Refused as err:
        line, reason = err.args
        raise ConfigError(f"{path}, line {line}: {reason}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None


def parse_override(text: str) -> dict:
    """`a.b.c=value` → {'a': {'b': {'c': value}}}, the value parsed as YAML (so 1e-4, true, [1, 2] work)."""
    if "=" not in text:
        raise ConfigError(f"override {shown(text)}: expected key=value")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {shown(text)}: empty key")
    try:
        value = load_yaml(raw) if raw != "" else ""
    except _Refused as err:
        raise ConfigError(f"override {key}: {err.args[1]}") from None
    except yaml.YAMLError:
        value = raw
    out: dict = {}
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def config_to_dict(cfg: Any) -> dict:
    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {config_key(f.name): plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(cfg)


def load_config(
    path: str | Path | None = None, overrides: list[str] = (), cls: type = Config
) -> Any:
    """Load a recipe (or the defaults), apply overrides, build and validate the dataclass tree."""
    data = read_recipe(Path(path)) if path else {}
    if path:  # the file alone first, so an error names where the bad value came from
        try:
            _build(cls, data)
        except ConfigError as err:
            raise ConfigError(f"{err} (in {path})") from None
    for text in overrides:
        data = _merge(data, parse_override(text))
    try:
        cfg = _build(cls, data)
    except ConfigError as err:
        raise ConfigError(f"{err} (on the command line)" if overrides else str(err)) from None
    return cfg.validate()


# ---------------------------------------------------------------------------------------------
# What each key means, read from the comments above and beside the fields (`megakd config keys`,
# docs/configuration.md), so the reference cannot drift from the code.


@dataclass(frozen=True)
class KeyDoc:
    """A leaf key of a config tree: its type, its default in that tree, the comment that documents it."""

    key: str
    type: str
    default: Any
    meaning: str


def config_keys(cls: type) -> list[KeyDoc]:
    """Every leaf key of the dataclass tree `cls`, in source order; defaults are those of `cls()`."""
    return [item for item in _walk(cls, cls(), "") if isinstance(item, KeyDoc)]


def config_sections(cls: type) -> dict[str, str]:
    """{section key: what it is} for every dataclass in the tree below `cls`, parents first.

    The text is the comment on the field that holds the section followed by its class docstring."""
    return dict(item for item in _walk(cls, cls(), "") if isinstance(item, tuple))


def _walk(cls: type, obj: Any, prefix: str):
    """(section key, text) for each section and a KeyDoc for each leaf below `obj`, in source order."""
    hints, meanings = typing.get_type_hints(cls), field_meanings(cls)
    for f in dataclasses.fields(cls):
        key, tp, value = prefix + config_key(f.name), hints[f.name], getattr(obj, f.name)
        if dataclasses.is_dataclass(tp):
            yield key, " ".join(filter(None, (meanings[f.name], _class_docstring(tp))))
            yield from _walk(tp, value, key + ".")
        else:
            yield KeyDoc(key, type_text(tp), value, meanings[f.name])


def field_meanings(cls: type) -> dict[str, str]:
    """{field: its comment} for dataclass `cls`: the comment lines right above the field, then the comment
    at the end of its line(s), as one line ("" where there is none)."""
    node, comments = _class_source(cls)
    out = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above, line = [], stmt.lineno - 1
        while comments.get(line, (False, ""))[0]:
            above.insert(0, comments[line][1])
            line -= 1
        after = [comments[n][1] for n in range(stmt.lineno, stmt.end_lineno + 1)
                 if n in comments and not comments[n][0]]
        out[stmt.target.id] = " ".join(" ".join([*above, *after]).split())
    return out


def _class_docstring(cls: type) -> str:
    """The class's own docstring, one line (without one, a dataclass's `__doc__` is its signature)."""
    return " ".join((ast.get_docstring(_class_source(cls)[0]) or "").split())


def _class_source(cls: type) -> tuple[ast.ClassDef, dict[int, tuple[bool, str]]]:
    tree, comments = _parsed_module(inspect.getsourcefile(cls))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    return node, comments


@functools.cache
def _parsed_module(path: str) -> tuple[ast.Module, dict[int, tuple[bool, str]]]:
    """The module's syntax tree and {line: (whole line is a comment, comment text)}."""
    source = Path(path).read_text(encoding="utf-8")
    lines = source.splitlines()
    comments = {}
    for tok in tokenize.generate_tokens(iter(source.splitlines(keepends=True)).__next__):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            comments[row] = (not lines[row - 1][:col].strip(), tok.string.lstrip("#").strip())
    return ast.parse(source), comments


def type_text(tp: Any) -> str:
    """A field's type as a recipe writes it: `electra|mlm` for a Literal, `[float, float]` for a pair."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "|".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is tuple:
        return f"[{', '.join(type_text(a) for a in args)}]"
    if origin is list:
        return f"list[{type_text(args[0])}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def value_text(value: Any) -> str:
    """A value as YAML flow style writes it (`null`, `true`, `[0.9, 0.98]`, `""`), on one line."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(value_text(v) for v in value)}]"
    if value == "":
        return '""'
    return str(value)


def save_config(cfg: Any, path: str | Path) -> None:
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    tmp.replace(path)
