"""Pretraining (and DWT) as a job on the one training loop (`megakd.engine.loop`).

One optimizer step is one `backend.train_step(layout, batches, step)` call: `accumulation_steps`
micro-batches per rank, run as the training layout (`megakd.engine.layouts`) says. The job adds what
only pretraining has: the shard loader as the step source (held steps when storage fails, a stop
signal that ends a wait for data), validation and the probe, the checkpoint's config and tokenizer,
and the rules for resuming a run directory (changed config keys, another world size).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from megakd.config import Config
from megakd.configio import config_to_dict, read_yaml_file, save_config
from megakd.data.storage import StorageError as DataStorageError
from megakd.data.stream import StoppedWaitingForData
from megakd.data.tokenizer import copy_tokenizer
from megakd.engine.backends import TrainingBackend
from megakd.engine.hooks import AtEnd, Hook, StepHook
from megakd.engine.layouts import Layout
from megakd.engine.loop import Checkpointer, LoopPlan, RandomStreams, StepInput, TrainingLoop
from megakd.engine.probe import Probe
from megakd.engine.runlog import MetricsWriter, plot_metrics
from megakd.engine.session import RunSession
from megakd.engine.units import Unit
from megakd.engine.validation import Validator
from megakd.store import checkpoint, rundir
from megakd.store.files import StoreError

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    step: int
    preempted: bool  # stopped on a signal, after writing a checkpoint
    run_dir: Path
    interrupted: bool = False  # the signal was SIGINT on some rank (the command exits 130, not 0)
    exported: Path | None = None  # the end-of-run export, where one was asked for and published (rank 0)
    export_stopped_by: int | None = None  # the signal that stopped the export (nothing was exported)


class Trainer:
    """A pretraining (or DWT) job on the one training loop: the shard loader as its step source, validation
    and the probe as its evaluations, the run directory's config, tokenizer and resume rules."""

    def __init__(self, cfg: Config, backend: TrainingBackend, layout: Layout, loader, *, tokenizer_dir: Path,
                 validator: Validator | None = None):
        self.cfg = cfg
        self.validator = validator  # scores held-out shards every train.eval_every steps
        self.tokenizer_dir = Path(tokenizer_dir)
        self.backend = backend
        self.run_dir = Path(cfg.run.dir)
        self.session = RunSession(self.run_dir, backend)  # the run dir's lock, stop signals, saving
        self._saved_config: dict = {}  # the resumed checkpoint's config, kept in config_history/ if it changed
        self._config_changes: dict = {}
        self._opened = False
        self._probe: Probe | None = None  # built at the first probe step (loading and tokenizing the task)
        t, main, every = cfg.train, backend.is_main, cfg.train.save_every
        streams = RandomStreams(torch.Generator().manual_seed(t.seed * 100_003 + backend.data_rank),
                                fresh_seed=lambda: t.seed * 1_000_003 + backend.rank + 104_729 * self.step)
        plan = LoopPlan(
            max_steps=t.max_steps, log_every=t.log_every, save_due=lambda step: bool(every) and step % every == 0,
            save_at_end=True, bad_step_limit=t.max_bad_steps,
            bad_step_limit_text=f"train.max_bad_steps={t.max_bad_steps}",
            bar_values=_bar_values, show_bar=main and cfg.run.progress_bar,
            at_end=[AtEnd(self._plot)] if main and cfg.run.plots else [])
        metrics = (lambda step: MetricsWriter.for_run(self.run_dir, cfg, step)) if main else None
        self.loop = TrainingLoop(backend, layout, self.session, LoaderSteps(loader), streams, plan, metrics)
        self.loop.checkpointer = Checkpointer(self.session, self.run_dir, list(layout.units.values()), self.loop.parts,
                                              keep_last=cfg.run.keep_last, files=self._checkpoint_files,
                                              upgrade=_upgrade_flat_rank_state)
        if validator is not None:
            self.add_hook(StepHook(t.eval_every, validator.evaluate))
        self.add_hook(StepHook(t.probe_every, self._probe_line, own_line=True))
        streams.seed_rank(t.seed * 1_000_003 + backend.rank)  # dropout, after the models' shared init

    def add_hook(self, hook: Hook, state: str | None = None) -> None:
        """Run `hook` after every applied step (values it adds to the step's lines reach metrics.jsonl),
        after the hooks added before it, and its `end` when the run ends. With a `state` name, the hook is
        also a stateful part of the run (`state_dict`/`load_state_dict`): checkpointed and resumed."""
        self.loop.plan.evaluations.append(hook)
        if state is not None:
            self.loop.checkpointer.add(state, hook)

    # -- the loop's state, as the job's ---------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.loop.progress.step

    @property
    def bad_steps(self) -> int:
        return self.loop.progress.bad_steps

    @property
    def interval(self) -> dict[str, torch.Tensor]:
        """The statistics summed on the device since the last log line."""
        return self.loop.interval.sums

    @property
    def rng(self) -> torch.Generator:
        """This rank's replacement-sampling stream."""
        return self.loop.streams.sampling

    @property
    def layout(self) -> Layout:
        return self.loop.layout

    @property
    def loader(self):
        """The shard loader the loop's step source reads."""
        return self.loop.source.loader

    @property
    def units(self) -> dict[str, Unit]:
        return self.layout.units

    def train_step(self, batches) -> dict[str, float] | None:
        """One optimizer step on `batches` (an iterator of micro-batches) outside the run, as the benchmarks
        drive it; returns the gradient norms, or None if the update was skipped."""
        return self.loop.step(StepInput(batches)).norms

    def _checkpoint_files(self, tmp: Path) -> None:
        """Rank 0's files in a checkpoint, which make it self-contained: conversion and resumption need no
        external paths."""
        save_config(self.cfg, tmp / "config.yaml")
        copy_tokenizer(self.tokenizer_dir, tmp / "tokenizer")

    def _plot(self) -> None:
        t = self.cfg.train  # the probe's task is validated (>= 2 labels) only when the probe is on
        plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "plots",
                     probe_chance=1 / t.probe_task.num_labels if t.probe_every else None)

    # -- the probe ------------------------------------------------------------------------------------
    def _probe_line(self, step: int) -> dict | None:
        rec = self.run_probe()
        if rec is not None:
            log.info("step %d: probe_acc %.4f (%.1f s)", step, rec["probe_acc"], rec["probe_seconds"])
        return rec

    def run_probe(self) -> dict | None:
        """probe_acc and probe_seconds on rank 0 (None elsewhere, or where the probe cannot run)."""
        if self._probe is None:
            self._probe = self._build_probe()
        return None if self._probe is False else {"step": self.step, **self._probe(self.probe_encoder())}

    def _build_probe(self) -> Probe | bool:
        """The downstream probe on rank 0, or False when the encoder is not whole on this rank."""
        if not self.backend.is_main:
            return False
        if not self.backend.holds_whole_model:
            log.warning("train.probe_every: the probe is off under ZeRO-3 and pipeline parallelism (no rank holds "
                        "the whole encoder)")
            return False
        from megakd.data.tokenizer import Tokenizer

        encoder = self.probe_encoder()
        return Probe(self.cfg, Tokenizer.load(self.tokenizer_dir), encoder.config.max_position_embeddings)

    def probe_encoder(self) -> torch.nn.Module:
        """The encoder a downstream task would fine-tune, as the layout says."""
        return self.layout.probe_encoder()

    # -- owning the run directory, resuming --------------------------------------------------------
    def open_run(self, resume: str | None, allow_change: tuple[str, ...] = ()) -> None:
        """Own run.dir, then resume from a verified checkpoint if asked.

        `resume`: None = a new run (run.dir must be unused, or run.overwrite moves it aside);
        "auto" = the newest intact checkpoint in run.dir (a damaged newer one is reported and
        skipped), or step 0 if there is none; a path = that checkpoint, which must verify (one
        from another run directory starts run.dir as a new run, so run.dir must be unused).
        """
        chosen = self.session.own(lambda: self._decide(resume))
        self._opened = True
        if resume == "auto" and chosen is None:
            log.info("no checkpoint in %s: starting from step 0", self.run_dir)
        elif resume is not None:
            self._resume_from(checkpoint.step_dir(self.run_dir, chosen) if resume == "auto"
                              else self._explicit_checkpoint(resume), allow_change)
        self.session.announce()  # only now: a refused resume leaves the run dir byte-identical

    def _decide(self, resume: str | None) -> int | None:
        """On rank 0, under the lock: claim run.dir for a new run, or find and verify the checkpoint to
        resume; the step of `--resume auto`'s checkpoint (None: there is none)."""
        if resume is None or self._starts_new_run_dir(resume):
            aside = rundir.claim_for_new_run(self.run_dir, self.cfg.run.overwrite)
            if aside is not None:
                log.warning("run.overwrite: moved the old contents of %s to %s", self.run_dir, aside)
        checkpoint.remove_stale_temp_dirs(self.run_dir)
        if resume == "auto":
            found = checkpoint.newest_intact(self.run_dir)
            if found is None and checkpoint.list_checkpoints(self.run_dir):
                raise StoreError(f"{checkpoint.checkpoints_root(self.run_dir)}: no intact checkpoint to "
                                 "resume from (every one failed verification; see the warnings above)")
            if found is None:
                rundir.check_is_a_run(self.run_dir, self.session.lock)
            return checkpoint.step_of(found) if found is not None else None
        if resume is not None:
            checkpoint.verify(self._explicit_checkpoint(resume))
        return None

    def _starts_new_run_dir(self, resume: str) -> bool:
        """`--resume PATH` with a checkpoint from another run directory starts run.dir afresh (so it must be unused)."""
        return resume != "auto" and not Path(resume).resolve().is_relative_to(self.run_dir.resolve())

    @staticmethod
    def _explicit_checkpoint(spec: str) -> Path:
        path = Path(spec)
        if not path.is_dir():
            raise FileNotFoundError(f"--resume {spec}: no checkpoint directory at {path}")
        return path

    def _resume_from(self, path: Path, allow_change: tuple[str, ...]) -> None:
        """Load `path` (at this world size, or resharded from another: the data position is global, so every
        rank continues the same global sample order; see the loop's parts for the rest)."""
        saved_file = path / "config.yaml"
        if not saved_file.is_file():
            raise StoreError(f"{saved_file}: missing ({path} is not a complete megakd checkpoint)")
        saved = read_yaml_file(saved_file)
        if not isinstance(saved, dict):
            raise StoreError(f"{saved_file}: expected a mapping of config sections, got {type(saved).__name__}")
        self._saved_config = saved
        self._config_changes = rundir.check_changes(path, saved, config_to_dict(self.cfg), allow_change)
        fresh = {name: _hyperparameters(unit) for name, unit in self.units.items()}
        saved_world = self.loop.checkpointer.load(path, resharding=True)
        if saved_world != self.backend.world_size:
            log.warning("elastic resume: %d -> %d processes at step %d, global sample position %d",
                        saved_world, self.backend.world_size, self.step, self.loader.position)
        if any(key.startswith("optim.") for key in self._config_changes):
            for name, unit in self.units.items():
                _apply_hyperparameters(unit, fresh[name])
        if self._config_changes:
            log.warning("resumed from %s at step %d with changed %s", path, self.step, ", ".join(
                f"{k} ({o!r} -> {n!r})" for k, (o, n) in self._config_changes.items()))
        else:
            log.info("resumed from %s at step %d", path, self.step)

    def close(self) -> None:
        self.session.release()
        self.backend.close()
        self.loader.close()  # its shard read-ahead, which an error or a stop signal may have left running

    # -- the run ---------------------------------------------------------------------------------------
    def train(self, export: Callable[[Path, Path], object] | None = None) -> TrainResult:
        """Train to train.max_steps (a new run unless `open_run` resumed one); the run dir is locked until the end.

        `export(run_dir, out)`: the end-of-run export, written by rank 0 into run_dir/hf once the run
        finished (not when stopped), still under the run directory's lock (`RunSession.export`).
        """
        if not self._opened:
            self.open_run(None)
        try:
            self._write_run_config()
            with self.session.stop_signals():
                end = self.loop.run()
            result = TrainResult(step=self.step, preempted=end.stopped, run_dir=self.run_dir,
                                 interrupted=end.interrupted)
            if export is not None and not result.preempted:
                self.backend.close()  # the export is rank 0's alone: the other ranks may leave now
                if self.backend.is_main:
                    result.exported, result.export_stopped_by = self.session.export(export)
            return result
        finally:
            self.session.release()

    def _write_run_config(self) -> None:
        """Rank 0: config.yaml of this run (and, after a resume that changed keys, the old one kept in
        config_history/), before the first step."""
        if self.backend.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if self._config_changes:
                rundir.record_history(self.run_dir, self._saved_config, self.step)
            save_config(self.cfg, self.run_dir / "config.yaml")


def _upgrade_flat_rank_state(state: dict, rank: int) -> dict:
    """A pretraining rank state written before the loop's parts had names (step, bad_steps, interval, data
    and rng side by side): the same values under the parts' names. It saved no gradient norms, so the
    first log line after the resume averages those of the steps after it, as it did then."""
    if "progress" in state:
        return state
    return {"progress": {"step": state["step"], "bad_steps": state["bad_steps"]},
            "interval": {"sums": state["interval"], "norms": {}, "steps": 0},
            "data": state["data"], "rng": state["rng"]}


def _bar_values(line: dict) -> dict | None:
    """The progress bar's figures, from the step's log line (if it has one)."""
    return {k: f"{line[k]:.3g}" for k in ("gen_loss", "disc_loss", "rtd_f1", "tokens_per_s") if k in line} or None


class LoaderSteps:
    """Pretraining's step source: the shard loader's micro-batches (`StepBatches` over them for the run)."""

    can_hold = True

    def __init__(self, loader):
        self.loader = loader
        self.batches: StepBatches | None = None

    @property
    def failure(self) -> DataStorageError | None:
        return self.batches.failure if self.batches is not None else None

    @contextlib.contextmanager
    def start(self, session: RunSession, backend: TrainingBackend):
        """Under a backend that can hold a step, a stop signal ends a wait for data (the step is skipped)."""
        waiting = contextlib.nullcontext
        if backend.holds_steps:  # only a loop that can skip a step stops in the middle of one
            waiting = functools.partial(session.waiting_for_data, interrupt=not self.loader.num_workers)
            self.loader.stop_waiting = lambda: session.stop_flags()[0]
        self.batches = StepBatches(iter(self.loader), can_hold=backend.holds_steps, waiting=waiting)
        try:
            yield
        finally:
            self.batches = None  # the iterator goes, and with it the DataLoader's workers

    def next_step(self) -> StepInput:
        return StepInput(self.batches, held=self.batches.held)

    def counters(self) -> dict[str, float]:
        # The loaders' retry counts (cumulative, per rank) ride on the line's all-reduce: the job's total.
        return {"read_retries": float(self.loader.read_retries)}

    def line_values(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


class StepBatches:
    """The loader's micro-batches, turned into stand-ins when storage fails for good mid-run.

    A rank whose reads fail cannot simply raise: the other ranks would wait for it in the step's
    collectives. It keeps repeating its last micro-batch instead, and reports `held()` in the step's
    agreement, so every rank skips that update, saves and stops (`TrainingLoop._stop_on_storage_failure`).
    Without a previous batch, or under a backend that cannot skip an update, the error is raised.

    A stop signal that ends the wait for a batch (`waiting`, `RunSession.waiting_for_data`) is held
    the same way, so the ranks skip the step and save the run as it was before it; without a previous
    batch it is raised (`StoppedWaitingForData`): the run is as its last save left it.
    """

    def __init__(self, batches, can_hold: bool, waiting=contextlib.nullcontext):
        self.batches = batches
        self.can_hold = can_hold
        self.waiting = waiting
        self.last: dict | None = None
        self.failure: DataStorageError | None = None
        self.stopped = False  # a stop signal ended the wait for a batch

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.failure is None and not self.stopped:
            try:
                with self.waiting():
                    self.last = next(self.batches)
                return self.last
            except DataStorageError as error:
                if self.last is None or not self.can_hold:
                    raise
                log.error("%s", error)
                self.failure = error
            except StoppedWaitingForData:
                if self.last is None:
                    raise
                log.warning("a stop signal ended the wait for a batch: the step is skipped and the run saved as it "
                            "was before it")
                self.stopped = True
        return self.last

    def held(self) -> bool:
        return self.failure is not None or self.stopped


_HYPERPARAMETERS = ("lr", "initial_lr", "betas", "eps", "weight_decay")


def _hyperparameters(unit: Unit) -> dict:
    """What the current config set on a unit's optimizer and schedule, before a checkpoint overwrites it."""
    groups = [{k: g[k] for k in _HYPERPARAMETERS if k in g} for g in unit.optimizer.param_groups]
    return {"groups": groups, "base_lrs": list(unit.scheduler.base_lrs)}


def _apply_hyperparameters(unit: Unit, fresh: dict) -> None:
    """Make allowed optim.* changes take effect: the loaded state keeps its moments, the config sets the rest.

    The LR of the next step is the new peak times the schedule's multiplier at the resumed step.
    """
    scheduler = unit.scheduler
    scheduler.base_lrs = list(fresh["base_lrs"])
    for group, values, base, multiplier in zip(unit.optimizer.param_groups, fresh["groups"], scheduler.base_lrs,
                                                scheduler.lr_lambdas):
        group.update(values)
        group["lr"] = base * multiplier(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in unit.optimizer.param_groups]
