"""The pretraining config tree: its dataclasses, their defaults and their validation.

`load_config` builds it from a YAML recipe and `a.b=c` overrides through the strict, generic loader
of `megakd.configio` (which `megakd.finetune.config` uses too). A loaded config still holds `auto`
values that depend on the tokenizer and the launch (model vocabulary sizes, pad ids, backend.name):
`megakd.finish.finish_config` fills them in, once, before a command reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from megakd.configio import ConfigError, check_choice, check_literals, load_tree, shown
from megakd.kernels import BACKENDS, HEAD_BACKWARDS
from megakd.models.encoder import EncoderConfig
from megakd.objectives.distill import ALPHA_SCHEDULES
from megakd.objectives.electra import SamplingTemperature

JOINT_CLIPS = ("weighted", "unweighted")


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
    check_below_limit(key, value)


def check_below_limit(key: str, value: int) -> None:
    """`value` below 2**31, for counts where 0 (or a negative) means something or is checked apart."""
    if value >= COUNT_LIMIT:
        raise ConfigError(f"{key}: expected an integer below 2**31, got {value}")


def check_at_least(key: str, value: int, least: int, meaning: str = "") -> None:
    if value < least:
        raise ConfigError(f"{key}: expected an integer >= {least}{meaning}, got {value}")


@dataclass
class RunConfig:
    """The `run` section every command shares: where it writes, how it reports, how often it checkpoints."""

    dir: str = "runs/electra-tiny"  # the run directory: config, metrics, checkpoints, plots, HF export
    # checkpoints kept (older ones are deleted); 0 = keep every one. Fine-tuning keeps them per seed (or
    # LR trial) while it trains, and removes them once it has finished.
    keep_last: int = 3
    save_every: int = 0  # also checkpoint every N optimizer steps; 0 = only at the end (fine-tuning: of every epoch)
    tensorboard: bool = True  # write TensorBoard events to run.dir/tb (fine-tuning: <seed dir>/tb)
    # log to Weights & Biases too (one wandb run per run directory, per seed directory in fine-tuning;
    # resumed on requeue)
    wandb: bool = False
    wandb_project: str = "megakd"  # the wandb project
    wandb_mode: Literal["offline", "online"] = "offline"  # offline keeps the run on disk; WANDB_MODE wins
    # rank 0's progress: a tqdm bar on a terminal; otherwise (stderr to a file, e.g. Slurm's --output) a
    # plain log line every train.log_every (finetune.log_every) steps and at the last: step, rate, ETA,
    # the bar's figures
    progress_bar: bool = True
    overwrite: bool = False  # a new run into a used run.dir moves its contents to <run.dir>.old-<time>/

    def validate(self) -> None:
        for key, meaning in (("keep_last", " (0 = keep every checkpoint)"), ("save_every", " (0 = only at the end)")):
            check_below_limit(f"run.{key}", getattr(self, key))
            check_at_least(f"run.{key}", getattr(self, key), 0, meaning)


@dataclass
class PretrainRunConfig(RunConfig):
    """The shared run section, and what pretraining writes at the end of a run."""

    plots: bool = True  # draw loss and RTD plots into run.dir/plots at the end of training
    export_hf: bool = True  # write run.dir/hf (HuggingFace format) at the end of training


@dataclass
class DataConfig:
    tokenizer: str = ""  # `megakd data tokenizer` dir or an HF tokenizer dir; empty = built from the bundled corpus
    shards: str = ""  # directory from `megakd data shards`; empty = built from the bundled corpus
    # bundled corpus when tokenizer/shards are unset: classic (Austen + KJV) | mixed (+ modern text + RT train)
    corpus: Literal["classic", "mixed"] = "classic"
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
    # backoff from 0.25 s doubling to 30 s (8: about a minute of waits); then the run saves and stops.
    read_retries: int = 8
    # Seconds an object-store request may take to connect before the try fails (and is retried).
    read_connect_timeout_s: float = 10.0
    # Seconds an object-store request may wait for its next byte (headers or body) before the try fails.
    # A store that stops answering: (read_retries + 1) x (both timeouts) + the backoffs to the error,
    # 422 s (about 7 minutes) for the defaults (docs/data.md).
    read_timeout_s: float = 30.0
    # Held-out shards for train.eval_every; "auto" = <data.shards>/valid when it exists
    # (`megakd data shards --valid-fraction`), "" = none.
    valid_shards: str = "auto"

    def validate(self) -> None:
        if self.vocab_size != "auto" and (isinstance(self.vocab_size, str) or self.vocab_size < 1):
            raise ConfigError(f"data.vocab_size: expected a positive integer or auto, got {shown(self.vocab_size)}")
        check_count("data.shuffle_shards", self.shuffle_shards)
        check_count("data.read_block", self.read_block)
        if not 0.0 <= self.read_overfetch <= 1e6:
            raise ConfigError(f"data.read_overfetch: expected a fraction >= 0 (extra bytes per byte needed), "
                              f"got {shown(self.read_overfetch)}")
        check_below_limit("data.num_workers", self.num_workers)
        check_below_limit("data.read_retries", self.read_retries)
        check_at_least("data.read_retries", self.read_retries, 0)
        for key, value in (("data.read_connect_timeout_s", self.read_connect_timeout_s),
                           ("data.read_timeout_s", self.read_timeout_s)):
            if not 0 < value <= 3600:
                raise ConfigError(f"{key}: expected seconds in (0, 3600], got {shown(value)}")
        if not 0.0 < self.mask_prob < 1.0:
            raise ConfigError(f"data.mask_prob: expected a value in (0, 1), got {self.mask_prob}")


BUNDLED_VOCAB_SIZE = 8000


def _auto_vocab_encoder() -> EncoderConfig:
    return EncoderConfig(vocab_size="auto")


@dataclass
class ModelConfig:
    # electra (generator + discriminator); mlm (BERT-MLM: the generator alone)
    objective: Literal["electra", "mlm"] = "electra"
    # The generator (ELECTRA), the masked LM (BERT-MLM) or the DWT student. vocab_size "auto" (the
    # default) = the tokenizer's size, filled in by `megakd.finish.finish_config`.
    generator: EncoderConfig = field(default_factory=_auto_vocab_encoder)
    discriminator: EncoderConfig = field(default_factory=_auto_vocab_encoder)  # the ELECTRA discriminator

    def built_models(self) -> tuple[str, ...]:
        return ("generator",) if self.objective == "mlm" else ("generator", "discriminator")

    def validate(self) -> None:
        for name in ("generator", "discriminator"):
            try:
                getattr(self, name).validate(allow_auto_vocab=True)
            except ValueError as err:
                # EncoderConfig names its fields "model.<field>"; qualify them with the model.
                raise ConfigError(str(err).replace("model.", f"model.{name}.", 1)) from None


@dataclass
class ElectraConfig:
    decoupled: bool = True  # DecoupledOptim: separate embeddings, two optimizers
    loss_weight: float = 50.0  # λ in L_MLM + λ·L_RTD
    sampling_temperature: float = 1.0  # temperature of the generator's samples that replace masked tokens
    # Anneal linearly from sampling_temperature to this over the first sampling_anneal_steps
    # optimizer steps (0 = train.max_steps), then hold it; null = constant.
    sampling_temperature_end: float | None = None
    sampling_anneal_steps: int = 0  # length of the anneal to sampling_temperature_end (0 = train.max_steps)
    # Where the discriminator's RTD loss is taken: all = every non-padding token (ELECTRA); masked = the
    # masked positions only ("ELECTRA 15 %", the ablation of docs/methods.md § ELECTRA objectives); the
    # discriminator still reads the whole sequence, and its logged RTD F1 still counts every token
    rtd_positions: Literal["all", "masked"] = "all"

    def temperature_schedule(self, max_steps: int) -> SamplingTemperature:
        return SamplingTemperature(self.sampling_temperature, self.sampling_temperature_end,
                                   self.sampling_anneal_steps or max_steps)

    def validate(self) -> None:
        check_below_limit("electra.sampling_anneal_steps", self.sampling_anneal_steps)
        if self.loss_weight <= 0:
            raise ConfigError(f"electra.loss_weight: expected > 0, got {self.loss_weight}")
        for key in ("sampling_temperature", "sampling_temperature_end"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ConfigError(f"electra.{key}: expected > 0, got {value}")
        if self.sampling_anneal_steps < 0:
            raise ConfigError(f"electra.sampling_anneal_steps: expected >= 0 (0 = train.max_steps), "
                              f"got {self.sampling_anneal_steps}")


@dataclass
class OptimizerSettings:
    """The optimizer settings pretraining's `optim.<model>` and fine-tuning's `finetune` sections share."""

    betas: tuple[float, float] = (0.9, 0.98)  # the optimizer's β1, β2
    eps: float = 1e-6  # the optimizer's ε
    weight_decay: float = 0.01  # decoupled (AdamW) weight decay
    clip_norm: float = 2.0  # gradient-norm clipping bound of this model's parameters; 0 = no clipping

    def validate_optimizer(self, key: str) -> None:
        if self.clip_norm < 0 or self.eps <= 0:
            raise ConfigError(f"{key}.clip_norm must be >= 0 and {key}.eps > 0")


@dataclass
class OptimizerConfig(OptimizerSettings):
    lr: float = 5e-4  # peak learning rate (Adam), reached after optim.schedule.warmup_steps


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

    def validate(self) -> None:
        check_below_limit("optim.schedule.warmup_steps", self.schedule.warmup_steps)
        for name in ("generator", "discriminator"):
            opt: OptimizerConfig = getattr(self, name)
            if opt.lr < 0:
                raise ConfigError(f"optim.{name}.lr: expected >= 0, got {opt.lr}")
            opt.validate_optimizer(f"optim.{name}")


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
    # bf16 / fp16: mixed precision (autocast; fp16 with loss scaling)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    tf32: bool = True  # fp32 matmuls and convolutions on a CUDA device run in TF32; false = IEEE fp32
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

    def validate(self) -> None:
        for key in ("max_steps", "global_batch_size", "micro_batch_size", "log_every", "max_bad_steps"):
            check_count(f"train.{key}", getattr(self, key))
        for key in ("eval_every", "eval_samples", "probe_every"):
            check_below_limit(f"train.{key}", getattr(self, key))
        check_seed("train.seed", self.seed)
        if self.probe_every < 0:
            raise ConfigError(f"train.probe_every: expected >= 0 (0 = off), got {self.probe_every}")
        if self.probe_every:
            self.probe_task.validate("train.probe_task")
            if self.probe_task.num_labels < 2:
                raise ConfigError("train.probe_task.num_labels: the probe needs a classification task (>= 2)")
            for key in ("probe_fit_examples", "probe_eval_examples", "probe_max_seq_len"):
                if getattr(self, key) < (3 if key == "probe_max_seq_len" else 1):
                    raise ConfigError(f"train.{key}: expected a positive integer, got {getattr(self, key)}")
                check_count(f"train.{key}", getattr(self, key))
        if self.eval_every < 0 or self.eval_samples < 1:
            raise ConfigError(f"train.eval_every={self.eval_every}, train.eval_samples={self.eval_samples}: "
                              f"expected >= 0 and >= 1")


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
    # DeepSpeed's gradient all-reduce / reduce-scatter dtype (backend.name=deepspeed). auto: fp32 under
    # bf16/fp16 with backend.zero_stage >= 1 (the fp32 sums grad accumulation promises), else the model's
    # dtype. bf16|fp16 (= train.precision) halves the bytes on the wire but rounds to 8 (bf16) or 11 (fp16)
    # significant bits at every add: up to world size - 1 roundings per element (docs/distributed.md)
    grad_comm_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"

    def validate(self) -> None:
        """The pretraining checks; `megakd finetune` runs on fewer backends and checks them itself."""
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"backend.zero_stage: expected 0, 1, 2 or 3, got {self.zero_stage}")
        check_count("backend.pipeline_stages", self.pipeline_stages)
        if self.deepspeed_config and self.name != "deepspeed":
            raise ConfigError(f"backend.deepspeed_config needs backend.name=deepspeed, got {self.name!r}")
        if self.grad_comm_dtype != "auto" and self.name != "deepspeed":
            raise ConfigError(f"backend.grad_comm_dtype={self.grad_comm_dtype} needs backend.name=deepspeed, "
                              f"got {self.name!r}")


@dataclass
class KernelsConfig:
    # The fused loss kernels: auto (Triton on CUDA if installed, else torch) | triton | torch
    backend: Literal[BACKENDS] = "auto"
    # The Triton head's backward (kernels.dispatch.HEAD_BACKWARDS): chunked (no atomics, bitwise
    # reproducible) | atomic (fp32 atomics) | auto (the roofline's default: chunked). The torch path is chunked.
    head_backward: Literal[HEAD_BACKWARDS] = "auto"


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

    def validate(self) -> None:
        if not self.temperature > 0:
            raise ConfigError(f"distill.temperature: expected > 0, got {self.temperature}")
        for key in ("alpha_hard", "alpha_soft_start", "alpha_soft_end"):
            if getattr(self, key) < 0:
                raise ConfigError(f"distill.{key}: expected >= 0, got {getattr(self, key)}")
        if not 0.0 < self.alpha_step_at < 1.0:
            raise ConfigError(f"distill.alpha_step_at: expected a fraction in (0, 1), got {self.alpha_step_at}")
        if self.init == "remap" and not self.teacher:
            raise ConfigError("distill.init=remap: needs distill.teacher (the model to remap from)")


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
    RENAMES: ClassVar[dict[str, str]] = {"train.save_every": "run.save_every"}  # old key: new key (configio)

    run: PretrainRunConfig = field(default_factory=PretrainRunConfig)
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
        """Each section's own checks, then those across sections.

        A config with errors in several sections reports the first section's (in this order)."""
        check_literals(self)
        self.distill.validate()
        self._validate_init()
        for section in (self.data, self.backend, self.train, self.optim, self.electra, self.run, self.model):
            section.validate()
        if self.model.objective == "electra" and not self.electra.decoupled:
            gen, disc = self.model.generator, self.model.discriminator
            if gen.embed_dim != disc.embed_dim:
                raise ConfigError(
                    "model.generator.embedding_size: shared embeddings (electra.decoupled=false) need the "
                    "generator and discriminator to have the same embedding size"
                )
        if self.train.eval_every and self.backend.pipeline_stages > 1:
            raise ConfigError("train.eval_every: validation is not supported with backend.pipeline_stages > 1 yet")
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
            raise ConfigError(f"{p} needs train.precision=fp32 (per-model clipping runs on fp32 gradients; its "
                              f"matmuls run in TF32 on CUDA unless train.tf32=false), got {self.train.precision!r}")
        if self.model.objective == "electra" and not self.electra.decoupled:
            raise ConfigError(f"{p} needs electra.decoupled=true (one pipeline, two optimizers), got false")
        layers = self.model.generator.num_layers
        where = f"model.generator.num_layers={layers}"
        if self.model.objective == "electra":
            layers += self.model.discriminator.num_layers
            where += f" + model.discriminator.num_layers={self.model.discriminator.num_layers}"
        if self.backend.pipeline_stages > layers:
            raise ConfigError(f"{p} exceeds the {layers} encoder layers to split ({where})")

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


def load_config(path: str | Path | None = None, overrides: list[str] = (), cls: type = Config) -> Any:
    """Load a recipe (or the defaults) into `cls` (the pretraining tree unless told), apply overrides,
    build and validate it (`megakd.configio.load_tree`)."""
    return load_tree(cls, path, overrides)
