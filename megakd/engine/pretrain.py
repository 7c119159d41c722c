"""Pretraining and DWT as a job of the run shell (`megakd.engine.run`): data, models, training layout,
backend and trainer, assembled from a finished config."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from megakd.config import Config, ConfigError
from megakd.data.loader import PretrainingLoader
from megakd.data.shards import MANIFEST, read_manifest
from megakd.data.storage import ShardStore
from megakd.data.tokenizer import Tokenizer
from megakd.engine import backend_factory
from megakd.engine.backends import TrainingBackend
from megakd.engine.hooks import Hook
from megakd.engine.layouts import Layout, build_layout
from megakd.engine.losses import TeacherKD
from megakd.engine.run import Outcome, Resume, ResumePolicy, Run, run_job, start_job
from megakd.engine.trainer import Trainer
from megakd.engine.validation import VALID_SEED, Validator
from megakd.engine.warm_start import warm_start
from megakd.finish import bundled_vocab_size, finish_config
from megakd.launch import Launch
from megakd.models.admin import admin_initialize, set_omegas
from megakd.models.electra import Discriminator, MaskedLM
from megakd.models.encoder import EncoderConfig
from megakd.models.remap import remap_masked_lm
from megakd.store import StoreError, check_same_tokenizer, freeze, load_model, rundir
from megakd.store.admin_profile import PROFILE_FILE, profile_record, read_profile, write_profile
from megakd.store.files import about, first_line

log = logging.getLogger(__name__)

# The CPU's pace in Admin's profiling pass, per torch thread: fp32 matmuls ran at 28 GFLOP/s on one thread of the
# 2-core machine (docs/distributed.md, `megakd bench`); the pass's other work (norms, softmax, dropout) is slower.
PROFILE_FLOPS_PER_THREAD = 20e9


def build_backend(cfg: Config, launch: Launch) -> TrainingBackend:
    """The run's backend (`megakd.engine.backend_factory`); a DeepSpeed engine takes `train.micro_batch_size`."""
    return backend_factory.build_backend(cfg.backend, cfg.train.precision, cfg.train.micro_batch_size, launch,
                                         tf32=cfg.train.tf32)


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
    discriminator = Discriminator(cfg.model.discriminator) if "discriminator" in cfg.model.built_models() else None
    return generator, discriminator


def admin_profile(cfg: Config, models: list[MaskedLM | Discriminator | None], shards_dir: ShardStore,
                  tokenizer: Tokenizer, backend: TrainingBackend, resume: Resume | None = None) -> Hook | None:
    """Admin's one-batch profiling pass for models with `init: admin`, once per run.

    A resume from a checkpoint skips it: the checkpoint holds the trained ω. A restart of a run that
    died before its first checkpoint (`--resume auto`, none saved) reads the ω its first start saved
    in run.dir (`megakd.store.admin_profile`). Otherwise rank 0 profiles the first batch a one-rank
    loader yields (the generator sees masked input, the discriminator clean) on the backend's device:
    on CUDA a copy of each encoder runs there and only the ω come back to the CPU models. Every rank
    gets rank 0's ω through one all-reduce, so ω, like the weights, is identical everywhere and no
    other rank touches the file. On the CPU the pass takes minutes at electra-base's size on a few
    cores, so it is announced with its matmul work (2 FLOPs per layer weight and token).

    Returns, on rank 0 after a fresh pass with a run.dir, the hook that saves the profile there once
    the run owns the directory (`SaveAdminProfile`); else None.
    """
    resume = resume or Resume()
    admin = {_section(m): m for m in models if m is not None and m.config.init == "admin"}
    if not admin or resume.checkpoint is not None:
        return None
    path = Path(cfg.run.dir) / PROFILE_FILE if cfg.run.dir else None
    configs = {name: m.config for name, m in admin.items()}
    omegas: dict[str, list[float]] = {}
    reused, error = False, None
    if backend.is_main:
        try:
            if resume.requested == "auto" and path is not None and path.exists():
                saved = read_profile(path, cfg.train.seed, configs)
                omegas = {name: saved["models"][name]["omegas"] for name in admin}
                reused = True
                log.info("Admin init: ω of the %s read from %s (profiled on %s at the run's first start)",
                         " and ".join(admin), path, saved["device"])
            else:
                omegas = _profile_first_batch(cfg, admin, shards_dir, tokenizer, backend.device)
        except Exception as err:  # every rank waits for rank 0's ω below: all of them must learn it failed
            error = err
    omegas = _from_main(backend, error, configs, omegas)
    for name, model in admin.items():
        set_omegas(model.encoder, omegas[name])
    if reused or path is None or not backend.is_main:
        return None
    return SaveAdminProfile(path, profile_record(cfg.train.seed, backend.device.type,
                                                 {name: (configs[name], omegas[name]) for name in admin}))


def _section(model: MaskedLM | Discriminator) -> str:
    """The model's config section, which names it in the profile file."""
    return "generator" if isinstance(model, MaskedLM) else "discriminator"


def _profile_first_batch(cfg: Config, admin: dict[str, MaskedLM | Discriminator], shards_dir: ShardStore,
                         tokenizer: Tokenizer, device: torch.device) -> dict[str, list[float]]:
    """Rank 0's pass, announced first; {model name: ω}."""
    micro_batch = cfg.train.micro_batch_size
    loader = PretrainingLoader(shards_dir, tokenizer, micro_batch_size=micro_batch, seed=cfg.train.seed,
                               mask_prob=cfg.data.mask_prob, shuffle_shards=cfg.data.shuffle_shards)
    flops = sum(2 * sum(p.numel() for p in m.encoder.layers.parameters()) for m in admin.values()) \
        * micro_batch * loader.seq_len
    shapes = " and ".join(f"{m.config.num_layers} x {m.config.hidden_size}" for m in admin.values())
    work = f"the {shapes} encoder(s) in one forward pass over {micro_batch} x {loader.seq_len} tokens"
    if device.type == "cpu":
        threads = torch.get_num_threads()
        log.info("Admin init: profiling %s on the CPU (~%.3g TFLOP): %s on %d threads", work, flops / 1e12,
                 about(flops / (PROFILE_FLOPS_PER_THREAD * threads)), threads)
    else:
        log.info("Admin init: profiling %s on %s (~%.3g TFLOP)", work, device, flops / 1e12)
    batch = next(iter(loader))
    return {name: admin_initialize(model.encoder, batch["masked_input_ids" if name == "generator" else "input_ids"],
                                   batch["attention_mask"], seed=cfg.train.seed, device=device)
            for name, model in admin.items()}


def _from_main(backend: TrainingBackend, error: BaseException | None, configs: dict[str, EncoderConfig],
               omegas: dict[str, list[float]]) -> dict[str, list[float]]:
    """Rank 0's ω on every rank (one float64 all-reduce: the other ranks add zeros, which is exact), or
    rank 0's failure raised on every rank."""
    sizes = {name: 2 * config.num_layers for name, config in configs.items()}
    flat = torch.zeros(1 + sum(sizes.values()), dtype=torch.float64)
    if backend.is_main:
        flat[0] = float(error is not None)
        if error is None:
            flat[1:] = torch.tensor([w for name in sizes for w in omegas[name]], dtype=torch.float64)
    flat = backend.all_reduce_sum(flat).cpu()
    if flat[0] > 0:
        raise error if error is not None else StoreError("Admin init: failed on rank 0 (see its message)")
    values = iter(flat[1:].tolist())
    return {name: [next(values) for _ in range(n)] for name, n in sizes.items()}


class SaveAdminProfile(Hook):
    """Rank 0 saves a fresh profile as run.dir/admin_profile.json once the run owns the directory.

    The models are built before the run starts (`Run.start`: a refused start leaves run.dir as it was),
    so the file is written when the loop starts, before the first step. One that is already there is left
    alone. Failing to save only costs a later restart's pass, so it is a warning, not the run's end.
    """

    def __init__(self, path: Path, record: dict):
        self.path, self.record = path, record

    def start(self, step: int) -> None:
        self.save()

    def save(self) -> None:
        try:
            rundir.check_owner(self.path)
            if not self.path.exists():
                write_profile(self.path, self.record)
                log.info("Admin init: saved the profile to %s (a restart before the first checkpoint reads it)",
                         self.path)
        except (OSError, StoreError) as err:
            log.warning("Admin init: could not save the profile to %s (%s); a restart before the first "
                        "checkpoint profiles again", self.path, first_line(err))


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


class PretrainingJob:
    """`megakd pretrain` and `megakd distill` in the run shell: one training whose checkpoints are the run's.

    The config is finished here, before anything is built: the data's tokenizer (the bundled corpus is
    built if needed) fills `vocab_size: auto` and the pad id, the launch fills `backend.name: auto`.
    `export(run_dir, out)`: the end-of-run export (the command's HuggingFace export,
    `megakd.convert.export_run`) into run.dir/hf, under the run's lock, once the run finished.
    """

    policy = ResumePolicy()  # optim.* and the rest take effect when named with --allow-change
    run_checkpoints = True

    def __init__(self, cfg: Config, launch: Launch, export: Callable[[Path, Path], object] | None = None,
                 extend: Callable[[Trainer], None] | None = None):
        self.tokenizer_dir, self.shards = resolve_data(cfg)
        self.tokenizer = Tokenizer.load(self.tokenizer_dir)
        self.launch = launch
        self.cfg = finish_config(cfg, self.tokenizer, launch=launch)
        self.export = export
        self.extend = extend  # adds a caller's hooks and stateful parts, before a checkpoint loads them
        self.trainer: Trainer | None = None

    def build_backend(self) -> TrainingBackend:
        return build_backend(self.cfg, self.launch)

    def build(self, run: Run) -> Trainer:
        """The trainer, built knowing `run.resume`: a run that loads a checkpoint reads no `init.*` and
        profiles nothing (the checkpoint overwrites both)."""
        self.trainer = _build_trainer(self.cfg, run, self.tokenizer, self.tokenizer_dir, self.shards)
        return self.trainer

    def prepare(self, run: Run) -> None:
        self.build(run)
        if self.extend is not None:
            self.extend(self.trainer)
        if run.resume.checkpoint is not None:
            self.trainer.load(run.resume)

    def train(self, run: Run) -> Outcome:
        return self.trainer.train(export=self.export)

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.loader.close()  # its shard read-ahead, which an error or a stop signal may have left running


def build_trainer(cfg: Config, backend: TrainingBackend | None = None, launch: Launch | None = None) -> Trainer:
    """A trainer for `cfg` outside a run (benchmarks and tools drive `Trainer.train_step`): its run directory
    is neither claimed nor resumed."""
    job = PretrainingJob(cfg, launch or Launch.from_environ())
    run = Run(job, backend or job.build_backend())
    try:
        return job.build(run)
    except BaseException:
        run.backend.close()  # a config error found while building must not leave a process group behind
        raise


def open_trainer(cfg: Config, resume: str | None = None, allow_change: tuple[str, ...] = (),
                 backend: TrainingBackend | None = None, extend: Callable[[Trainer], None] | None = None,
                 launch: Launch | None = None) -> Trainer:
    """The shell's steps up to training (`run_job` without `train`), for callers that drive the trainer
    themselves: `Trainer.train()`, then `Trainer.close()` ends the run. `extend(trainer)` adds hooks and
    stateful parts (`Trainer.add_hook`) before a resumed checkpoint loads them."""
    job = PretrainingJob(cfg, launch or Launch.from_environ(), extend=extend)
    start_job(job, resume, allow_change, backend)
    return job.trainer


def _build_trainer(cfg: Config, run: Run, tokenizer: Tokenizer, tokenizer_dir: Path, shards_dir: ShardStore
                   ) -> Trainer:
    backend = run.backend
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
    save_profile = admin_profile(cfg, [generator, discriminator], shards_dir, tokenizer, backend, run.resume)
    if run.resume.checkpoint is None:
        warm_start(cfg, tokenizer, generator, discriminator)
    if cfg.train.compile:
        compile_encoders([generator, discriminator])
    kd = attach_teacher(cfg, tokenizer, generator, backend.device) if cfg.distill.teacher else None
    layout = build_layout(cfg, generator, discriminator, kd)
    backend.prepare(layout, accumulation)
    loader = build_loader(cfg, tokenizer, shards_dir, micro_batch, backend.data_rank, backend.data_world_size)
    validator = build_validator(cfg, tokenizer, shards_dir, micro_batch, backend, layout)
    trainer = Trainer(cfg, run, layout, loader, tokenizer_dir=tokenizer_dir, validator=validator)
    if save_profile is not None:
        trainer.add_hook(save_profile)
    return trainer


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
                    export: Callable[[Path, Path], object] | None = None, launch: Launch | None = None) -> Outcome:
    """Train (or continue) the run `cfg` describes, in the run shell; a run that finished ends with
    `export(run_dir, out)` into run.dir/hf, under the run's lock. `launch`: the command's (read from the
    environment here when a caller has none)."""
    return run_job(PretrainingJob(cfg, launch or Launch.from_environ(), export), resume, allow_change)


def run_distill(cfg: Config, resume: str | None = None, allow_change: tuple[str, ...] = (),
                export: Callable[[Path, Path], object] | None = None, launch: Launch | None = None) -> Outcome:
    """`megakd distill` (DWT, docs/methods.md § DWT): pretraining with `distill.teacher` required.

    The student is `model.generator`: a BERT-MLM (`model.objective=mlm`, DWT as published) or an
    ELECTRA generator, whose MLM head gets the KD term (the discriminator trains on the distilled
    generator's samples as usual). The teacher is loaded, frozen, checked against the data's
    tokenizer and optionally remapped into the student by `attach_teacher`.
    """
    if not cfg.distill.teacher:
        raise ConfigError("distill.teacher: expected a teacher (run, checkpoint, model dir or HF MLM dir); "
                          "without one use `megakd pretrain`")
    return run_pretraining(cfg, resume=resume, allow_change=allow_change, export=export, launch=launch)
