"""The pretraining loop: steps, metrics, checkpoints, resume and signals, for any layout on any backend.

One optimizer step is one `backend.train_step(layout, batches, step)` call: `accumulation_steps`
micro-batches per rank, run as the training layout (`megakd.engine.layouts`) says. The trainer
knows no unit names or statistic names: it sums what a step returns and asks the layout for
metrics.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from megakd.config import Config
from megakd.configio import config_to_dict, read_yaml_file, save_config
from megakd.data.storage import StorageError as DataStorageError
from megakd.data.stream import StoppedWaitingForData
from megakd.data.tokenizer import copy_tokenizer
from megakd.engine.backends import STORAGE_FAILED, StepResult, TrainingBackend, stat_sums
from megakd.engine.hooks import AtEnd, Checkpoints, Clock, Hook, Hooks, ProgressBar, StepEnd, StepHook
from megakd.engine.layouts import Layout
from megakd.engine.probe import Probe
from megakd.engine.runlog import MetricsWriter, plot_metrics
from megakd.engine.session import RunSession, rng_state, seed_rng, set_rng_state, skipped_update
from megakd.engine.units import StepContext, Unit, never
from megakd.engine.validation import Validator
from megakd.errors import UserError
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
    def __init__(self, cfg: Config, backend: TrainingBackend, layout: Layout, loader, *, tokenizer_dir: Path,
                 validator: Validator | None = None):
        self.cfg = cfg
        self.validator = validator  # scores held-out shards every train.eval_every steps
        self.tokenizer_dir = Path(tokenizer_dir)
        self.backend = backend
        self.layout = layout
        self.loader = loader
        self.run_dir = Path(cfg.run.dir)
        self.step = 0
        self.bad_steps = 0
        # Running sums since the last log line, kept on the device so a micro-batch adds its
        # statistics without waiting for the GPU; they are copied to the host once per log line.
        self.interval: dict[str, torch.Tensor] = stat_sums(backend.device)
        self.rng = torch.Generator().manual_seed(cfg.train.seed * 100_003 + backend.data_rank)
        self.session = RunSession(self.run_dir, backend)  # the run dir's lock, stop signals, saving
        self._saved_config: dict = {}  # the resumed checkpoint's config, kept in config_history/ if it changed
        self._config_changes: dict = {}
        self._opened = False
        self._metrics: MetricsWriter | None = None  # rank 0's, while `_train` runs (its `failure` stops the run)
        self._probe: Probe | None = None  # built at the first probe step (loading and tokenizing the task)
        # Gradient norms summed since the last log line, and over how many steps (not checkpointed).
        self._norms_sum: dict[str, float] = defaultdict(float)
        self._norm_steps = 0
        self._clock: Clock | None = None  # training time since the last log line, while `_train` runs
        self.hooks: list[Hook] = []  # after the log line, before the metrics file (see `_hooks`)
        if validator is not None:
            self.add_hook(StepHook(cfg.train.eval_every, validator.evaluate))
        self.add_hook(StepHook(cfg.train.probe_every, self._probe_line, own_line=True))

    def add_hook(self, hook: Hook) -> None:
        """Run `hook` after every applied step (values it adds to the step's lines reach metrics.jsonl),
        after the hooks added before it, and its `end` when the run ends."""
        self.hooks.append(hook)

    def _hooks(self) -> Hooks:
        """The run's hooks in order: the log line, validation, the probe and added hooks, then (rank 0)
        the metrics file, the progress bar, checkpoint cadence and (rank 0) the plots."""
        cfg, main = self.cfg, self.backend.is_main
        hooks = Hooks()
        hooks.add(StepHook(cfg.train.log_every, lambda step: self._record(self._clock.lap()),
                           also_at=cfg.train.max_steps))
        for hook in self.hooks:
            hooks.add(hook)
        if main:
            self._metrics = MetricsWriter.for_run(self.run_dir, cfg, self.step)
            hooks.add(self._metrics)
        hooks.add(ProgressBar(cfg.train.max_steps, self.step, _bar_values, enabled=main and cfg.run.progress_bar))
        every = cfg.train.save_every
        hooks.add(Checkpoints(self.save, lambda step: bool(every) and step % every == 0, at_end=True,
                              last_saved=self.step))
        if main and cfg.run.plots:
            hooks.add(AtEnd(lambda: plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "plots")))
        return hooks

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
        cfg = self.cfg
        if not self.backend.is_main:
            return False
        if cfg.backend.name == "deepspeed" and (cfg.backend.zero_stage == 3 or cfg.backend.pipeline_stages > 1):
            log.warning("train.probe_every: the probe is off under ZeRO-3 and pipeline parallelism (no rank holds "
                        "the whole encoder)")
            return False
        from megakd.data.tokenizer import Tokenizer

        encoder = self.probe_encoder()
        return Probe(cfg, Tokenizer.load(self.tokenizer_dir), encoder.config.max_position_embeddings)

    def probe_encoder(self) -> torch.nn.Module:
        """The encoder a downstream task would fine-tune, as the layout says."""
        return self.layout.probe_encoder()

    @property
    def units(self) -> dict[str, Unit]:
        return self.layout.units

    # -- state -----------------------------------------------------------------------------------
    def rank_state(self) -> dict:
        return {
            "step": self.step,
            "bad_steps": self.bad_steps,
            "interval": {k: v.cpu() for k, v in self.interval.items()},
            "data": self.loader.state_dict(),
            "rng": self._rng_state(),
        }

    def _rng_state(self) -> dict:
        return rng_state(self.rng)

    def load_rank_state(self, state: dict) -> None:
        self.step = state["step"]
        self.bad_steps = state["bad_steps"]
        self.interval.clear()
        self.interval.update({k: v.to(self.backend.device) for k, v in state["interval"].items()})
        self.loader.load_state_dict(state["data"])
        self._set_rng_state(state["rng"])

    def _set_rng_state(self, rng: dict) -> None:
        set_rng_state(rng, self.rng)

    def save(self) -> Path:
        """Write a checkpoint on every rank and publish it atomically; a failed save leaves no trace."""
        self._stop_if_metrics_failed()

        def write(tmp: Path) -> None:
            if self.backend.is_main:
                save_config(self.cfg, tmp / "config.yaml")
                # A checkpoint is self-contained: conversion and resumption need no external paths.
                copy_tokenizer(self.tokenizer_dir, tmp / "tokenizer")
            self.backend.save_units(list(self.units.values()), tmp)
            checkpoint.save_rank_state(tmp, self.backend.rank, self.rank_state())

        return self.session.save(self.run_dir, self.step, write, self.cfg.run.keep_last)

    def _stop_if_metrics_failed(self) -> None:
        """Before any save: if rank 0's metrics writes hit a full disk, every rank stops here without saving.

        Its `failure` was already a stop request (`_local_stop_flags`), so the ranks got here together
        at the next step (or at the end of the run); the newest checkpoint stays the one to resume from,
        and its metrics.jsonl lines are all intact.
        """
        failure = self._metrics.failure if self._metrics is not None else None
        if self.backend.all_reduce_sum(torch.tensor(float(failure is not None))).item() == 0:
            return
        if failure is not None:
            raise failure
        raise StoreError(f"{self.run_dir}: rank 0 could not write the run's metrics (see its message); stopped "
                         "without saving")

    # -- owning the run directory, resuming --------------------------------------------------------
    def open_run(self, resume: str | None, allow_change: tuple[str, ...] = ()) -> None:
        """Own run.dir, then resume from a verified checkpoint if asked.

        `resume`: None = a new run (run.dir must be unused, or run.overwrite moves it aside);
        "auto" = the newest intact checkpoint in run.dir (a damaged newer one is reported and
        skipped), or step 0 if there is none; a path = that checkpoint, which must verify (one
        from another run directory starts run.dir as a new run, so run.dir must be unused).
        """
        chosen = int(self.session.own(lambda: self._decide(resume))) - 1
        self._opened = True
        if resume == "auto" and chosen < 0:
            log.info("no checkpoint in %s: starting from step 0", self.run_dir)
        elif resume is not None:
            self._resume_from(checkpoint.step_dir(self.run_dir, chosen) if resume == "auto"
                              else self._explicit_checkpoint(resume), allow_change)
        self.session.announce()  # only now: a refused resume leaves the run dir byte-identical

    def _decide(self, resume: str | None) -> int:
        """On rank 0, under the lock: claim run.dir for a new run, or find and verify the checkpoint to
        resume; 1 + the step of `--resume auto`'s checkpoint (0: none)."""
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
            return checkpoint.step_of(found) + 1 if found is not None else 0
        if resume is not None:
            checkpoint.verify(self._explicit_checkpoint(resume))
        return 0

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
        saved_file = path / "config.yaml"
        if not saved_file.is_file():
            raise StoreError(f"{saved_file}: missing ({path} is not a complete megakd checkpoint)")
        saved = read_yaml_file(saved_file)
        if not isinstance(saved, dict):
            raise StoreError(f"{saved_file}: expected a mapping of config sections, got {type(saved).__name__}")
        self._saved_config = saved
        self._config_changes = rundir.check_changes(path, saved, config_to_dict(self.cfg), allow_change)
        fresh = {name: _hyperparameters(unit) for name, unit in self.units.items()}
        saved_world = len(list(path.glob("trainer_state_rank*.pt")))
        if saved_world == self.backend.world_size:
            self.backend.load_units(list(self.units.values()), path)
            self.load_rank_state(checkpoint.load_rank_state(path, self.backend.rank))
        else:
            self._elastic_resume(path, saved_world)
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

    def _elastic_resume(self, path: Path, saved_world: int) -> None:
        """Resume a checkpoint written by another number of processes.

        The data position is global (megakd.data.stream), so every rank continues the same global
        sample order; rank 0 takes over the metric sums of all saved ranks, and a rank that did not
        exist before starts fresh, deterministic RNG streams (dropout and sampling cannot continue
        bit-exactly across a layout change; everything else does). Under DeepSpeed ZeRO the model
        and optimizer state go through a universal checkpoint (`DeepSpeedBackend.load_units_elastic`);
        the pipeline engine cannot re-cut its stages' state and is refused.
        """
        b = self.backend
        if saved_world < 1:
            raise UserError(f"checkpoint {path} has no trainer_state_rank*.pt: it is incomplete or not a "
                            f"megakd checkpoint")
        units = list(self.units.values())
        if b.name == "deepspeed":
            load_elastic = getattr(b, "load_units_elastic", None)
            if load_elastic is None:
                raise UserError(f"checkpoint {path} was written by {saved_world} processes, this run has "
                                f"{b.world_size}: a pipeline-parallel checkpoint resumes only at its world size; "
                                f"resume with {saved_world} processes, or start a new run from its weights "
                                f"(init.generator / init.discriminator = the checkpoint)")
            load_elastic(units, path, self.run_dir)
        else:
            b.load_units(units, path)
        states = [checkpoint.load_rank_state(path, r) for r in range(saved_world)]
        mine = states[b.rank] if b.rank < saved_world else {**states[0], "rng": None}
        interval = stat_sums(torch.device("cpu"))
        if b.rank == 0:
            for state in states:
                for key, value in state["interval"].items():
                    interval[key] += value
        rng = mine["rng"]
        if rng is None:
            seed_rng(self.cfg.train.seed * 1_000_003 + b.rank + 104_729 * mine["step"], self.rng)
            rng = self.rank_state()["rng"]
        self.load_rank_state({**mine, "interval": dict(interval), "rng": rng})
        log.warning("elastic resume: %d -> %d processes at step %d, global sample position %d",
                    saved_world, b.world_size, self.step, self.loader.position)

    # -- one optimizer step ------------------------------------------------------------------------
    def train_step(self, batches) -> dict[str, float] | None:
        """Run one optimizer step; returns grad norms, or None if the step was skipped."""
        return self._step(batches).norms

    def _step(self, batches) -> StepResult:
        """One step through the backend; the trainer's counters and interval sums follow its result."""
        held = batches.held if isinstance(batches, StepBatches) else never
        context = StepContext(index=self.step, rng=self.rng, stop_flags=self._local_stop_flags, held=held)
        result = self.backend.train_step(self.layout, batches, context)
        if result.skipped == STORAGE_FAILED:
            return result  # nothing of this step counts: the checkpoint repeats it on resume
        for key, value in result.stats.items():
            self.interval[key] += value.to(self.interval[key].device)
        if result.norms is None:
            self._skipped(result.skipped)
        else:
            for key, value in result.norms.items():
                self._norms_sum[key] += value
            self._norm_steps += 1
            self.bad_steps = 0
            self.step += 1
        return result

    def _stop_on_storage_failure(self, batches: StepBatches, data: dict, rng: dict, stop: bool) -> None:
        """Some rank's storage failed for good, or a stop signal ended its wait for data, during a step
        that every rank then skipped: save the run exactly as it was before that step (data position
        and random streams rewound on every rank; the skipped step changed nothing else), so a resume
        continues bit-exactly. Then stop with the failing rank's one-line error, or, where no rank of
        this one's failed and a stop was asked for (`stop`), return as a preemption does."""
        self.loader.load_state_dict(data)
        self._set_rng_state(rng)
        path = self.save()
        if batches.failure is not None:
            log.warning("storage failed at step %d: saved %s; resume with --resume auto once it is back",
                        self.step + 1, path)
            raise batches.failure
        if stop:
            return
        raise DataStorageError(f"step {self.step + 1}: another rank's storage failed (see its message); the run was "
                           f"saved at step {self.step}")

    def _skipped(self, what: str) -> None:
        """Count a skipped update; `train.max_bad_steps` of them in a row stop the run unsaved."""
        self.bad_steps += 1
        limit = self.cfg.train.max_bad_steps
        skipped_update(self.bad_steps, what, self.step + 1, limit, f"train.max_bad_steps={limit}", self.run_dir)

    # -- metrics ---------------------------------------------------------------------------------
    def _record(self, seconds: float) -> dict:
        """The log line: the interval's sums over all ranks as the layout's ratios, mean gradient norms,
        throughput over `seconds` of training; the interval starts again."""
        names = sorted(self.interval)
        # The loaders' retry counts (cumulative, per rank) ride on the same all-reduce: the job's total.
        retries = torch.tensor([float(self.loader.read_retries)], dtype=torch.float64).to(self.backend.device)
        totals = self.backend.all_reduce_sum(torch.cat([torch.stack([self.interval[k] for k in names]), retries]))
        totals = totals.cpu().tolist()
        s = dict(zip(names, totals))
        rec: dict = {"step": self.step, **self.layout.ratios(s), "read_retries": int(totals[-1])}
        steps = max(1, self._norm_steps)
        rec.update(self.layout.optimizer_metrics({k: v / steps for k, v in self._norms_sum.items()}))
        rec["tokens_per_s"] = s.get("tokens", 0.0) / max(seconds, 1e-9)
        self.interval.clear()
        self._norms_sum.clear()
        self._norm_steps = 0
        return rec

    # -- the loop ----------------------------------------------------------------------------------
    def _local_stop_flags(self) -> tuple[bool, bool]:
        """The session's stop flags (`RunSession.stop_flags`); a failed metrics write on rank 0 asks for a stop too."""
        stop, interrupted = self.session.stop_flags()
        metrics_failed = self._metrics is not None and self._metrics.failure is not None
        return stop or metrics_failed, interrupted

    def train(self, export: Callable[[Path, Path], object] | None = None) -> TrainResult:
        """Train to train.max_steps (a new run unless `open_run` resumed one); the run dir is locked until the end.

        `export(run_dir, out)`: the end-of-run export, written by rank 0 into run_dir/hf once the run
        finished (not when stopped), still under the run directory's lock (`RunSession.export`).
        """
        if not self._opened:
            self.open_run(None)
        try:
            result = self._train()
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

    def _train(self) -> TrainResult:
        self._write_run_config()
        hooks = self._hooks()
        preempted = interrupted = finished = False
        with self.session.stop_signals():
            try:
                self.layout.train()
                waiting = contextlib.nullcontext
                if self.backend.holds_steps:  # only a loop that can skip a step stops in the middle of one
                    waiting = functools.partial(self.session.waiting_for_data, interrupt=not self.loader.num_workers)
                    self.loader.stop_waiting = lambda: self.session.stop_flags()[0]
                batches = StepBatches(iter(self.loader), can_hold=self.backend.holds_steps, waiting=waiting)
                self._clock = Clock(hooks)
                while self.step < self.cfg.train.max_steps:
                    step_start = self.loader.state_dict(), self._rng_state()
                    try:
                        result = self._step(batches)
                    except StoppedWaitingForData:  # before the first batch: the run is as its last save left it
                        preempted, interrupted = True, self.session.stop_flags()[1]
                        log.warning("stopped at step %d on a signal while waiting for data; nothing new to save, "
                                    "continue with --resume auto", self.step)
                        break
                    if result.skipped == STORAGE_FAILED:
                        self._stop_on_storage_failure(batches, *step_start, stop=result.stop)
                    elif result.norms is not None:
                        hooks.after_step(self.step, stopping=result.stop)
                    if result.stop:
                        if result.skipped != STORAGE_FAILED:
                            self.save()
                        preempted, interrupted = True, result.interrupted
                        log.warning("stopped at step %d on a signal; continue with --resume auto", self.step)
                        break
                finished = not preempted
            finally:
                hooks.end(self.step, finished)  # the last checkpoint, the plots; closes the metrics file
        return TrainResult(step=self.step, preempted=preempted, run_dir=self.run_dir, interrupted=interrupted)


def _bar_values(end: StepEnd) -> dict | None:
    """The progress bar's figures, from the step's log line (if it has one)."""
    line = end.lines[0]
    return {k: f"{line[k]:.3g}" for k in ("gen_loss", "disc_loss", "rtd_f1", "tokens_per_s") if k in line} or None


class StepBatches:
    """The loader's micro-batches, turned into stand-ins when storage fails for good mid-run.

    A rank whose reads fail cannot simply raise: the other ranks would wait for it in the step's
    collectives. It keeps repeating its last micro-batch instead, and reports `held()` in the step's
    agreement, so every rank skips that update, saves and stops (`Trainer._stop_on_storage_failure`).
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
