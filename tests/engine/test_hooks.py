"""The hook runner both training loops stand on (megakd/engine/hooks.py): order, lines, end, cadence, clock,
and the progress a terminal or a log file gets."""

from __future__ import annotations

import fcntl
import logging
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import tty
import types
from pathlib import Path

import pytest

from megakd.engine import hooks as hooks_module
from megakd.engine.hooks import AtEnd, Checkpoints, Clock, Hook, Hooks, ProgressBar, StepHook
from tests.helpers import tiny_overrides

REPO = Path(__file__).parents[2]


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


def test_a_terminal_gets_the_bar_and_a_file_a_plain_line_at_each_log_line(monkeypatch, caplog, tmp_path):
    """A tqdm bar redraws itself with carriage returns: right on a terminal (a pty here), a pile of them on one
    line in a log file. A file gets a log line at each step with figures instead (here every third, as a
    log_every of 3 gives them), with the rate and time left (a fake clock: 2 s a step), and nothing else."""
    now = {"t": 0.0}
    monkeypatch.setattr(hooks_module, "time", types.SimpleNamespace(perf_counter=lambda: now["t"]))
    caplog.set_level(logging.INFO, logger=hooks_module.__name__)

    def six_steps(stderr) -> None:
        monkeypatch.setattr(sys, "stderr", stderr)
        hooks = Hooks()
        hooks.add(ProgressBar(6, 0, lambda end: {"loss": end.step / 10} if end.step % 3 == 0 else None,
                              enabled=True, desc="seed 1"))
        for step in range(1, 7):
            now["t"] += 2.0
            hooks.after_step(step)
        hooks.end(6, finished=True)

    terminal, slave = pty.openpty()
    tty.setraw(slave)  # no newline translation: a carriage return on the terminal is tqdm's
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty is 0 columns wide
    with os.fdopen(slave, "w") as stderr:
        six_steps(stderr)
    drawn = b""
    while True:
        try:
            drawn += os.read(terminal, 65536)
        except OSError:  # the slave side is closed and everything read
            break
    os.close(terminal)
    assert "\r" in drawn.decode() and re.search(r"seed 1: 100%.*6/6.*loss=0.6", drawn.decode())
    assert not caplog.records

    log_file = tmp_path / "stderr"
    with open(log_file, "w") as stderr:
        six_steps(stderr)
    assert log_file.read_text() == ""
    assert [r.getMessage() for r in caplog.records] == [
        "seed 1: step 3/6 (50%), 2 s/step, ETA 0:00:06: loss 0.3",
        "seed 1: step 6/6 (100%), 2 s/step, ETA 0:00:00: loss 0.6"]


@pytest.mark.slow
def test_a_pretraining_run_logged_to_a_file_has_plain_progress_lines(tiny_data, tmp_path):
    """What a Slurm `--output` file or `2> log` gets from a real run (stderr to a file, the bytes as written:
    a text-mode read would turn carriage returns into newlines): none, and a progress line with the step,
    rate, ETA and the bar's figures at each log line (train.log_every=2: steps 2 and 4 of 4)."""
    log_file = tmp_path / "stderr"
    with open(log_file, "wb") as stderr:
        done = subprocess.run([sys.executable, "-m", "megakd.cli", "pretrain", "-c", "configs/electra-tiny.yaml",
                               *tiny_overrides(tiny_data, tmp_path / "run",
                                               **{"train.max_steps": 4, "train.log_every": 2,
                                                  "run.progress_bar": "true", "run.export_hf": "false"})],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr, timeout=600)
    written = log_file.read_bytes()
    assert done.returncode == 0, written.decode(errors="replace")
    assert b"\r" not in written
    progress = [line.split(f"INFO {hooks_module.__name__}: ", 1)[1] for line in written.decode().splitlines()
                if f"INFO {hooks_module.__name__}: " in line]
    figures = r"gen_loss \S+, disc_loss \S+, rtd_f1 \S+, tokens_per_s \S+"
    shape = rf"step (\d)/4 \((\d+)%\), [\d.e+]+ (?:steps/s|s/step), ETA \d+:\d\d:\d\d: {figures}"
    assert [re.fullmatch(shape, line).groups() for line in progress] == [("2", "50"), ("4", "100")], progress
