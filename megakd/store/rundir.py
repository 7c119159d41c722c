"""Run-directory ownership, its lock, and the config history a resumed run keeps.

A run directory belongs to one run. A new run into a used directory is refused (continue it with
`--resume auto`, pick another `run.dir`, or set `run.overwrite=true` to move the old contents
aside into `<run.dir>.old-<timestamp>/`; nothing is ever deleted). While a run writes, its main
process holds an exclusive `fcntl.flock` on `<run.dir>/.lock`, so a second job on the same
directory stops at once and names the holder. The kernel drops the lock when the process dies,
however it dies, so a stale lock file never blocks a resume.

At resume the checkpoint's config is compared with the current one key by key (see
`state_changes`): steering keys change freely; a state-bearing key must be named with
`--allow-change KEY`, and then the run directory keeps the earlier config as
`config_history/step_NNNNNNNN.yaml` (the config that applied up to that step).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import stat
import time
from pathlib import Path
from typing import Any

import yaml

from megakd.store.files import StoreError

LOCK_FILE = ".lock"
LOCK_EXPECTED = "expected a regular file (the run directory's lock), remove it"
HISTORY_DIR = "config_history"

# Keys that only steer the run: how long, how often to log/save/evaluate, where outputs go, and
# how the same global batch is laid out (micro-batch size and loader workers: the data position is
# global, so an elastic resume continues the same sample order), and init.* (where step 0's weights
# came from: a resumed run reads its checkpoint, never the init again). The saved state holds
# nothing that depends on them, so they may differ at resume without being named.
STEERING = ("run.", "train.max_steps", "train.log_every", "train.save_every", "train.max_bad_steps",
            "train.eval_every", "train.eval_samples", "train.probe_", "train.micro_batch_size", "init.",
            "data.num_workers", "data.cache_dir", "kernels.", "backend.dist_backend")
# Model fields (under any model's section) that change how, not what, a model computes: the same
# parameters either way, and absent from the configs of runs started before they existed.
STEERING_FIELDS = ("fused_qkv",)
# State-bearing keys that cannot change within a run even when named: the saved tensors, data
# cursors or engine layout would not fit the new value. Start a new run from a model directory
# or HF export instead.
FIXED = ("model.", "electra.decoupled", "train.seed", "train.precision", "data.mask_prob", "data.seq_len", "data.vocab_size", "backend.name",
         "backend.zero_stage", "backend.pipeline_stages")


class RunDirLock:
    """An exclusive flock on `<run_dir>/.lock`, held for the run's life by the writing process."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise naming the holder. Nothing is written yet (see `announce`)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown holder"
            os.close(fd)
            raise StoreError(f"{self.path.parent}: in use by another megakd job ({holder}); wait for it to end "
                             "or pick another run.dir") from None
        self._fd = fd

    def _open(self) -> int:
        """Open (or create) the lock as a regular file inside the run directory, never through a link.

        `announce` truncates and rewrites the file, so a `.lock` that is a symbolic link would have
        that done to its target outside the run (or create the target of a dangling link); a FIFO
        or device would hang or misbehave. O_NONBLOCK keeps a FIFO from blocking the open.
        """
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as err:
            found = {errno.ELOOP: "is a symbolic link", errno.EISDIR: "is a directory"}.get(err.errno)
            if found is None:
                raise
            raise StoreError(f"{self.path}: {found}; {LOCK_EXPECTED}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StoreError(f"{self.path}: not a regular file; {LOCK_EXPECTED}")
        return fd

    def announce(self) -> None:
        """Record this process as the holder, once the run has been allowed to start.

        Kept apart from `acquire` so a refused start leaves the run directory byte-identical.
        """
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"host {socket.gethostname()}, pid {os.getpid()}\n".encode(), 0)
        os.fsync(self._fd)

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *_exc) -> None:
        self.release()

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def used_entries(run_dir: Path) -> list[str]:
    """What makes `run_dir` a used run directory (everything but the lock file)."""
    if not run_dir.is_dir():
        return []
    return sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE)


def claim_for_new_run(run_dir: Path, overwrite: bool) -> Path | None:
    """Make sure a new run starts in an empty `run_dir`; returns where old contents were moved, if any.

    The caller holds the lock, which stays in place: only the other entries move.
    """
    used = used_entries(run_dir)
    if not used:
        return None
    if not overwrite:
        shown = ", ".join(used[:4]) + (", ..." if len(used) > 4 else "")
        raise StoreError(f"{run_dir}: already holds a run ({shown}); continue it with --resume auto, pick another "
                         "run.dir, or set run.overwrite=true to move the old contents aside")
    aside = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    while aside.exists():
        aside = aside.with_name(aside.name + "_")
    aside.mkdir()
    for name in used:
        shutil.move(str(run_dir / name), aside / name)
    return aside


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


# Backends whose checkpoints are the same plain state dicts: moving between them is an elastic
# resume (another world size), not a change of the saved state's layout.
PLAIN_STATE_BACKENDS = {"single", "ddp"}


def _is_steering(key: str, old: Any, new: Any) -> bool:
    if key == "backend.name" and {old, new} <= PLAIN_STATE_BACKENDS:
        return True
    return key.startswith(STEERING) or key.rsplit(".", 1)[-1] in STEERING_FIELDS


def state_changes(saved: dict, current: dict) -> dict:
    """{key: (old, new)} of every state-bearing key that differs (steering keys may change freely)."""
    old, new = flatten(saved), flatten(current)
    return {key: (old.get(key), new.get(key)) for key in sorted(set(old) | set(new))
            if old.get(key) != new.get(key) and not _is_steering(key, old.get(key), new.get(key))}


def check_changes(checkpoint: Path, saved: dict, current: dict, allowed: tuple[str, ...]) -> dict:
    """Refuse unnamed or unchangeable state-bearing changes in one line; returns the allowed ones."""
    state = state_changes(saved, current)
    unknown = sorted(set(allowed) - set(flatten(current)))
    if unknown:
        raise StoreError(f"--allow-change {unknown[0]}: not a config key")
    fixed = {k: v for k, v in state.items() if k.startswith(FIXED)}
    if fixed:
        listed = "; ".join(f"{k}: {o!r} -> {n!r}" for k, (o, n) in fixed.items())
        raise StoreError(f"{checkpoint}: cannot resume with a different {listed} (these keys fix the saved state's "
                         "layout; start a new run instead)")
    unnamed = {k: v for k, v in state.items() if k not in allowed}
    if unnamed:
        listed = "; ".join(f"{k}: {o!r} -> {n!r}" for k, (o, n) in unnamed.items())
        flags = " ".join(f"--allow-change {k}" for k in unnamed)
        raise StoreError(f"{checkpoint}: config differs from the checkpoint in {listed}; resume with the saved "
                         f"values, or make the change take effect with {flags}")
    return state


def record_history(run_dir: Path, saved: dict, step: int) -> Path:
    """Keep the config that applied up to `step` as `config_history/step_NNNNNNNN.yaml`.

    `applied_from_step` is where the previous recorded change took effect (0 for the first), so
    the history reads as consecutive step ranges, each with its config; `config.yaml` is the one
    in force from the newest recorded step on.
    """
    history = run_dir / HISTORY_DIR
    history.mkdir(exist_ok=True)
    earlier = sorted(int(p.stem.split("_")[1]) for p in history.glob("step_*.yaml"))
    start = max((s for s in earlier if s < step), default=0)
    path = history / f"step_{step:08d}.yaml"
    path.write_text(yaml.safe_dump({"applied_from_step": start, "applied_until_step": step, **saved},
                                   sort_keys=False))
    return path
