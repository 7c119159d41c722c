"""Assemble a pretraining run from a config: data, models, training layout, backend, trainer."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from megakd.config import Config, ConfigError
from megakd.data.shards import MANIFEST, read_manifest
from megakd.data.storage import ShardStore
from megakd.data.stream import PretrainingLoader
from megakd.data.tokenizer import Tokenizer
from megakd.engine import backend_factory
from megakd.engine.backends import TrainingBackend
from megakd.engine.layouts import Layout, build_layout
from megakd.engine.losses import TeacherKD
from megakd.engine.trainer import Trainer, TrainResult
from megakd.engine.validation import VALID_SEED, Validator
from megakd.engine.warm_start import warm_start
from megakd.finish import bundled_vocab_size, finish_config
from megakd.models.admin import admin_initialize
from megakd.models.electra import Discriminator, MaskedLM
from megakd.models.remap import remap_masked_lm
from megakd.store import check_same_tokenizer, checkpoint, freeze, load_model
from megakd.store.files import about

log = logging.getLogger(__name__)

# The CPU's pace in Admin's profiling pass, per torch thread: fp32 matmuls ran at 28 GFLOP/s on one thread of the
# 2-core machine (docs/distributed.md, `megakd bench`); the pass's other work (norms, softmax, dropout) is slower.
PROFILE_FLOPS_PER_THREAD = 20e9


def build_backend(cfg: Config) -> TrainingBackend:
    """The run's backend (`megakd.engine.backend_factory`); a DeepSpeed engine takes `train.micro_batch_size`."""
    return backend_factory.build_backend(cfg.backend, cfg.train.precision, cfg.train.micro_batch_size)


def cache_root(cfg: Config) -> Path:
    """data.cache_dir, else $MEGAKD_CACHE, else ~/.cache/megakd: the bundled corpus and shard indexes."""
    return Path(cfg.data.cache_dir or os.environ.get("MEGAKD_CACHE", "~/.cache/megakd")).expanduser()


def resolve_data(cfg: Config) -> tuple[Path, ShardStore]:
    """(tokenizer dir, shards): the configured ones (a local directory or an object-store URL), or
    the bundled corpus built once in a cache."""
    d = cfg.data
    if bool(d.tokenizer) != bool(d.shards):
        raise ConfigError("data.tokenizer and data.shards: set both (your own data) or neither (bundled corpus)")
    if d.tokenizer:
        return Path(d.tokenizer), shard_store(cfg, d.shards)
    from megakd.data.default_corpus import prepare_default_data

    tokenizer_dir, shards_dir = prepare_default_data(cache_root(cfg), vocab_size=bundled_vocab_size(cfg),
                                                     seq_len=d.seq_len, corpus=d.corpus)
    return tokenizer_dir, shard_store(cfg, shards_dir)


def shard_store(cfg: Config, spec: str | Path) -> ShardStore:
    """The shards at ``spec`` with data.*'s retry and timeout policy."""
    d = cfg.data
    return ShardStore(spec, retries=d.read_retries, connect_timeout_s=d.read_connect_timeout_s,
                      read_timeout_s=d.read_timeout_s)


def build_models(cfg: Config) -> tuple[MaskedLM, Discriminator | None]:
    """Both models, initialised identically on every rank from train.seed."""
    torch.manual_seed(cfg.train.seed)
    generator = MaskedLM(cfg.model.generator)
    discriminator = Discriminator(cfg.model.discriminator) if cfg.model.objective == "electra" else None
    return generator, discriminator


def admin_profile(cfg: Config, models: list[MaskedLM | Discriminator | None], shards_dir: ShardStore,
                  tokenizer: Tokenizer) -> None:
    """Admin's one-batch profiling pass for models with `init: admin`.

    Every rank profiles the same batch (the first one a one-rank loader yields), so ω, like the
    weights, is identical everywhere. The generator sees masked input, the discriminator clean.
    The pass runs on the CPU, before the backend places the models: at electra-base's size minutes on
    a few cores, so it is announced with its matmul work (2 FLOPs per layer weight and token).
    """
    admin = [m for m in models if m is not None and m.config.init == "admin"]
    if not admin:
        return
    micro_batch = cfg.train.micro_batch_size
    loader = PretrainingLoader(shards_dir, tokenizer, micro_batch_size=micro_batch, seed=cfg.train.seed,
                               mask_prob=cfg.data.mask_prob, shuffle_shards=cfg.data.shuffle_shards)
    flops = sum(2 * sum(p.numel() for p in m.encoder.layers.parameters()) for m in admin) * micro_batch * loader.seq_len
    threads = torch.get_num_threads()
    shapes = " and ".join(f"{m.config.num_layers} x {m.config.hidden_size}" for m in admin)
    log.info("Admin init: profiling the %s encoder(s) in one forward pass over %d x %d tokens on the CPU "
             "(~%.3g TFLOP): %s on %d threads", shapes, micro_batch, loader.seq_len, flops / 1e12,
             about(flops / (PROFILE_FLOPS_PER_THREAD * threads)), threads)
    batch = next(iter(loader))
    for model in admin:
        ids = batch["masked_input_ids"] if isinstance(model, MaskedLM) else batch["input_ids"]
        admin_initialize(model.encoder, ids, batch["attention_mask"], seed=cfg.train.seed)


def compile_encoders(models: list[MaskedLM | Discriminator | None]) -> None:
    """`torch.compile` every encoder layer in place (`nn.Module.compile`).

    In place, the parameter names do not change, so checkpoints, resume and the HF export are the
    same with and without compilation. The layers hold nearly all of the FLOPs and share one
    compiled graph. The embeddings stay eager: with the whole encoder compiled, a resumed run's word
    embeddings differed in the last bits from the uninterrupted run's (inductor's CPU embedding
    backward scatters with atomic adds, whose order is not fixed); with the layers alone resume is
    bit-exact (tests/engine/test_compile.py). The heads and fused losses stay eager too: they are
    chunked custom-autograd kernels that already avoid the [tokens x vocab] logits.

    Compiling happens in the first step, which it makes a wait of its own: announced here (measured: a
    2-step electra-tiny run with a cold cache took 37 s more CPU than the eager one, 2 min more on a loaded
    2-core machine).
    """
    layers = [layer for model in models if model is not None for layer in model.encoder.layers]
    log.info("train.compile: the first step compiles the %d encoder layers (torch.compile): about a minute on 2 "
             "CPU cores with a cold inductor cache (TORCHINDUCTOR_CACHE_DIR, default /tmp/torchinductor_$USER)",
             len(layers))
    for layer in layers:
        layer.compile()


def build_loader(cfg: Config, tokenizer: Tokenizer, shards_dir: ShardStore, micro_batch_size: int, rank: int,
                 world_size: int) -> PretrainingLoader:
    """The pretraining data stream as `cfg.data` describes it (training and `megakd bench` alike)."""
    return PretrainingLoader.from_config(cfg.data, shards_dir, tokenizer, micro_batch_size=micro_batch_size,
                                         seed=cfg.train.seed, rank=rank, world_size=world_size,
                                         index_cache=cache_root(cfg) / "shard-index",
                                         pin_memory=torch.cuda.is_available())


def build_trainer(cfg: Config, backend: TrainingBackend | None = None, resume: str | None = None) -> Trainer:
    """The trainer for `cfg`; `resume` (as given to `Trainer.open_run`) only decides whether `init.*` is read.

    The config is finished first, before anything is built: the data's tokenizer (the bundled corpus is
    built if needed) fills `vocab_size: auto` and the pad id, the launch fills `backend.name: auto`.
    """
    tokenizer_dir, shards_dir = resolve_data(cfg)
    tokenizer = Tokenizer.load(tokenizer_dir)
    finish_config(cfg, tokenizer)
    backend = backend or build_backend(cfg)
    try:
        return _build_trainer(cfg, backend, tokenizer, tokenizer_dir, shards_dir, resume)
    except BaseException:
        backend.close()  # a config error found while building must not leave a process group behind
        raise


def resumes_from_checkpoint(cfg: Config, resume: str | None) -> bool:
    """Whether `open_run(resume)` will load a checkpoint (then the models' init is overwritten anyway)."""
    if resume is None:
        return False
    return resume != "auto" or bool(checkpoint.list_checkpoints(Path(cfg.run.dir)))


def _build_trainer(cfg: Config, backend: TrainingBackend, tokenizer: Tokenizer, tokenizer_dir: Path,
                   shards_dir: ShardStore, resume: str | None) -> Trainer:
    micro_batch, accumulation = cfg.batch_layout(backend.data_world_size)
    manifest = read_manifest(shards_dir)
    if manifest.get("packed") and cfg.backend.pipeline_stages > 1:
        raise ConfigError(f"data.shards={shards_dir}: packed shards are not supported with "
                          f"backend.pipeline_stages={cfg.backend.pipeline_stages} (the pipeline stages "
                          f"carry no segment ids); write the shards without --pack")
    if cfg.run.dir and backend.is_main:
        log.info("data: %s (%d samples, seq_len %d), tokenizer %s", shards_dir, manifest["num_samples"],
                 manifest["seq_len"], tokenizer_dir)
    generator, discriminator = build_models(cfg)
    admin_profile(cfg, [generator, discriminator], shards_dir, tokenizer)
    if not resumes_from_checkpoint(cfg, resume):
        warm_start(cfg, tokenizer, generator, discriminator)
    if cfg.train.compile:
        compile_encoders([generator, discriminator])
    kd = attach_teacher(cfg, tokenizer, generator, backend.device) if cfg.distill.teacher else None
    layout = build_layout(cfg, generator, discriminator, kd)
    backend.prepare(layout, accumulation)
    loader = build_loader(cfg, tokenizer, shards_dir, micro_batch, backend.data_rank, backend.data_world_size)
    validator = build_validator(cfg, tokenizer, shards_dir, micro_batch, backend, layout)
    return Trainer(cfg, backend, layout, loader, tokenizer_dir=tokenizer_dir, validator=validator)


def valid_shards_dir(cfg: Config, shards: ShardStore) -> ShardStore | None:
    """data.valid_shards, or under "auto" the `valid/` set written beside the training shards."""
    if cfg.data.valid_shards == "auto":
        beside = shards.child("valid")
        return beside if beside.size(MANIFEST) is not None else None
    return shard_store(cfg, cfg.data.valid_shards) if cfg.data.valid_shards else None


def build_validator(cfg: Config, tokenizer: Tokenizer, shards_dir: ShardStore, micro_batch: int,
                    backend: TrainingBackend, layout: Layout) -> Validator | None:
    if not cfg.train.eval_every:
        return None
    valid_dir = valid_shards_dir(cfg, shards_dir)
    if valid_dir is None:
        raise ConfigError(f"train.eval_every={cfg.train.eval_every} needs validation shards: set data.valid_shards=DIR "
                          f"or write them with `megakd data shards --valid-fraction F` "
                          f"(none at {shards_dir.url('valid')})")
    loader = PretrainingLoader(valid_dir, tokenizer, micro_batch_size=micro_batch, seed=VALID_SEED,
                               mask_prob=cfg.data.mask_prob)
    return Validator(loader, cfg.train.eval_samples, backend, layout)


def attach_teacher(cfg: Config, tokenizer: Tokenizer, student: MaskedLM, device: torch.device) -> TeacherKD:
    """DWT: load `distill.teacher` frozen on `device`, check it shares `tokenizer`, optionally remap
    `student` from it."""
    d = cfg.distill
    stored = load_model(d.teacher, "distill.teacher")
    model: MaskedLM = freeze(stored.get("masked_lm")).to(device)
    check_same_tokenizer(tokenizer, stored.tokenizer_dir, f"distill.teacher={d.teacher}", model.config.vocab_size)
    if d.init == "remap":
        try:
            remap_masked_lm(model, student, d.remap_width)
        except ValueError as err:
            raise ConfigError(f"distill.init=remap with distill.teacher={d.teacher}: {err}") from None
    t, s = model.config, student.config
    log.info("DWT teacher %s: %d layers x %d hidden (%.1fM params) -> student %d x %d (%.1fM), init %s",
             d.teacher, t.num_layers, t.hidden_size, _millions(model), s.num_layers, s.hidden_size,
             _millions(student), d.init)
    return TeacherKD(model, d.temperature, d.alpha_hard, d.alpha_soft_start, d.alpha_soft_end, d.alpha_schedule,
                     cfg.train.max_steps, d.alpha_step_at)


def _millions(model: torch.nn.Module) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e6


def run_pretraining(cfg: Config, resume: str | None = None, allow_change: tuple[str, ...] = (),
                    export: Callable[[Path, Path], object] | None = None) -> TrainResult:
    """Train (or continue) the run `cfg` describes; a run that finished ends with `export(run_dir, out)`
    (the command's HuggingFace export, `megakd.convert.export_run`) into run.dir/hf, under the run's lock."""
    trainer = build_trainer(cfg, resume=resume)
    try:
        trainer.open_run(resume, allow_change)
        return trainer.train(export=export)
    finally:
        trainer.close()


def run_distill(cfg: Config, resume: str | None = None, allow_change: tuple[str, ...] = (),
                export: Callable[[Path, Path], object] | None = None) -> TrainResult:
    """`megakd distill` (DWT, docs/methods.md § DWT): pretraining with `distill.teacher` required.

    The student is `model.generator`: a BERT-MLM (`model.objective=mlm`, DWT as published) or an
    ELECTRA generator, whose MLM head gets the KD term (the discriminator trains on the distilled
    generator's samples as usual). The teacher is loaded, frozen, checked against the data's
    tokenizer and optionally remapped into the student by `attach_teacher`.
    """
    if not cfg.distill.teacher:
        raise ConfigError("distill.teacher: expected a teacher (run, checkpoint, model dir or HF MLM dir); "
                          "without one use `megakd pretrain`")
    return run_pretraining(cfg, resume=resume, allow_change=allow_change, export=export)
