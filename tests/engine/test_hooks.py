"""The hook runner both training loops stand on (megakd/engine/hooks.py): order, lines, end, cadence, clock."""

from __future__ import annotations

import types

import pytest

from megakd.engine import hooks as hooks_module
from megakd.engine.hooks import AtEnd, Checkpoints, Clock, Hook, Hooks, StepHook


class Recorder(Hook):
    def __init__(self, name: str, seen: list, fail_at_end: bool = False):
        self.name, self.seen, self.fail_at_end = name, seen, fail_at_end

    def after_step(self, end):
        self.seen.append((self.name, end.step, [dict(line) for line in end.lines]))

    def end(self, step, finished):
        self.seen.append((self.name, "end", finished))
        if self.fail_at_end:
            raise OSError(f"{self.name} failed")


def test_step_hooks_join_the_log_line_or_write_their_own_in_order():
    seen: list = []
    hooks = Hooks()
    hooks.add(StepHook(2, lambda step: {"step": step, "loss": 1.0}, also_at=5))  # the log line
    hooks.add(StepHook(4, lambda step: {"val": step / 10}))
    hooks.add(StepHook(3, lambda step: {"probe": step}, own_line=True))
    hooks.add(StepHook(0, lambda step: {"never": 1}))
    hooks.add(None)  # e.g. the metrics file on a rank other than 0
    hooks.add(Recorder("writer", seen))
    for step in range(1, 7):
        hooks.after_step(step)
    # the writer runs after every hook added before it, and sees the step's lines as they end up
    lines = {step: [line for line in step_lines if line] for _, step, step_lines in seen}
    assert lines == {1: [], 2: [{"step": 2, "loss": 1.0}], 3: [{"step": 3, "probe": 3}],
                     4: [{"step": 4, "loss": 1.0, "val": 0.4}], 5: [{"step": 5, "loss": 1.0}],
                     6: [{"step": 6, "loss": 1.0}, {"step": 6, "probe": 6}]}


def test_every_end_runs_after_one_fails_and_later_ones_are_not_finished():
    seen: list = []
    hooks = Hooks()
    for hook in (Recorder("a", seen), Recorder("save", seen, fail_at_end=True), Recorder("plots", seen)):
        hooks.add(hook)
    with pytest.raises(OSError, match="save failed"):
        hooks.end(7, finished=True)
    assert seen == [("a", "end", True), ("save", "end", True), ("plots", "end", False)]


def test_checkpoint_cadence_leaves_a_stopping_step_to_the_loop_and_saves_the_last_once():
    saved: list[int] = []
    step = {"now": 0}
    cadence = Checkpoints(lambda: saved.append(step["now"]), lambda s: s % 2 == 0, at_end=True, last_saved=0)
    hooks = Hooks()
    hooks.add(cadence)
    for s, stopping in [(1, False), (2, False), (3, False), (4, True)]:
        step["now"] = s
        hooks.after_step(s, stopping=stopping)
    assert saved == [2]  # step 4 is due but stopping: the loop saves it, once
    hooks.end(4, finished=False)
    assert saved == [2]
    step["now"] = 6
    hooks.after_step(6)
    hooks.end(6, finished=True)
    assert saved == [2, 6]  # the last step was just saved: no second save at the end
    done: list[bool] = []
    at_end = Hooks()
    at_end.add(AtEnd(lambda: done.append(True)))
    at_end.end(3, finished=False)
    assert done == []


def test_clock_counts_training_time_only(monkeypatch):
    now = {"t": 100.0}
    monkeypatch.setattr(hooks_module, "time", types.SimpleNamespace(perf_counter=lambda: now["t"]))

    class Slow(Hook):
        def after_step(self, end):
            now["t"] += 5.0  # an evaluation

    hooks = Hooks()
    hooks.add(Slow())
    clock = Clock(hooks)
    now["t"] += 2.0  # a training step
    hooks.after_step(1)
    now["t"] += 3.0
    assert clock.lap() == pytest.approx(5.0)
    now["t"] += 1.0
    hooks.after_step(2)
    assert clock.lap() == pytest.approx(1.0)
