"""The pretraining loop: steps, metrics, checkpoints, resume and signals, for any layout on any backend.

One optimizer step is one `backend.train_step(layout, batches, step)` call: `accumulation_steps`
micro-batches per rank, run as the training layout (`megakd.engine.layouts`) says. The trainer
knows no unit names or statistic names: it sums what a step returns and asks the layout for
metrics.
"""

from __future__ import annotations

import contextlib
import logging
import random
import signal
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megakd.config import Config, config_to_dict, read_yaml_file, save_config
from megakd.data.storage import StorageError as DataStorageError
from megakd.data.stream import STOP_SIGNALS
from megakd.data.tokenizer import copy_tokenizer
from megakd.engine.backends import STORAGE_FAILED, StepResult, TrainingBackend, stat_sums
from megakd.engine.layouts import Layout
from megakd.engine.probe import Probe
from megakd.engine.runlog import MetricsWriter, plot_metrics
from megakd.engine.units import StepContext, Unit, never
from megakd.engine.validation import Validator
from megakd.errors import UserError
from megakd.store import checkpoint, rundir
from megakd.store.files import StoreError, first_line, human_bytes, is_disk_full, tree_bytes

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    step: int
    preempted: bool  # stopped on a signal, after writing a checkpoint
    run_dir: Path
    interrupted: bool = False  # the signal was SIGINT on some rank (the command exits 130, not 0)
    # With `train(keep_lock=True)`: the run directory's lock, still held on rank 0 for the command's
    # end-of-run export; the caller releases it.
    lock: rundir.RunDirLock | None = None


class TooManyBadSteps(UserError):
    """`train.max_bad_steps` non-finite steps in a row: the run stops, its last checkpoint intact."""


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
        self._lock = rundir.RunDirLock(self.run_dir)
        # Holds the lock (on rank 0) from a successful `open_run` until `train` ends or `close`.
        self._holding_run_dir = contextlib.ExitStack()
        self._saved_config: dict = {}  # the resumed checkpoint's config, kept in config_history/ if it changed
        self._config_changes: dict = {}
        self._opened = False
        self._stop_signal: int | None = None  # the first stop signal received, if any
        self._metrics: MetricsWriter | None = None  # rank 0's, while `_train` runs (its `failure` stops the run)
        self._probe: Probe | None = None  # built at the first probe step (loading and tokenizing the task)

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
        """Every random stream of this rank (host-side copies: no device sync)."""
        return {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "sampling": self.rng.get_state(),
            "python": random.getstate(),
            # numpy's state holds an ndarray, which a weights-only load refuses: store it as a tensor
            "numpy": _numpy_state_to_plain(np.random.get_state()),
        }

    def load_rank_state(self, state: dict) -> None:
        self.step = state["step"]
        self.bad_steps = state["bad_steps"]
        self.interval.clear()
        self.interval.update({k: v.to(self.backend.device) for k, v in state["interval"].items()})
        self.loader.load_state_dict(state["data"])
        self._set_rng_state(state["rng"])

    def _set_rng_state(self, rng: dict) -> None:
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.rng.set_state(rng["sampling"])
        random.setstate(rng["python"])
        np.random.set_state(_numpy_state_from_plain(rng["numpy"]))

    def save(self) -> Path:
        """Write a checkpoint on every rank and publish it atomically; a failed save leaves no trace.

        Every rank reaches the same collectives whether or not its own writes failed, so a full
        disk on one rank ends every rank with an error instead of a hang.
        """
        self._stop_if_metrics_failed()
        main = self.backend.is_main
        error: BaseException | None = None
        tmp, final = checkpoint.temp_dir(self.run_dir, self.step), None
        try:
            tmp, final = checkpoint.begin(self.run_dir, self.step, main)  # checks run-dir ownership on rank 0
        except (OSError, StoreError) as err:
            error = err
        self.backend.barrier()
        if error is None:
            try:
                if main:
                    save_config(self.cfg, tmp / "config.yaml")
                    # A checkpoint is self-contained: conversion and resumption need no external paths.
                    copy_tokenizer(self.tokenizer_dir, tmp / "tokenizer")
                self.backend.save_units(list(self.units.values()), tmp)
                checkpoint.save_rank_state(tmp, self.backend.rank, self.rank_state())
            except (OSError, RuntimeError) as err:
                error = err
        self._agree_or_abort(error, tmp)
        if main:
            try:
                checkpoint.commit(tmp, final, self.step, self.cfg.run.keep_last)  # checks run-dir ownership
            except (OSError, RuntimeError, StoreError) as err:
                error = err
        self._agree_or_abort(error, tmp)
        return final

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

    def _agree_or_abort(self, error: BaseException | None, tmp: Path) -> None:
        """All ranks learn whether any rank failed; then rank 0 removes the temp dir and all raise."""
        failed = self.backend.all_reduce_sum(torch.tensor(float(error is not None))).item() > 0
        if not failed:
            return
        written = tree_bytes(tmp) if tmp.is_dir() else 0
        self.backend.barrier()  # every rank has measured the partial checkpoint before it goes
        if self.backend.is_main:
            checkpoint.abort(tmp)
            # A lost run directory explains any failure (another job may have removed the temp dir).
            taken = error if isinstance(error, rundir.RunDirTakenOver) else self._lock.ownership_error()
            if taken is not None:
                raise taken from None
        if error is None:
            raise StoreError(f"{tmp.parent}: saving step {self.step} failed on another rank; the partial checkpoint "
                             "was removed, older checkpoints are intact")
        previous = checkpoint.latest_checkpoint(self.run_dir)
        needed = f", about {human_bytes(tree_bytes(previous))} needed" if previous is not None else ""
        what = "no space left on device" if is_disk_full(error) else first_line(error)
        raise StoreError(f"{tmp.parent}: {what} while saving step {self.step} ({human_bytes(written)} written"
                         f"{needed}); the partial checkpoint was removed, older checkpoints are intact") from None

    # -- owning the run directory, resuming --------------------------------------------------------
    def open_run(self, resume: str | None, allow_change: tuple[str, ...] = ()) -> None:
        """Own run.dir, then resume from a verified checkpoint if asked.

        `resume`: None = a new run (run.dir must be unused, or run.overwrite moves it aside);
        "auto" = the newest intact checkpoint in run.dir (a damaged newer one is reported and
        skipped), or step 0 if there is none; a path = that checkpoint, which must verify (one
        from another run directory starts run.dir as a new run, so run.dir must be unused).
        """
        with contextlib.ExitStack() as holding:  # releases the lock if opening fails anywhere below
            self._open_run(resume, allow_change, holding)
            self._holding_run_dir = holding.pop_all()
        if self.backend.is_main:
            self._lock.announce()

    def _open_run(self, resume: str | None, allow_change: tuple[str, ...], holding: contextlib.ExitStack) -> None:
        main = self.backend.is_main
        error: BaseException | None = None
        chosen = -1  # step of the checkpoint to resume from, decided on rank 0
        if main:
            try:
                holding.enter_context(self._lock)
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
                    chosen = checkpoint.step_of(found) if found is not None else -1
                elif resume is not None:
                    checkpoint.verify(self._explicit_checkpoint(resume))
            except (StoreError, OSError) as err:
                error = err
        flags = torch.tensor([float(error is not None), float(chosen + 1 if main else 0)], dtype=torch.float64)
        failed, chosen_plus_one = self.backend.all_reduce_sum(flags).tolist()
        if failed:
            raise error if error is not None else StoreError(f"{self.run_dir}: refused on rank 0 (see its message)")
        self._opened = True
        if resume is None:
            return
        if resume == "auto":
            if chosen_plus_one == 0:
                log.info("no checkpoint in %s: starting from step 0", self.run_dir)
                return
            path = checkpoint.step_dir(self.run_dir, int(chosen_plus_one) - 1)
        else:
            path = self._explicit_checkpoint(resume)
        self._resume_from(path, allow_change)

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
        self._holding_run_dir.close()
        self.backend.close()

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
            seed = self.cfg.train.seed * 1_000_003 + b.rank + 104_729 * mine["step"]
            torch.manual_seed(seed)
            self.rng.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed % 2**32)
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
            self.bad_steps = 0
            self.step += 1
        return result

    def _stop_on_storage_failure(self, batches: StepBatches, data: dict, rng: dict) -> None:
        """Some rank's storage failed for good during a step that every rank then skipped: save the
        run exactly as it was before that step (data position and random streams rewound on every
        rank; the skipped step changed nothing else), so a resume continues bit-exactly, and stop
        with the failing rank's one-line error."""
        self.loader.load_state_dict(data)
        self._set_rng_state(rng)
        path = self.save()
        log.warning("storage failed at step %d: saved %s; resume with --resume auto once it is back", self.step + 1,
                    path)
        if batches.failure is not None:
            raise batches.failure
        raise DataStorageError(f"step {self.step + 1}: another rank's storage failed (see its message); the run was "
                           f"saved at step {self.step}")

    def _skipped(self, what: str) -> None:
        """Count a skipped update; `train.max_bad_steps` of them in a row stop the run unsaved."""
        self.bad_steps += 1
        log.warning("%s at step %d: update skipped (%d in a row)", what, self.step + 1, self.bad_steps)
        if self.bad_steps >= self.cfg.train.max_bad_steps:
            raise TooManyBadSteps(
                f"train.max_bad_steps={self.cfg.train.max_bad_steps}: {self.bad_steps} steps in a row had a "
                f"non-finite loss or gradient norm (last: {what}); stopped at step {self.step} without saving, "
                f"the checkpoints in {self.run_dir / 'checkpoints'} are untouched"
            )

    # -- metrics ---------------------------------------------------------------------------------
    def _record(self, norms_sum: dict[str, float], steps: int, seconds: float) -> dict:
        names = sorted(self.interval)
        # The loaders' retry counts (cumulative, per rank) ride on the same all-reduce: the job's total.
        retries = torch.tensor([float(self.loader.read_retries)], dtype=torch.float64).to(self.backend.device)
        totals = self.backend.all_reduce_sum(torch.cat([torch.stack([self.interval[k] for k in names]), retries]))
        totals = totals.cpu().tolist()
        s = dict(zip(names, totals))
        rec: dict = {"step": self.step, **self.layout.ratios(s), "read_retries": int(totals[-1])}
        rec.update(self.layout.optimizer_metrics({k: v / max(1, steps) for k, v in norms_sum.items()}))
        rec["tokens_per_s"] = s.get("tokens", 0.0) / max(seconds, 1e-9)
        self.interval.clear()
        return rec

    # -- the loop ----------------------------------------------------------------------------------
    def _on_signal(self, signum, _frame) -> None:
        if signum == signal.SIGINT and self._stop_signal == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: abort now, without a checkpoint
        name = signal.Signals(signum).name
        if self._stop_signal is None:
            log.warning("received %s: will save a checkpoint and stop after this step%s", name,
                        " (a second SIGINT aborts at once)" if signum == signal.SIGINT else "")
            self._stop_signal = signum
        elif signum == signal.SIGINT:
            self._stop_signal = signum  # already stopping; the next SIGINT aborts

    def _local_stop_flags(self) -> tuple[bool, bool]:
        """(stop requested, a SIGINT was among the signals) on this rank.

        A signal may reach one rank only (or one rank first); each step's agreement all-reduce
        makes every rank stop after the same step, so the checkpoint holds one consistent step.
        """
        metrics_failed = self._metrics is not None and self._metrics.failure is not None
        return self._stop_signal is not None or metrics_failed, self._stop_signal == signal.SIGINT

    def train(self, keep_lock: bool = False) -> TrainResult:
        """Train to train.max_steps (a new run unless `open_run` resumed one); the run dir is locked until the end.

        With `keep_lock`, a run that returns keeps the lock in `result.lock` (rank 0), so the command's
        end-of-run export is written under it; the caller releases it.
        """
        if not self._opened:
            self.open_run(None)
        with self._holding_run_dir:
            result = self._train()
            if keep_lock:
                self._holding_run_dir.pop_all()  # not released on leaving: handed to the caller
                result.lock = self._lock
            return result

    def _train(self) -> TrainResult:
        cfg = self.cfg
        writer = None
        if self.backend.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if self._config_changes:
                rundir.record_history(self.run_dir, self._saved_config, self.step)
            save_config(cfg, self.run_dir / "config.yaml")
            writer = self._metrics = MetricsWriter(
                self.run_dir, tensorboard=cfg.run.tensorboard, wandb=cfg.run.wandb,
                wandb_project=cfg.run.wandb_project, wandb_mode=cfg.run.wandb_mode,
                config=config_to_dict(cfg), resume_step=self.step,
            )
        previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        bar = None
        if self.backend.is_main and cfg.run.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=cfg.train.max_steps, initial=self.step, unit="step", dynamic_ncols=True)
        preempted = interrupted = False
        last_saved = self.step
        try:
            self.layout.train()
            batches = StepBatches(iter(self.loader), can_hold=self.backend.holds_steps)
            norms_sum: dict[str, float] = defaultdict(float)
            steps_in_interval, t0 = 0, time.perf_counter()
            while self.step < cfg.train.max_steps:
                step_start = self.loader.state_dict(), self._rng_state()
                result = self._step(batches)
                if result.skipped == STORAGE_FAILED:
                    self._stop_on_storage_failure(batches, *step_start)
                norms, stop, interrupted = result.norms, result.stop, result.interrupted
                if norms is not None:
                    for k, v in norms.items():
                        norms_sum[k] += v
                    steps_in_interval += 1
                    if bar is not None:
                        bar.update(1)
                    rec = {}
                    if self.step % cfg.train.log_every == 0 or self.step == cfg.train.max_steps:
                        rec = self._record(norms_sum, steps_in_interval, time.perf_counter() - t0)
                        if bar is not None:
                            bar.set_postfix({k: f"{rec[k]:.3g}" for k in ("gen_loss", "disc_loss", "rtd_f1",
                                                                             "tokens_per_s") if k in rec})
                        norms_sum.clear()
                        steps_in_interval, t0 = 0, time.perf_counter()
                    if self.validator is not None and self.step % cfg.train.eval_every == 0:
                        started = time.perf_counter()
                        rec = {**rec, "step": self.step, **self.validator.evaluate(self.step)}
                        t0 += time.perf_counter() - started  # tokens_per_s counts training time only
                    if rec and writer is not None:
                        writer.write(rec)
                    if cfg.train.probe_every and self.step % cfg.train.probe_every == 0:
                        probe_start = time.perf_counter()
                        rec = self.run_probe()
                        if rec is not None:
                            log.info("step %d: probe_acc %.4f (%.1f s)", self.step, rec["probe_acc"],
                                     rec["probe_seconds"])
                            writer.write(rec)
                        t0 += time.perf_counter() - probe_start  # tokens_per_s measures training only
                if stop:
                    self.save()
                    preempted = True
                    log.warning("stopped at step %d on a signal; continue with --resume auto", self.step)
                    break
                if norms is not None and cfg.train.save_every and self.step % cfg.train.save_every == 0:
                    self.save()
                    last_saved = self.step
            if not preempted and last_saved != self.step:
                self.save()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if bar is not None:
                bar.close()
            if writer is not None:
                writer.close()
        if self.backend.is_main and cfg.run.plots and not preempted:
            plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "plots")
        return TrainResult(step=self.step, preempted=preempted, run_dir=self.run_dir, interrupted=interrupted)


class StepBatches:
    """The loader's micro-batches, turned into stand-ins when storage fails for good mid-run.

    A rank whose reads fail cannot simply raise: the other ranks would wait for it in the step's
    collectives. It keeps repeating its last micro-batch instead, and reports `held()` in the step's
    agreement, so every rank skips that update, saves and stops (`Trainer._stop_on_storage_failure`).
    Without a previous batch, or under a backend that cannot skip an update, the error is raised.
    """

    def __init__(self, batches, can_hold: bool):
        self.batches = batches
        self.can_hold = can_hold
        self.last: dict | None = None
        self.failure: DataStorageError | None = None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.failure is None:
            try:
                self.last = next(self.batches)
                return self.last
            except DataStorageError as error:
                if self.last is None or not self.can_hold:
                    raise
                log.error("%s", error)
                self.failure = error
        return self.last

    def held(self) -> bool:
        return self.failure is not None


def _numpy_state_to_plain(state: tuple) -> tuple:
    name, keys, pos, has_gauss, cached = state
    return name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)


def _numpy_state_from_plain(state: tuple) -> tuple:
    name, keys, pos, has_gauss, cached = state
    return name, keys.numpy().astype(np.uint32), pos, has_gauss, cached


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
