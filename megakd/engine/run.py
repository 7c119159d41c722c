"""The run shell: how every training command (pretraining, DWT, fine-tuning, GLUE, the findings' jobs)
owns its run directory, decides its resume and reports how it ended.

`run_job(job)` is the one entry, in this order:

1. the job's config is finished when the job is made (every `auto` resolved) and not changed after;
2. `job.build_backend()` joins the launch;
3. `Run.open`: rank 0 locks run.dir and decides, once and before anything is built, what this command
   continues: nothing (a new run claims an unused run.dir, or moves a used one aside under
   `run.overwrite`), the newest intact checkpoint (`--resume auto`), or a named one (`--resume PATH`);
   the config it was made with is compared with this one under one rule (`ResumePolicy`);
4. `job.prepare(run)` builds what the job trains, knowing the decision (a resumed run reads no
   `init.*` and profiles nothing), and loads the checkpoint;
5. `Run.start`: only now the run directory is announced and `config.yaml` written, so a refused
   start leaves run.dir byte-identical; stop signals are caught from here on;
6. `job.train(run)` trains; a stop signal ends it with `Stopped` after a checkpoint, which the shell
   returns as `Outcome.stopped`: one way for every job to report a stop.

A job whose trainings keep their own checkpoints (fine-tuning: one per seed and per LR trial) asks the
run for each one's resume point with `Run.newest_checkpoint`, the same lookup the shell uses.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from megakd.configio import config_to_dict, read_yaml_file, save_config, upgrade_saved
from megakd.engine.backends import TrainingBackend
from megakd.engine.session import RunSession
from megakd.errors import UserError
from megakd.kernels import head_backward
from megakd.store import checkpoint, rundir
from megakd.store.files import StoreError

log = logging.getLogger(__name__)


class Stopped(Exception):
    """A stop signal arrived; the training in progress saved a checkpoint (`--resume auto` continues)."""

    def __init__(self, step: int | None, interrupted: bool):
        super().__init__("stopped on a signal")
        self.step = step
        self.interrupted = interrupted  # SIGINT (the command exits 130) rather than SIGTERM/SIGUSR1 (exit 0)


@dataclass
class Outcome:
    """How a job ended: finished (its summary) or stopped after a checkpoint."""

    summary: dict = field(default_factory=dict)
    step: int | None = None  # the last step (pretraining; fine-tuning runs many trainings)
    stopped: bool = False
    interrupted: bool = False  # stopped by SIGINT: the command exits 130, not 0
    exported: Path | None = None  # the end-of-run export, where one was asked for and published (rank 0)
    export_stopped_by: int | None = None  # the signal that stopped the export (nothing was exported)


@dataclass(frozen=True)
class ResumePolicy:
    """What may differ between the config a run was made with and the one resuming it.

    Steering keys (`rundir.STEERING`, plus the job's `steering`) may change freely. Other keys
    change the saved state: a job that can make a change take effect (pretraining: `optim.*` on the
    loaded optimizer) accepts the ones `--allow-change` names; a job whose finished parts were made
    with the saved values (fine-tuning's seeds) refuses them all, saying `why`.
    """

    steering: tuple[str, ...] = ()
    changeable: bool = True
    why: str = ""

    def check(self, where: Path, saved: dict, current: dict, allowed: tuple[str, ...]) -> dict:
        """The changes from `saved` to `current` this policy allows (`allowed`: the keys named); one line
        otherwise."""
        if allowed and not self.changeable:
            raise UserError(f"--allow-change {allowed[0]}: {self.why}")
        return rundir.check_changes(where, saved, current, allowed, steering=self.steering,
                                    fixed=None if self.changeable else self.why)


@dataclass(frozen=True)
class Resume:
    """The decision `Run.open` made: what this command continues."""

    requested: str | None = None  # None (a new run), "auto" or a checkpoint path, as asked
    checkpoint: Path | None = None  # the run-level checkpoint to load (None: the job starts at step 0)
    saved: dict | None = None  # the config the continued run (or its checkpoint) was made with
    changes: dict = field(default_factory=dict)  # {key: (old, new)} of the allowed changes


class Job(Protocol):
    """What a command trains, inside the shell (see the module docstring for the order of the calls)."""

    cfg: Any  # the finished config tree: `run`, `backend` and `kernels` sections at least
    policy: ResumePolicy
    # The job checkpoints the run as a whole (`--resume auto` continues the newest, `--resume PATH` a named
    # one); False where its trainings keep their own (`Run.newest_checkpoint`).
    run_checkpoints: bool

    def build_backend(self) -> TrainingBackend: ...

    def prepare(self, run: Run) -> None:
        """Build everything the job trains and load `run.resume.checkpoint`; write nothing into run.dir."""

    def train(self, run: Run) -> Outcome:
        """Train to the end; raise `Stopped` after the checkpoint of a stop signal."""

    def close(self) -> None:
        """Let go of what `prepare` started (loaders, read-ahead), however the run ended."""


class Run:
    """One command's run directory (lock, claim, resume decision, config.yaml), stop signals and backend."""

    def __init__(self, job: Job, backend: TrainingBackend, resume: str | None = None,
                 allow_change: tuple[str, ...] = ()):
        self.job = job
        self.backend = backend
        self.dir = Path(job.cfg.run.dir)
        self.session = RunSession(self.dir, backend)  # the lock, stop signals, the all-ranks save
        self.requested = resume
        self.allow_change = tuple(allow_change)
        self.resume = Resume()
        self._signals = contextlib.ExitStack()  # the session's stop-signal handlers, from `start` to `close`
        self._fresh = False  # this command wrote config.yaml into an unused run.dir (see `close`)

    @property
    def is_main(self) -> bool:
        return self.backend.is_main

    # -- deciding ----------------------------------------------------------------------------------
    def open(self) -> Resume:
        """Own run.dir and decide what this command continues (rank 0 decides under the lock; every rank
        learns the decision, or the refusal)."""
        if self.requested not in (None, "auto") and not self.job.run_checkpoints:
            raise UserError(f"--resume {self.requested}: this command resumes with --resume auto (each training "
                            "continues from its newest intact checkpoint in run.dir)")
        step = self.session.own(self._decide)
        self.resume = self._resume_at(step)
        return self.resume

    def _decide(self) -> int | None:
        """Rank 0, under the lock: claim run.dir for a new run, or find and verify what to resume; the step
        of `--resume auto`'s checkpoint (None: there is none, or the job has no run-level checkpoints)."""
        requested = self.requested
        if requested is None or self._elsewhere(requested):
            aside = rundir.claim_for_new_run(self.dir, self.job.cfg.run.overwrite)
            if aside is not None:
                log.warning("run.overwrite: moved the old contents of %s to %s", self.dir, aside)
        if requested == "auto":
            found = _newest_intact(self.dir) if self.job.run_checkpoints else None
            if found is None:
                rundir.check_is_a_run(self.dir, self.session.lock)
            return found
        if requested is not None:
            checkpoint.remove_stale_temp_dirs(self.dir)
            checkpoint.verify(_checkpoint_dir(requested))
        return None

    def _elsewhere(self, requested: str) -> bool:
        """`--resume PATH` with a checkpoint from another run directory starts run.dir afresh (so it must be
        unused)."""
        return requested != "auto" and not Path(requested).resolve().is_relative_to(self.dir.resolve())

    def _resume_at(self, step: int | None) -> Resume:
        """Every rank: the decision, with the saved config it continues and the changes the policy allows."""
        if self.requested is None:
            return Resume()
        if self.requested == "auto":
            found = checkpoint.step_dir(self.dir, step) if step is not None else None
            if found is None:
                log.info("no checkpoint in %s: starting from step 0", self.dir)
        else:
            found = _checkpoint_dir(self.requested)
        saved_file = found / "config.yaml" if found is not None else self.dir / "config.yaml"
        if found is None and not saved_file.is_file():
            return Resume(self.requested)
        if not saved_file.is_file():
            raise StoreError(f"{saved_file}: missing ({found} is not a complete megakd checkpoint)")
        saved = read_yaml_file(saved_file)
        if not isinstance(saved, dict):
            raise StoreError(f"{saved_file}: expected a mapping of config sections, got {type(saved).__name__}")
        # an older megakd's config as today's tree reads it (renamed keys, keys added since at their defaults)
        changes = self.job.policy.check(found or saved_file, upgrade_saved(type(self.job.cfg), saved),
                                        config_to_dict(self.job.cfg), self.allow_change)
        return Resume(self.requested, found, saved, changes)

    def newest_checkpoint(self, root: Path) -> Path | None:
        """Under `--resume auto`, the newest intact checkpoint of a training that keeps its own under `root`
        (rank 0 looks, every rank gets the answer); None otherwise or if there is none."""
        step = None
        if self.requested == "auto" and self.is_main:
            step = _newest_intact(root)
        step = self.session.share(step)
        return checkpoint.step_dir(root, step) if step is not None else None

    # -- running -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Nothing can refuse the run any more: rank 0 announces it in run.dir and writes config.yaml (the
        replaced one kept in config_history/ after a resume that changed keys); stop signals are caught
        from here until `close`."""
        self.session.announce()
        if self.is_main:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._fresh = not rundir.used_entries(self.dir)
            if self.resume.changes:
                rundir.record_history(self.dir, self.resume.saved, self.resume_step)
            save_config(self.job.cfg, self.dir / "config.yaml")
        self._signals.enter_context(self.session.stop_signals())

    @property
    def resume_step(self) -> int:
        return checkpoint.step_of(self.resume.checkpoint) if self.resume.checkpoint is not None else 0

    def close(self) -> None:
        self._signals.close()
        self._release_unused_run_dir()
        self.session.release()
        self.backend.close()

    def _release_unused_run_dir(self) -> None:
        """A new run that stopped before writing anything but its config.yaml (a task file refused, a model
        that does not fit, a traceback before its first step) leaves run.dir as it found it, so the
        corrected command starts there without run.overwrite. Only the config.yaml this command wrote into
        an unused run.dir is removed, under the lock; a run that wrote anything else keeps it all."""
        if not self._fresh:
            return
        self._fresh = False
        config = self.dir / "config.yaml"
        if rundir.used_entries(self.dir) == [config.name] and config.is_file() and not config.is_symlink():
            try:
                config.unlink()
            except OSError as err:  # never hide the error that ended the run
                log.warning("%s: could not remove config.yaml (%s)", self.dir, err)
                return
            log.info("%s: nothing was written but config.yaml; removed it, so run.dir is unused again", self.dir)


def _newest_intact(root: Path) -> int | None:
    """Rank 0: the step of the newest checkpoint under `root` that verifies (a damaged newer one is reported
    and skipped; half-written ones are removed); None if there is none, refused if every one is damaged."""
    checkpoint.remove_stale_temp_dirs(root)
    found = checkpoint.newest_intact(root)
    if found is None and checkpoint.list_checkpoints(root):
        raise StoreError(f"{checkpoint.checkpoints_root(root)}: no intact checkpoint to resume from (every one "
                         "failed verification; see the warnings above)")
    return checkpoint.step_of(found) if found is not None else None


def _checkpoint_dir(spec: str) -> Path:
    path = Path(spec)
    if not path.is_dir():
        raise FileNotFoundError(f"--resume {spec}: no checkpoint directory at {path}")
    return path


def start_job(job: Job, resume: str | None = None, allow_change: tuple[str, ...] = (),
              backend: TrainingBackend | None = None) -> Run:
    """The shell's steps before training (open, prepare, start), undone if one fails; the started run, for
    `run_job` and for callers that drive the training themselves (they end it with `end_job`)."""
    run = Run(job, backend or job.build_backend(), resume, allow_change)
    try:
        run.open()
        job.prepare(run)
        run.start()
    except BaseException:
        end_job(job, run)
        raise
    return run


def end_job(job: Job, run: Run) -> None:
    """Let go of the job's resources, then the run directory and the backend, however the job ended."""
    try:
        job.close()
    finally:
        run.close()


def run_job(job: Job, resume: str | None = None, allow_change: tuple[str, ...] = ()) -> Outcome:
    """Run `job` in the shell (the module docstring gives the order); how it ended."""
    with head_backward(job.cfg.kernels.head_backward):  # read by the fused head's loss (kernels/dispatch.py)
        run = start_job(job, resume, allow_change)
        try:
            return job.train(run)
        except Stopped as stop:
            return Outcome(step=stop.step, stopped=True, interrupted=stop.interrupted)
        finally:
            end_job(job, run)
