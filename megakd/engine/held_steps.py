"""Held steps: how a rank whose shard storage fails mid-run (or whose wait for data a stop signal ends)
keeps every rank in step instead of leaving them waiting in a collective.

The pieces, in the order a step meets them:
- the step source (`LoaderSteps`, over `StepBatches`) repeats the rank's last micro-batch instead of
  raising, and reports the step as held (`StepInput.held`);
- the backend's one agreement all-reduce per step carries the held flag (`StepContext.held`), so
  every rank skips that update (`StepResult.skipped == STORAGE_FAILED`); only a backend whose
  `holds_steps` is true can skip an update on every rank (DeepSpeed's fp16/ZeRO paths cannot);
- the loop (`megakd.engine.loop`) rewinds the data position and random streams to where the step
  began and saves, so `--resume auto` repeats the step bit-exactly; `end_held_step` then stops with
  the failing rank's one-line error, or as a preemption when a stop signal ended the wait;
- a stop signal while a rank waits for data ends the wait at once (`RunSession.waiting_for_data`,
  or `PretrainingLoader.stop_waiting` for loaders with worker processes).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

from megakd.data.loader import StoppedWaitingForData
from megakd.data.storage import StorageError as DataStorageError
from megakd.engine.backends import TrainingBackend
from megakd.engine.session import RunSession
from megakd.engine.units import StepInput

log = logging.getLogger(__name__)


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


def end_held_step(failure: DataStorageError | None, saved: Path, step: int, stop: bool) -> None:
    """After every rank skipped a held step and the run was saved as it was before it (`saved`, at `step`):
    stop with this rank's storage error, or, where no rank of this one's failed and a stop was asked for
    (`stop`: a stop signal ended a wait for data), return as a preemption does; otherwise another rank's
    storage failed."""
    if failure is not None:
        log.warning("storage failed at step %d: saved %s; resume with --resume auto once it is back", step + 1, saved)
        raise failure
    if stop:
        return
    raise DataStorageError(f"step {step + 1}: another rank's storage failed (see its message); the run was saved at "
                           f"step {step}")
