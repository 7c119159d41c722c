"""Assemble a pretraining run from a config: data, models, units, backend, trainer."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from megakd.config import Config, ConfigError
from megakd.data.shards import read_manifest
from megakd.data.stream import PretrainingLoader
from megakd.data.tokenizer import Tokenizer
from megakd.engine.backends import Backend, DDPBackend, Unit
from megakd.engine.optim import build_optimizer, build_scheduler
from megakd.engine.tasks import DiscriminatorTask, GeneratorTask, JointElectraTask, TeacherKD
from megakd.engine.trainer import Trainer, TrainResult
from megakd.models.admin import admin_initialize
from megakd.models.electra import Discriminator, ElectraPair, MaskedLM

log = logging.getLogger(__name__)


def build_backend(cfg: Config) -> Backend:
    name = cfg.backend.name
    if name == "single":
        return Backend(cfg.train.precision)
    if name == "ddp":
        return DDPBackend(cfg.train.precision, cfg.backend.dist_backend)
    if cfg.backend.pipeline_stages > 1:
        from megakd.engine.pipeline import PipelineBackend

        return PipelineBackend(cfg)
    from megakd.engine.deepspeed_backend import DeepSpeedBackend

    return DeepSpeedBackend(cfg)


def resolve_data(cfg: Config) -> tuple[Path, Path]:
    """(tokenizer dir, shards dir): the configured ones, or the bundled corpus built once in a cache."""
    d = cfg.data
    if bool(d.tokenizer) != bool(d.shards):
        raise ConfigError("data.tokenizer and data.shards: set both (your own data) or neither (bundled corpus)")
    if d.tokenizer:
        return Path(d.tokenizer), Path(d.shards)
    from megakd.data.default_corpus import prepare_default_data

    cache = Path(d.cache_dir or os.environ.get("MEGAKD_CACHE", "~/.cache/megakd")).expanduser()
    return prepare_default_data(cache, vocab_size=d.vocab_size, seq_len=d.seq_len, corpus=d.corpus)


def check_vocab(cfg: Config, tokenizer: Tokenizer) -> None:
    for name in ("generator", "discriminator"):
        if cfg.model.objective == "mlm" and name == "discriminator":
            continue
        size = getattr(cfg.model, name).vocab_size
        if size != tokenizer.vocab_size:
            raise ConfigError(
                f"model.{name}.vocab_size={size} but the tokenizer at {tokenizer.path} has "
                f"{tokenizer.vocab_size} pieces"
            )


def build_units(cfg: Config, generator: MaskedLM, discriminator: Discriminator | None,
                kd: TeacherKD | None = None) -> list[Unit]:
    """DecoupledOptim → generator + discriminator units; original ELECTRA → one joint unit; MLM → one.

    `kd` (DWT) attaches a frozen teacher to the generator's MLM loss in every layout.
    """
    kb, max_steps, sched = cfg.kernels.backend, cfg.train.max_steps, cfg.optim.schedule
    temperature = cfg.electra.sampling_temperature

    def unit(name, task, model, opt_cfg, loss_scale=1.0):
        optimizer = build_optimizer(model.named_parameters(), opt_cfg)
        return Unit(name=name, task=task, model=model, optimizer=optimizer,
                    scheduler=build_scheduler(optimizer, sched, max_steps),
                    clip_norm=opt_cfg.clip_norm, loss_scale=loss_scale)

    if discriminator is None:
        return [unit("generator", GeneratorTask(generator, kb, temperature, kd), generator, cfg.optim.generator)]
    if cfg.electra.decoupled:
        return [
            unit("generator", GeneratorTask(generator, kb, temperature, kd), generator, cfg.optim.generator),
            unit("discriminator", DiscriminatorTask(discriminator, kb), discriminator, cfg.optim.discriminator,
                 loss_scale=cfg.electra.loss_weight),
        ]
    pair = ElectraPair(generator, discriminator, share_embeddings=True)
    task = JointElectraTask(pair, cfg.electra.loss_weight, kb, temperature, kd)
    return [unit("electra", task, pair, cfg.optim.discriminator)]


def build_models(cfg: Config) -> tuple[MaskedLM, Discriminator | None]:
    """Both models, initialised identically on every rank from train.seed."""
    torch.manual_seed(cfg.train.seed)
    generator = MaskedLM(cfg.model.generator)
    discriminator = Discriminator(cfg.model.discriminator) if cfg.model.objective == "electra" else None
    return generator, discriminator


def admin_profile(cfg: Config, models: list[MaskedLM | Discriminator | None], shards_dir: Path,
                  tokenizer: Tokenizer) -> None:
    """Admin's one-batch profiling pass for models with `init: admin`.

    Every rank profiles the same batch (the first one a one-rank loader yields), so ω, like the
    weights, is identical everywhere. The generator sees masked input, the discriminator clean.
    """
    admin = [m for m in models if m is not None and m.config.init == "admin"]
    if not admin:
        return
    loader = PretrainingLoader(shards_dir, tokenizer, micro_batch_size=cfg.train.micro_batch_size,
                               seed=cfg.train.seed, mask_prob=cfg.data.mask_prob)
    batch = next(iter(loader))
    for model in admin:
        ids = batch["masked_input_ids"] if isinstance(model, MaskedLM) else batch["input_ids"]
        omegas = admin_initialize(model.encoder, ids, batch["attention_mask"])
        log.info("Admin init of the %s: omega from %.3g to %.3g", type(model).__name__, omegas[0], omegas[-1])


def build_loader(cfg: Config, tokenizer: Tokenizer, shards_dir: Path, micro_batch_size: int, rank: int,
                 world_size: int) -> PretrainingLoader:
    """The pretraining data stream as `cfg.data` describes it (training and `megakd bench` alike)."""
    return PretrainingLoader(
        shards_dir, tokenizer, micro_batch_size=micro_batch_size, rank=rank, world_size=world_size,
        num_workers=cfg.data.num_workers, seed=cfg.train.seed, mask_prob=cfg.data.mask_prob,
        skip_bad_shards=cfg.data.skip_bad_shards, pin_memory=torch.cuda.is_available(),
    )


def build_trainer(cfg: Config, backend: Backend | None = None) -> Trainer:
    backend = backend or build_backend(cfg)
    micro_batch, accumulation = cfg.batch_layout(backend.data_world_size)
    tokenizer_dir, shards_dir = resolve_data(cfg)
    tokenizer = Tokenizer.load(tokenizer_dir)
    check_vocab(cfg, tokenizer)
    manifest = read_manifest(shards_dir)
    if cfg.run.dir and backend.is_main:
        log.info("data: %s (%d samples, seq_len %d), tokenizer %s", shards_dir, manifest["num_samples"],
                 manifest["seq_len"], tokenizer_dir)
    generator, discriminator = build_models(cfg)
    admin_profile(cfg, [generator, discriminator], shards_dir, tokenizer)
    kd = None
    if cfg.distill.teacher:
        from megakd.distill.dwt import attach_teacher

        kd = attach_teacher(cfg, tokenizer, generator, backend.device)
    units = build_units(cfg, generator, discriminator, kd)
    backend.prepare(units, accumulation)
    loader = build_loader(cfg, tokenizer, shards_dir, micro_batch, backend.data_rank, backend.data_world_size)
    # Dropout must differ per rank but be reproducible: reseed after the shared model init.
    torch.manual_seed(cfg.train.seed * 1_000_003 + backend.rank)
    return Trainer(cfg, backend, units, loader, tokenizer_dir=tokenizer_dir,
                   kd=kd)


def run_pretraining(cfg: Config, resume: str | None = None) -> TrainResult:
    trainer = build_trainer(cfg)
    try:
        if resume:
            trainer.resume(resume)
        result = trainer.train()
        if cfg.run.export_hf and not result.preempted and trainer.backend.is_main:
            from megakd.convert import export_run

            log.info("exported HuggingFace model to %s", export_run(result.run_dir))
        return result
    finally:
        trainer.backend.close()
