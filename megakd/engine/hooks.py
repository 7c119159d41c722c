"""Hooks: the work a training loop does after a step and when it ends, registered instead of inlined.

The training loop (`megakd.engine.loop.TrainingLoop`) is a step, then `Hooks.after_step`, until the
last step or a stop, then `Hooks.end`. The log line, validation, the probe, the epoch's evaluation,
the metrics file, the progress bar, checkpoint cadence and plots are hooks, so adding periodic work
(a new evaluation, a logger) is one `add` and no change to the loop. docs/architecture.md § The
training loop shows the order the loop registers them in.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger(__name__)


@dataclass
class StepEnd:
    """What hooks see after a step: its number, its metrics.jsonl lines so far, whether the run stops."""

    step: int
    # lines[0] is the step's log line ({} until a hook fills it); hooks may join it or append lines
    lines: list[dict]
    stopping: bool = False  # all ranks agreed to stop: the loop checkpoints and leaves after the hooks
    values: dict | None = None  # this rank's statistics of the step, on its device (None: update skipped)


class Hook:
    """One piece of run-wide work; a subclass overrides what it needs. Hooks run on every rank (they
    may use collectives), in the order they were added."""

    def start(self, step: int) -> None:
        """Once, before the loop's first step (`step`: the one the run continues from), with run.dir the run's."""

    def after_step(self, end: StepEnd) -> None:
        """After a step the loop counted."""

    def end(self, step: int, finished: bool) -> None:
        """Once, when the loop is left: `finished` if it reached its last step (no stop, no error)."""


@dataclass
class StepHook(Hook):
    """Every `period` steps (0: never; also at step `also_at`) `run(step)` gives values for metrics.jsonl
    (None: nothing), joined to the step's log line or, with `own_line`, written as a line of their own."""

    period: int
    run: Callable[[int], dict | None]
    own_line: bool = False
    also_at: int | None = None

    def due(self, step: int) -> bool:
        return (self.period > 0 and step % self.period == 0) or step == self.also_at

    def after_step(self, end: StepEnd) -> None:
        values = self.run(end.step) if self.due(end.step) else None
        if values is not None and self.own_line:
            end.lines.append({"step": end.step, **values})
        elif values is not None:
            end.lines[0] = {**end.lines[0], "step": end.step, **values}


class Hooks:
    """A loop's hooks, and the seconds spent in them (throughput counts training time only, `Clock`)."""

    def __init__(self) -> None:
        self._hooks: list[Hook] = []
        self.seconds = 0.0

    def add(self, hook: Hook | None) -> None:
        """Run `hook` after the ones already added (None: nothing to add, e.g. rank 0's writer elsewhere)."""
        if hook is not None:
            self._hooks.append(hook)

    def start(self, step: int) -> None:
        """Every hook's `start` (a job's hook need not subclass `Hook`: one without `start` is skipped)."""
        for hook in self._hooks:
            start = getattr(hook, "start", None)
            if start is not None:
                start(step)

    def after_step(self, step: int, stopping: bool = False, values: dict | None = None) -> None:
        """Run every hook for `step` (the metrics file among them writes the lines the others made)."""
        started = time.perf_counter()
        end = StepEnd(step, [{}], stopping, values)
        try:
            for hook in self._hooks:
                hook.after_step(end)
        finally:
            self.seconds += time.perf_counter() - started

    def end(self, step: int, finished: bool) -> None:
        """Every hook's `end`, even after one fails (the first error is raised; later hooks then see
        `finished=False`, so nothing builds on a failed final save)."""
        error: BaseException | None = None
        for hook in self._hooks:
            try:
                hook.end(step, finished and error is None)
            except BaseException as err:
                error = error or err
        if error is not None:
            raise error


class Clock:
    """Seconds of training between log lines: wall time minus the time spent in hooks."""

    def __init__(self, hooks: Hooks) -> None:
        self.hooks = hooks
        self._start, self._in_hooks = time.perf_counter(), hooks.seconds

    def lap(self) -> float:
        """Training seconds since the previous lap (or since the clock was made); starts the next one."""
        now, in_hooks = time.perf_counter(), self.hooks.seconds
        seconds = (now - self._start) - (in_hooks - self._in_hooks)
        self._start, self._in_hooks = now, in_hooks
        return seconds


class ProgressBar(Hook):
    """Rank 0's progress (`enabled`): steps, rate, time left and `postfix(end)`'s figures (None: none new).

    On a terminal, a tqdm bar. Anywhere else (stderr to a file: `2> log`, a Slurm `--output`) every redraw
    of a bar would land in the file, carriage returns on one ever-growing line, so a step with figures
    (the job's `bar_values` has them at each log line: every `log_every` steps and the last) gets a plain
    log line instead, and the others nothing."""

    def __init__(self, total: int, initial: int, postfix: Callable[[StepEnd], dict | None], *, enabled: bool,
                 desc: str | None = None) -> None:
        self.postfix, self.total, self.desc = postfix, total, desc
        self.plain = enabled and not sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=initial, unit="step", desc=desc, dynamic_ncols=True,
                        disable=not enabled or self.plain)
        self._start = (time.perf_counter(), initial)

    def after_step(self, end: StepEnd) -> None:
        values = self.postfix(end)
        if self.plain:
            if values:
                log.info("%s", self.line(end.step, values))
            return
        self.bar.update(1)
        if values:
            self.bar.set_postfix(values)

    def line(self, step: int, values: dict) -> str:
        """`[desc: ]step k/n (p%), rate, ETA h:mm:ss: figures`; the rate is the mean since this process's
        first step here, hooks included, so the time left counts the evaluations still to come."""
        began, first = self._start
        rate = (step - first) / max(time.perf_counter() - began, 1e-9)
        speed = f"{rate:.3g} steps/s" if rate >= 1 else f"{1 / rate:.3g} s/step"
        figures = ", ".join(f"{k} {v}" for k, v in values.items())
        return (f"{f'{self.desc}: ' if self.desc else ''}step {step}/{self.total} ({100 * step // self.total}%), "
                f"{speed}, ETA {clock_text((self.total - step) / rate)}: {figures}")

    def end(self, step: int, finished: bool) -> None:
        self.bar.close()


def clock_text(seconds: float) -> str:
    """`h:mm:ss`, for a time left in a log line."""
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


class Checkpoints(Hook):
    """Checkpoint cadence: `save()` after the steps `due(step)` names and, with `at_end`, after the last
    step unless that one was just saved. Not when stopping: the loop saves that step itself, once."""

    def __init__(self, save: Callable[[], Path], due: Callable[[int], bool], *, at_end: bool,
                 last_saved: int) -> None:
        self.save, self.due, self.at_end, self.last_saved = save, due, at_end, last_saved

    def after_step(self, end: StepEnd) -> None:
        if not end.stopping and self.due(end.step):
            self.save()
            self.last_saved = end.step

    def end(self, step: int, finished: bool) -> None:
        if finished and self.at_end and self.last_saved != step:
            self.save()
            self.last_saved = step


class AtEnd(Hook):
    """`run()` once, after a run that finished (e.g. the plots of metrics.jsonl)."""

    def __init__(self, run: Callable[[], object]) -> None:
        self.run = run

    def end(self, step: int, finished: bool) -> None:
        if finished:
            self.run()
