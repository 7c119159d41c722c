"""A command's progress over its trainings: how many optimizer steps each takes, and the log line that
starts each one with the time the rest will take."""

from __future__ import annotations

import logging
import math
import time

from megakd.engine.hooks import clock_text
from megakd.finetune.config import FinetuneSettings
from megakd.finetune.lr_select import held_out_count

log = logging.getLogger(__name__)


def training_steps(train_examples: int, f: FinetuneSettings) -> int:
    """The optimizer steps of one training on `train_examples`: `finetune.epochs` epochs of global batches."""
    return math.ceil(train_examples / f.batch_size) * f.epochs


def planned_steps(train_examples: int, f: FinetuneSettings, candidates: int) -> list[int]:
    """The optimizer steps of each training `run_seeds` runs, in its order: with several LR candidates a
    trial of each on the fit rows (`selection_rows`), then every seed on the whole train split."""
    trials = []
    if candidates > 1:
        fit = train_examples - held_out_count(train_examples, f.lr_select_frac)
        trials = [training_steps(fit, f)] * candidates
    return trials + [training_steps(train_examples, f)] * len(f.seeds)


class Trainings:
    """A command's trainings (LR trials and seeds; under `megakd glue` every task's), planned as the
    optimizer steps of each (`planned_steps`). Each start is a log line: which run of how many, and the
    time the rest will take at the seconds per step of the runs before it in this process (wall time
    from one start to the next, so evaluations and the work between runs are in it)."""

    def __init__(self, steps: list[int]) -> None:
        self.count, self.left = len(steps), sum(steps)  # runs planned; the steps of those not started
        self.started = 0
        self.where = ""  # where the runs are in a larger plan (GLUE: "task 2 of 9"), said in each line
        self.seconds, self.trained = 0.0, 0  # time and steps of the runs this process finished
        self._current: tuple[float, int] | None = None  # (start, steps to train) of the run in progress

    def reused(self, *steps: int) -> None:
        """Trainings that finished before this process (`--resume auto`): counted, not timed."""
        self.started += len(steps)
        self.left -= sum(steps)

    def start(self, label: str, steps: int, done: int = 0) -> None:
        """The training `label` of `steps` steps starts, `done` of them trained before (a resume)."""
        now = time.perf_counter()
        if self._current is not None:
            self.seconds += now - self._current[0]
            self.trained += self._current[1]
        self.started += 1
        ahead = self.left - done
        self.left -= steps
        self._current = (now, steps - done)
        where = f" ({self.where})" if self.where else ""
        resumed = f" (resumed at step {done})" if done else ""
        if self.trained:
            rate = self.seconds / self.trained
            estimate = (f"about {clock_text(ahead * rate)} for it and the {self.count - self.started} after it "
                        f"({rate:.3g} s per step so far)")
        else:
            estimate = "the time left is estimated from the end of the first run on"
        log.info("%s: run %d of %d%s, %d steps%s; %s", label, self.started, self.count, where, steps - done, resumed,
                 estimate)
