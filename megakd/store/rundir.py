"""Run-directory ownership, its lock, and the config history a resumed run keeps.

A run directory belongs to one run. A new run into a used directory is refused (continue it with
`--resume auto`, pick another `run.dir`, or set `run.overwrite=true` to move the old contents
aside into `<run.dir>.old-<timestamp>/`; nothing is ever deleted). While a run writes, its main
process holds an exclusive `fcntl.flock` on `<run.dir>/.lock`, so a second job on the same
directory stops at once and names the holder. The kernel drops the lock when the process dies,
however it dies, so a stale lock file never blocks a resume.

A flock cannot stop someone from deleting or replacing `.lock` while its holder runs, after which a
second job takes a fresh lock on the same directory. So the holder checks, at every commit (a
checkpoint's publish, the end-of-run export's), that `.lock` is still the file it locked (same
device and inode) and still names this job (host, pid and a random token written at `announce`);
if not, the commit refuses with `RunDirTakenOver` and nothing more is written (`check_owner`).

At resume the checkpoint's config is compared with the current one key by key (see
`state_changes`): steering keys change freely; a state-bearing key must be named with
`--allow-change KEY`, and then the run directory keeps the earlier config as
`config_history/step_NNNNNNNN.yaml` (the config that applied up to that step).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from megakd.errors import redact_values
from megakd.store.files import StoreError, first_line, human_bytes, is_disk_full

LOCK_FILE = ".lock"
LOCK_EXPECTED = "expected a regular file (the run directory's lock), remove it"
HISTORY_DIR = "config_history"

# Keys that only steer the run: how long, how often to log/save/evaluate, where outputs go, and
# how the same global batch is laid out (micro-batch size and loader workers: the data position is
# global, so an elastic resume continues the same sample order), and init.* (where step 0's weights
# came from: a resumed run reads its checkpoint, never the init again). The saved state holds
# nothing that depends on them, so they may differ at resume without being named.
STEERING = ("run.", "train.max_steps", "train.log_every", "train.max_bad_steps",
            "train.eval_every", "train.eval_samples", "train.probe_", "train.micro_batch_size", "init.",
            "data.num_workers", "data.cache_dir", "kernels.", "backend.dist_backend")
# Model fields (under any model's section) that change how, not what, a model computes: the same
# parameters either way, and absent from the configs of runs started before they existed.
STEERING_FIELDS = ("fused_qkv", "attention_kernel")
# State-bearing keys that cannot change within a run even when named: the saved tensors, data
# cursors or engine layout would not fit the new value. Start a new run from a model directory
# or HF export instead.
FIXED = ("model.", "electra.decoupled", "train.seed", "train.precision", "data.mask_prob", "data.seq_len",
         "data.vocab_size", "backend.name", "backend.zero_stage", "backend.pipeline_stages")


_JOB_LINE = re.compile(rb"host [^\n]*, pid \d+, job [0-9a-f]{16}\n")  # what `announce` writes


class RunDirTakenOver(StoreError):
    """`.lock` was removed, replaced or rewritten while this job held it: another job may own the run now."""


# The locks this process holds, by resolved run directory: `check_owner` finds the one a commit is under.
_HELD: dict[Path, RunDirLock] = {}


class RunDirLock:
    """An exclusive flock on `<run_dir>/.lock`, held for the run's life by the writing process."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None
        self._file_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the file this job locked
        self._identity: bytes | None = None  # what `announce` wrote into it
        self._created: list[Path] = []  # what `acquire` created (directories, then the lock file), undone unannounced
        self.held_a_run = False  # `.lock` was there, naming a megakd job: the directory is (or was) a run

    def acquire(self) -> None:
        """Take the lock or raise naming the holder. Nothing is written yet (see `announce`); a lock file
        or directory created here is removed again if the job never announces (`release`), so a refused
        start leaves no trace. A `.lock` that is not megakd's (a file of the user's) is refused untouched."""
        self._created = [p for p in reversed([self.path.parent, *self.path.parent.parents]) if not p.exists()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, created = self._open()
        if created:
            self._created.append(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown holder"
            os.close(fd)
            self._undo_created()
            raise StoreError(f"{self.path.parent}: in use by another megakd job ({holder}); wait for it to end "
                             "or pick another run.dir") from None
        found = os.pread(fd, 4096, 0)
        if found and not _JOB_LINE.fullmatch(found):
            os.close(fd)
            raise StoreError(f"{self.path}: not a megakd run lock (it holds {found[:60]!r}); a directory that is not a "
                             "run is never written: pick another run.dir") from None
        self._fd = fd
        st = os.fstat(fd)
        self._file_id, self._identity, self.held_a_run = (st.st_dev, st.st_ino), None, bool(found)
        _HELD[self.path.parent.resolve()] = self

    def _open(self) -> tuple[int, bool]:
        """Open (or create) the lock as a regular file inside the run directory, never through a link;
        whether it was created.

        `announce` truncates and rewrites the file, so a `.lock` that is a symbolic link would have
        that done to its target outside the run (or create the target of a dangling link); a FIFO
        or device would hang or misbehave. O_NONBLOCK keeps a FIFO from blocking the open.
        """
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            try:
                fd, created = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o666), True
            except FileExistsError:
                fd, created = os.open(self.path, flags), False
        except OSError as err:
            found = {errno.ELOOP: "is a symbolic link", errno.EISDIR: "is a directory"}.get(err.errno)
            if found is None:
                raise
            raise StoreError(f"{self.path}: {found}; {LOCK_EXPECTED}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StoreError(f"{self.path}: not a regular file; {LOCK_EXPECTED}")
        return fd, created

    def _undo_created(self) -> None:
        """Remove what `acquire` created (the lock file, then the directories, only while empty)."""
        for path in reversed(self._created):
            try:
                path.unlink() if path == self.path else path.rmdir()
            except OSError:
                break  # not ours alone any more (another job's lock in it, a file written meanwhile)
        self._created = []

    def announce(self) -> None:
        """Record this process as the holder, once the run has been allowed to start.

        Kept apart from `acquire` so a refused start leaves the run directory byte-identical.
        """
        identity = f"host {socket.gethostname()}, pid {os.getpid()}, job {secrets.token_hex(8)}\n".encode()
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, identity, 0)
            os.fsync(self._fd)
        except OSError as error:
            os.ftruncate(self._fd, 0)  # an empty lock, as before: the run never started
            what = "no space left on device" if is_disk_full(error) else first_line(error)
            raise StoreError(f"{self.path}: {what} while recording this job as the run's holder; the run did not "
                             "start and nothing else was written") from None
        self._identity = identity
        self._created = []  # the run started: what acquire created is the run's now

    def ownership_error(self) -> RunDirTakenOver | None:
        """Why this job no longer owns the run directory, or None while `.lock` is still its file.

        Nothing to check where the lock is not held (ranks other than 0, or after `release`).
        """
        if self._fd is None:
            return None
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return self._taken("was removed")
        if (st.st_dev, st.st_ino) != self._file_id:
            holder = _read_holder(self.path)
            return self._taken("was replaced by another file" + (f" naming {holder}" if holder else ""))
        if self._identity is not None:
            found = os.pread(self._fd, 4096, 0)
            if found != self._identity:
                holder = found.decode(errors="replace").strip()[:200]
                return self._taken(f"was rewritten to name {holder or 'nobody'}")
        return None

    def check(self) -> None:
        """Raise `RunDirTakenOver` unless this job still owns the run directory (see `ownership_error`)."""
        error = self.ownership_error()
        if error is not None:
            raise error

    def _taken(self, what: str) -> RunDirTakenOver:
        return RunDirTakenOver(f"another job took over {self.path.parent} (lock {self.path} {what}): stopping "
                               "without writing")

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *_exc) -> None:
        self.release()

    def release(self) -> None:
        if self._fd is not None:
            if _HELD.get(self.path.parent.resolve()) is self:
                del _HELD[self.path.parent.resolve()]
            if self._identity is None:
                self._undo_created()  # refused before the run started: as it was (still locked while removed)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _read_holder(path: Path) -> str:
    """The first line of a `.lock` that replaced ours, if it is a readable regular file (never through a link)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        return os.read(fd, 200).decode(errors="replace").strip() if stat.S_ISREG(os.fstat(fd).st_mode) else ""
    except OSError:
        return ""
    finally:
        os.close(fd)


def ownership_error(path: str | Path) -> RunDirTakenOver | None:
    """`RunDirLock.ownership_error` of the lock this process holds on a run directory containing `path`."""
    path = Path(path).resolve()
    for run_dir, lock in list(_HELD.items()):
        if path == run_dir or run_dir in path.parents:
            error = lock.ownership_error()
            if error is not None:
                return error
    return None


def check_owner(path: str | Path) -> None:
    """Before writing or publishing `path`: raise `RunDirTakenOver` if this process locked the run
    directory `path` is in and no longer owns it. A path under no lock this process holds passes."""
    error = ownership_error(path)
    if error is not None:
        raise error


def publish_export(run_dir: Path, export: Callable[[Path, Path], object], name: str = "hf") -> Path:
    """The end-of-run export, published as `run_dir/name` only while this job owns `run_dir`.

    `export(run_dir, out)` writes into `.<name>.partial-*/<name>` inside the run directory (removed on
    any failure or signal; a killed job's is removed at the next start, `checkpoint.remove_stale_temp_dirs`);
    ownership is checked before it starts and again just before the publishing rename.
    """
    out = run_dir / name
    check_owner(run_dir)
    if out.exists() and not out.is_dir():
        raise StoreError(f"{out}: exists and is not a directory")
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=run_dir))
    try:
        try:
            export(run_dir, staging / name)
        except Exception as err:
            if not is_disk_full(err):
                raise
            newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1:]
            needed = sum(f.stat().st_size for d in newest for f in d.glob("*.safetensors"))
            raise StoreError(f"{out}: no space left on device while writing the HuggingFace export (about "
                             f"{human_bytes(needed)} needed); the partial export was removed, the checkpoints are "
                             f"intact: free some space and run the same command with --resume auto, or megakd "
                             f"convert to-hf {run_dir} {out} --force") from None
        check_owner(run_dir)
        old = None
        if out.exists():
            old = run_dir / f".{name}.old-{os.getpid()}"
            out.rename(old)
        (staging / name).rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out


def used_entries(run_dir: Path) -> list[str]:
    """What makes `run_dir` a used run directory (everything but the lock file)."""
    if not run_dir.is_dir():
        return []
    return sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE)


def _is_empty_dir(path: Path) -> bool:
    try:
        return path.is_dir() and next(path.iterdir(), None) is None
    except OSError:
        return False


def check_is_a_run(run_dir: Path, lock: RunDirLock) -> None:
    """`--resume auto` without a checkpoint starts from step 0 only in an unused directory or in a run
    that never saved (its `.lock` names a megakd job): a directory of someone else's files is refused.
    Empty directories hold no one's files: e.g. `checkpoints/` made ahead as a link to a larger disk."""
    used = [name for name in used_entries(run_dir) if not _is_empty_dir(run_dir / name)]
    if used and not lock.held_a_run:
        shown = ", ".join(used[:4]) + (", ..." if len(used) > 4 else "")
        raise StoreError(f"{run_dir}: holds {shown} but no megakd run (no checkpoint, no run lock); --resume auto "
                         "only continues runs: pick another run.dir, or start a new run with run.overwrite=true to "
                         "move these aside")


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


def _is_steering(key: str, old: Any, new: Any, steering: tuple[str, ...] = ()) -> bool:
    if key == "backend.name" and {old, new} <= PLAIN_STATE_BACKENDS:
        return True
    return key.startswith(STEERING + steering) or key.rsplit(".", 1)[-1] in STEERING_FIELDS


def state_changes(saved: dict, current: dict, steering: tuple[str, ...] = ()) -> dict:
    """{key: (old, new)} of every state-bearing key that differs (steering keys, and the caller's `steering`,
    may change freely). Values compare as saved, i.e. with credentials in URLs redacted (a URL's password
    is never in config.yaml)."""
    old, new = flatten(redact_values(saved)), flatten(redact_values(current))
    return {key: (old.get(key), new.get(key)) for key in sorted(set(old) | set(new))
            if old.get(key) != new.get(key) and not _is_steering(key, old.get(key), new.get(key), steering)}


def check_changes(where: Path, saved: dict, current: dict, allowed: tuple[str, ...], steering: tuple[str, ...] = (),
                  fixed: str | None = None) -> dict:
    """Refuse unnamed or unchangeable state-bearing changes in one line; returns the allowed ones.

    `fixed`: every state-bearing key is unchangeable, for the reason given (a job whose finished parts
    were made with the saved values); otherwise only the `FIXED` keys are, and `allowed` names the rest.
    """
    state = state_changes(saved, current, steering)
    unknown = sorted(set(allowed) - set(flatten(current)))
    if unknown:
        raise StoreError(f"--allow-change {unknown[0]}: not a config key")
    unchangeable = state if fixed is not None else {k: v for k, v in state.items() if k.startswith(FIXED)}
    if unchangeable:
        listed = "; ".join(f"{k}: {o!r} -> {n!r}" for k, (o, n) in unchangeable.items())
        why = fixed or "these keys fix the saved state's layout; start a new run instead"
        raise StoreError(f"{where}: cannot resume with a different {listed} ({why})")
    unnamed = {k: v for k, v in state.items() if k not in allowed}
    if unnamed:
        listed = "; ".join(f"{k}: {o!r} -> {n!r}" for k, (o, n) in unnamed.items())
        flags = " ".join(f"--allow-change {k}" for k in unnamed)
        raise StoreError(f"{where}: config differs from the checkpoint in {listed}; resume with the saved "
                         f"values, or make the change take effect with {flags}")
    return state


def record_history(run_dir: Path, saved: dict, step: int) -> Path:
    """Keep the config that applied up to `step` as `config_history/step_NNNNNNNN.yaml`.

    `applied_from_step` is where the previous recorded change took effect (0 for the first), so
    the history reads as consecutive step ranges, each with its config; `config.yaml` is the one
    in force from the newest recorded step on.
    """
    history = run_dir / HISTORY_DIR
    created = not history.is_dir()
    history.mkdir(exist_ok=True)
    earlier = sorted(int(p.stem.split("_")[1]) for p in history.glob("step_*.yaml"))
    start = max((s for s in earlier if s < step), default=0)
    path = history / f"step_{step:08d}.yaml"
    text = yaml.safe_dump({"applied_from_step": start, "applied_until_step": step, **redact_values(saved)},
                          sort_keys=False)
    tmp = history / f".{path.name}.tmp"
    try:  # whole or absent: written aside, then renamed into place
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if created:
            try:
                history.rmdir()
            except OSError:
                pass
        if not is_disk_full(err):
            raise
        raise StoreError(f"{path}: no space left on device while keeping the config that applied until step {step} "
                         f"({human_bytes(len(text.encode()))}); nothing was changed, the checkpoints are intact: free "
                         "some space and resume again") from None
    return path
