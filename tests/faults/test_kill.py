"""kill -9 at random moments of training and saving, then `--resume auto`: the same run, exactly.

A run that saves after every step spends much of its time inside `save` (writing, hashing,
fsyncing, renaming), so random kill times land both mid-step and mid-save. Whatever the moment,
resuming until the run finishes must give the uninterrupted run's metrics and final weights,
bit for bit (CPU).
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

import pytest

from tests.faults.harness import REPO, megakd
from tests.faults.test_persistence import CONFIG, assert_same_as_base
from tests.helpers import tiny_overrides

pytestmark = pytest.mark.slow

KILL_RUN = {"train.max_steps": 6, "run.save_every": 1, "run.keep_last": 2, "run.export_hf": "false"}


def _args(tiny_data, run):
    return ["-c", str(CONFIG), *tiny_overrides(tiny_data, run, **KILL_RUN)]


def _start(tiny_data, run, *flags):
    return subprocess.Popen([sys.executable, "-m", "megakd.cli", "pretrain", *flags, *_args(tiny_data, run)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_for_training(proc, run):
    """Until the first step is logged (or the process ended): kill times count from here."""
    deadline = time.time() + 300
    while not (run / "metrics.jsonl").exists() and proc.poll() is None:
        assert time.time() < deadline
        time.sleep(0.02)


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    """The uninterrupted run, and how long it trains and saves after its first logged step."""
    run = tmp_path_factory.mktemp("kill") / "reference"
    proc = _start(tiny_data, run)
    _wait_for_training(proc, run)
    started = time.perf_counter()
    assert proc.wait() == 0
    return run, time.perf_counter() - started


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kill_9_then_resume_auto_matches_the_uninterrupted_run(seed, tiny_data, reference, tmp_path):
    reference_run, seconds = reference
    run = tmp_path / "run"
    rng = random.Random(seed)
    kills = 0
    for attempt in range(3):  # up to three kills, each at a random moment once training is under way
        proc = _start(tiny_data, run, *([] if attempt == 0 else ["--resume", "auto"]))
        _wait_for_training(proc, run)
        time.sleep(rng.uniform(0.0, 0.8 * seconds))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
    out = megakd("pretrain", "--resume", "auto", *_args(tiny_data, run))
    assert out.code == 0, out.stderr[-2000:]
    assert kills >= 1
    assert_same_as_base(run, reference_run)
