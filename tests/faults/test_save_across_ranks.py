"""A failure on one rank during a save: every rank ends within a bound, each with one line, nothing partial is
published, and `--resume auto` continues from the newest intact checkpoint (docs/reliability.md § A failure
during a save, across ranks).

The slow row is real: 2 ranks of ZeRO-2 over gloo, one run resumed after each fault. Each launch saves every
step and has one fault injected (tests/faults/save_faults.py) into the save of the step after its first, so the
next launch both resumes from the checkpoint the fault left newest and injects the next fault. A step repeated
after a resume must log exactly the metrics it logged before the failed save (CPU: bit for bit). The fast rows
drive `RunSession.save` and DeepSpeed's checkpoint-engine wrapper in this process.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megakd.engine.backends import free_local_port
from megakd.engine.deepspeed_backend import _WritesKeepGoing
from megakd.engine.session import RunSession
from megakd.store import checkpoint
from megakd.store.files import StoreError
from tests.distributed.harness import CONFIG, REPO, child_env
from tests.helpers import tiny_overrides

MAX_STEPS = 6
BOUND_S = 15.0  # from the fault to the last rank's exit, no timeout involved (measured: 0.11 s at most)
ERROR = "megakd: error: "
# free_local_port's port can be taken by another test's process before torchrun binds it; the launch then
# starts no rank, and is tried again on a new port
PORT_TRIES = 3
LAUNCH_TIMEOUT_S = 120  # a launch takes 7-19 s here; a hang (as before the fix) would take the 30-minute timeout

# (where the fault is, the rank it hits, a stop signal at the same moment, each rank's exit code (None: killed),
# what the failing rank's line says, what the other rank's line says)
FAULTS = [
    ("config", 0, True, [2, 2], "no space left on device while saving step {step}",
     "saving step {step} failed on another rank"),
    ("partition", 1, False, [2, 2], "no space left on device while saving step {step}",
     "saving step {step} failed on another rank"),
    ("rank_state", 0, False, [2, 2], "no space left on device while saving step {step}",
     "saving step {step} failed on another rank"),
    ("kill", 1, False, [2, None], None, "saving step {step}: another rank ended or stopped answering"),
    ("hang", 1, False, [2, None], None, "saving step {step}: another rank ended or stopped answering"),
]
TIMEOUT_S = 5.0  # the hang row's save timeout (megakd.engine.session.SAVE_TIMEOUT_S)


def _launch(tiny_data, run, *, resume: bool, fault: tuple | None, tmp_path) -> tuple[int, dict, list[str]]:
    """One 2-rank launch (one fault or none): (torchrun's exit code, {rank: (seconds from the fault to its
    exit, its exit code)} for the ranks that exited, each rank's stderr)."""
    launch = tmp_path / f"launch-{time.monotonic_ns()}"
    logs, times = launch / "logs", launch / "times"
    times.mkdir(parents=True)
    env = {"FAULT_STEP": "0", "FAULT_AT": "none", "FAULT_RANK": "-1"}
    if fault is not None:
        at, rank, stop, step = fault
        env = {"FAULT_STEP": str(step), "FAULT_AT": at, "FAULT_RANK": str(rank), "FAULT_STOP": "1" if stop else "0"}
        if at == "hang":
            env["FAULT_TIMEOUT_S"] = str(TIMEOUT_S)
    overrides = tiny_overrides(tiny_data, run, **{"train.max_steps": MAX_STEPS, "run.save_every": 1,
                                                  "run.keep_last": 2, "run.export_hf": "false",
                                                  "backend.name": "deepspeed", "backend.zero_stage": 2,
                                                  "backend.dist_backend": "gloo"})
    for _ in range(PORT_TRIES):
        code = _torchrun(logs, times, env, overrides, resume, fault)
        if any(logs.rglob("attempt_0")):
            break
        agent_log = (logs / "torchrun.log").read_text()
        if "address already in use" not in agent_log.lower():  # only a lost port race is worth another try
            raise AssertionError(f"torchrun started no rank ({fault}):\n{agent_log[-4000:]}")
    errs = [next(logs.rglob(f"attempt_0/{rank}/stderr.log")).read_text() for rank in range(2)]
    struck = float((times / "fault").read_text()) if (times / "fault").exists() else None
    exits = {}
    for r in range(2):
        if struck is not None and (times / f"exit-{r}").exists():
            when, rank_code = (times / f"exit-{r}").read_text().split()
            exits[r] = (float(when) - struck, int(rank_code))
    return code, exits, errs


def _torchrun(logs, times, env: dict, overrides: list[str], resume: bool, fault: tuple | None) -> int:
    """One torchrun launch of the 2 ranks; its own output goes to LOGS/torchrun.log."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_local_port()}",
           f"--log-dir={logs}", "--redirects=3", "-m", "tests.faults.save_faults", "pretrain",
           *(["--resume", "auto"] if resume else []), "-c", str(CONFIG), *overrides]
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "torchrun.log", "w") as agent_log:
        proc = subprocess.Popen(cmd, env=child_env(FAULT_TIMES=str(times), **env), stdout=agent_log,
                                stderr=subprocess.STDOUT, cwd=REPO)
        try:
            return proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # the ranks (torchrun starts each in a session of its own) would wait out the 30-minute timeout
            for pid in times.glob("pid-*"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid.read_text()), signal.SIGKILL)
            proc.kill()
            proc.wait()
            raise AssertionError(f"the launch hung ({fault}): {LAUNCH_TIMEOUT_S} s") from None


def _metrics(run) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: {k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows}


@pytest.mark.slow
def test_a_failed_save_on_one_rank_ends_every_rank_with_one_line(tiny_data, tmp_path):
    run = tmp_path / "run"
    logged: dict[int, dict] = {}
    compared = set()  # steps logged before a launch and again after it (a resumed launch runs the failed step again)
    first = 1  # the first step each launch runs
    for n, (at, rank, stop, codes, failing_says, other_says) in enumerate(FAULTS):
        step = first + 1  # the launch's second save fails; its first is the newest intact checkpoint after
        code, exits, errs = _launch(tiny_data, run, resume=n > 0, fault=(at, rank, stop, step), tmp_path=tmp_path)
        row = f"{at} on rank {rank}{' + SIGUSR1' if stop else ''}"
        assert code != 0, row
        assert {r: c for r, (_, c) in exits.items()} == {r: c for r, c in enumerate(codes) if c is not None}, \
            (row, exits, errs[rank][-3000:])
        assert max(t for t, _ in exits.values()) < BOUND_S + (TIMEOUT_S if at == "hang" else 0), (row, exits)
        if at == "hang":  # rank 0 waited out the timeout at DeepSpeed's last barrier
            assert exits[0][0] > TIMEOUT_S, (row, exits)
        print(row, {r: round(t, 2) for r, (t, _) in exits.items()})
        for r, err in enumerate(errs):
            lines = [ln for ln in err.splitlines() if ln.startswith(ERROR)]
            says = failing_says if r == rank else other_says
            if says is None:  # SIGKILLed: no line
                assert lines == [], (row, r, err[-2000:])
                continue
            assert len(lines) == 1, (row, r, err[-3000:])
            assert not stop or "received SIGUSR1: will save a checkpoint and stop" in err, (row, r)
            assert "Traceback" not in err, (row, r, err[-3000:])
            assert says.format(step=step) in lines[0], (row, r, lines[0])
            print(row, r, lines[0])
            assert f"{run / 'checkpoints'}" in lines[0], (row, r, lines[0])
        # nothing partial published: the newest checkpoint is the launch's first, intact, and no temp dir is left
        assert [p.name for p in checkpoint.list_checkpoints(run)][-1] == f"step_{first:08d}", row
        assert checkpoint.newest_intact(run) == checkpoint.step_dir(run, first), row
        assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp")], row
        # the steps a resume repeats log exactly what they logged before
        now = _metrics(run)
        for s, values in now.items():
            if s in logged:
                assert values == logged[s], (row, s)
                compared.add(s)
        logged.update(now)
        first = step
    code, _, errs = _launch(tiny_data, run, resume=True, fault=None, tmp_path=tmp_path)
    assert code == 0, errs[0][-3000:]
    now = _metrics(run)
    assert sorted(now) == list(range(1, MAX_STEPS + 1))
    for s, values in now.items():
        if s in logged:
            assert values == logged[s], ("final", s)
            compared.add(s)
    assert compared >= set(range(2, len(FAULTS) + 2))  # every failed save's step among them
    assert checkpoint.newest_intact(run) == checkpoint.step_dir(run, MAX_STEPS)



class _PeerDiesAt:
    """Rank 0 of 2 whose `fail_at`-th collective (counted from 1) fails as gloo's does when the peer died."""

    is_main, rank, world_size = True, 0, 2

    def __init__(self, fail_at: int):
        self.calls, self.fail_at = 0, fail_at

    def _collective(self):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                               "[127.0.0.1]:46312: Connection reset by peer. This is typically caused by a remote "
                               "worker hanging or bugs in the application. GLHF!\nmore")

    def barrier(self) -> None:
        self._collective()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self._collective()
        return tensor


def _write(tmp):
    (tmp / "part.bin").write_bytes(b"x" * 1000)


def test_a_peer_lost_before_publishing_leaves_the_older_checkpoint_newest(tmp_path):
    """Collectives of a save: the barrier after `begin`, the agreement after the writes, the one after the
    publication. The peer dies at the first agreement: one line, nothing published, the temp dir gone."""
    RunSession(tmp_path, _PeerDiesAt(fail_at=0)).save(tmp_path, 1, _write, 2, 0.0)
    with pytest.raises(StoreError) as raised:
        RunSession(tmp_path, _PeerDiesAt(fail_at=2)).save(tmp_path, 2, _write, 2, 0.0)
    assert str(raised.value) == (f"{tmp_path / 'checkpoints'}: saving step 2: another rank ended or stopped "
                                 "answering (Read error [127.0.0.1]:46312: Connection reset by peer); step 2 was not "
                                 "published, older checkpoints are intact")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001"]
    assert checkpoint.newest_intact(tmp_path) == checkpoint.step_dir(tmp_path, 1)


def test_a_peer_lost_after_publishing_says_the_step_was_saved(tmp_path):
    with pytest.raises(StoreError) as raised:
        RunSession(tmp_path, _PeerDiesAt(fail_at=3)).save(tmp_path, 1, _write, 2, 0.0)
    assert str(raised.value) == (f"{tmp_path / 'checkpoints'}: step 1 was saved, then another rank ended or "
                                 "stopped answering (Read error [127.0.0.1]:46312: Connection reset by peer)")
    assert checkpoint.newest_intact(tmp_path) == checkpoint.step_dir(tmp_path, 1)


class _Disk:
    """A DeepSpeed checkpoint engine whose `full_after`-th write fails with ENOSPC."""

    name = "disk"

    def __init__(self, root, full_after: int):
        self.root, self.full_after, self.writes = root, full_after, 0

    def save(self, state_dict, path: str) -> None:
        self.writes += 1
        if self.writes == self.full_after:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        torch.save(state_dict, path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        (self.root / path).mkdir(exist_ok=exist_ok)


def test_deepspeed_writes_after_a_failed_one_are_skipped_and_the_first_error_kept(tmp_path):
    disk = _Disk(tmp_path, full_after=2)
    writes = _WritesKeepGoing(disk, failed=None)
    for n in range(4):
        writes.save({"n": torch.tensor(n)}, str(tmp_path / f"{n}.pt"))
    writes.makedirs("later")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.pt"]  # nothing written after the failure
    assert disk.writes == 2 and writes.error.errno == errno.ENOSPC and writes.error.filename == str(tmp_path / "1.pt")
    assert writes.name == "disk"  # the rest is the wrapped engine's
    # a later engine's save (the next unit) starts failed: it writes nothing, and keeps the first error
    after = _WritesKeepGoing(_Disk(tmp_path, full_after=0), failed=writes.error)
    after.save({}, str(tmp_path / "x.pt"))
    assert after.error is writes.error and not (tmp_path / "x.pt").exists()
