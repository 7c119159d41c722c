"""The launch/ scripts with the real CLI: two netns "nodes" (ZeRO-2), preemption → checkpoint → resume.

Both compare against the single-process replay of the same global batches (harness.py), with the
tolerance of test_backends.py (measured ≤ 2e-7 relative; summation order is the only difference).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from megakd.engine.backends import free_local_port
from megakd.store.checkpoint import latest_checkpoint, step_of
from tests.distributed.harness import (
    CONFIG,
    REPO,
    assert_metrics_close,
    assert_same_weights,
    child_env,
    read_metrics,
    reference_run,
)
from tests.helpers import tiny_overrides

pytestmark = pytest.mark.slow

LAUNCH = REPO / "launch"
COMMON = {"model.generator.dropout": 0.0, "model.discriminator.dropout": 0.0, "run.export_hf": "false",
          "kernels.backend": "torch", "train.global_batch_size": 16, "train.micro_batch_size": 4,
          "optim.schedule.decay": "constant"}


def _assert_matches_reference(run_dir, ref_dir, steps: list[int]) -> None:
    got, want = read_metrics(run_dir), [r for r in read_metrics(ref_dir) if r["step"] in steps]
    assert [r["step"] for r in got] == steps
    assert_metrics_close(got, want)
    for unit in ("generator", "discriminator"):
        assert_same_weights(run_dir, ref_dir, unit)


def _run(cmd: list[str], timeout: float = 600, **env: str) -> None:
    proc = subprocess.run(cmd, env=child_env(**env), capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if proc.returncode == 77:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stderr[-6000:]}"


def test_two_netns_nodes_zero2_match_single_node(tiny_data, tmp_path):
    """One rank per namespace, rendezvous over the veth addresses, DeepSpeed ZeRO-2, 3 steps."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    overrides = tiny_overrides(tiny_data, tmp_path / "nodes", **COMMON, **{"train.max_steps": 3,
                               "backend.name": "deepspeed", "backend.zero_stage": 2})
    _run([str(LAUNCH / "netns_nodes.sh"), str(LAUNCH / "torchrun.sh"), "1", "-c", str(CONFIG), *overrides],
         MASTER_PORT=str(free_local_port()))
    reference_run(tiny_overrides(tiny_data, tmp_path / "reference", **COMMON, **{"train.max_steps": 3}), world=2)
    _assert_matches_reference(tmp_path / "nodes", tmp_path / "reference", [1, 2, 3])


def test_signal_checkpoints_and_next_launch_resumes(tiny_data, tmp_path):
    """SIGTERM to launch/deepspeed.sh (2 ranks, ZeRO-1) → checkpoint + clean exit; launch/torchrun.sh
    --resume auto continues, and steps before and after the signal match the uninterrupted replay."""
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tiny_data, run_dir, **COMMON, **{"train.max_steps": 500, "backend.name": "deepspeed",
                                                                "backend.zero_stage": 1})
    cmd = [str(LAUNCH / "deepspeed.sh"), "--num_gpus", "2", "--master_port", str(free_local_port()), "-c", str(CONFIG),
           *overrides]
    log = (tmp_path / "first.log").open("w")
    proc = subprocess.Popen(cmd, env=child_env(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            start_new_session=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-4000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    stopped = step_of(latest_checkpoint(run_dir))
    assert 2 <= stopped < 500
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, stopped + 1))

    total = stopped + 2
    resume = tiny_overrides(tiny_data, run_dir, **COMMON, **{"train.max_steps": total, "backend.name": "deepspeed",
                                                             "backend.zero_stage": 1})
    _run([str(LAUNCH / "torchrun.sh"), "2", "-c", str(CONFIG), "--resume", "auto", *resume],
         MASTER_PORT=str(free_local_port()))
    reference_run(tiny_overrides(tiny_data, tmp_path / "reference", **COMMON, **{"train.max_steps": total}), world=2)
    _assert_matches_reference(run_dir, tmp_path / "reference", list(range(1, total + 1)))
