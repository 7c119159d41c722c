"""Checkpoint directories: atomic, self-verifying, complete-or-absent, newest-K kept.

`checkpoints/step_NNNNNNNN/` is first written as `checkpoints/.tmp-step_NNNNNNNN/`. When every
rank has finished writing, rank 0 writes `manifest.json` (size and sha256 of every file), fsyncs
every file and directory, and only then renames the directory into place and fsyncs its parent.
A job killed at any moment therefore leaves either a complete, verifiable checkpoint or a
`.tmp-step_*` directory that the next start removes. `--resume auto` verifies the newest
checkpoint against its manifest and falls back to the newest intact one, saying which file was
damaged.

Under a run-directory lock this process holds, `begin` and `commit` first check that the job still
owns the run directory (`megakd.store.rundir.check_owner`): a job whose `.lock` was removed or
replaced stops without writing, its temporary directory removed.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from pathlib import Path

from megakd.fsutil import apply_umask, sha256_file
from megakd.store import rundir
from megakd.store.files import (
    HASH_BYTES_PER_S,
    LONG_WAIT_S,
    StoreError,
    about,
    fsync_dir,
    fsync_tree,
    human_bytes,
    load_state,
    save_state,
)

log = logging.getLogger(__name__)

# The tag of every DeepSpeed checkpoint inside a step directory (`<step>/<unit>/ds/`); the
# converter reads the same name.
DEEPSPEED_TAG = "ds"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "megakd-checkpoint/1"

_STEP_DIR = re.compile(r"^step_(\d{8})$")
# Unfinished saves, and published checkpoints on their way out (renamed first, so a job killed
# mid-delete never leaves a half-deleted directory under a checkpoint's name).
_TMP_DIR = re.compile(r"^\.(tmp-step|old-step|pruned-step)_(\d{8})")


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: str | Path, step: int) -> Path:
    """Where the published checkpoint of `step` lives."""
    return checkpoints_root(run_dir) / f"step_{step:08d}"


def temp_dir(run_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of `step` is written before it is published."""
    return checkpoints_root(run_dir) / f".tmp-step_{step:08d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Published checkpoint directories, oldest step first (not verified)."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=step_of)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def step_of(path: Path) -> int:
    match = _STEP_DIR.match(path.name)
    if not match:
        raise ValueError(f"{path}: not a checkpoint directory (expected step_NNNNNNNN)")
    return int(match.group(1))


def remove_stale_temp_dirs(run_dir: str | Path) -> list[Path]:
    """Delete `.tmp-step_*` left by a job that died mid-save (never a published checkpoint), and the
    `.hf.partial-*` / `.hf.old-*` of an end-of-run export that was killed (`megakd.fsutil.atomic_output_dir`).

    Called at a job's start under the run directory's lock, so no other job is writing them.
    """
    root = checkpoints_root(run_dir)
    stale = [p for p in root.iterdir() if _TMP_DIR.match(p.name)] if root.is_dir() else []
    stale += sorted(Path(run_dir).glob(".hf.partial-*")) + sorted(Path(run_dir).glob(".hf.old-*"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
        log.warning("removed %s: left by a job that stopped while saving, pruning or exporting", path)
    return stale


def begin(run_dir: str | Path, step: int, is_main: bool) -> tuple[Path, Path]:
    """(temporary dir to write into, final dir). Rank 0 creates the temporary dir."""
    final, tmp = step_dir(run_dir, step), temp_dir(run_dir, step)
    if is_main:
        rundir.check_owner(run_dir)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    return tmp, final


def abort(tmp: Path) -> None:
    """Rank 0, after a failed save: the temporary dir goes, published checkpoints stay."""
    shutil.rmtree(tmp, ignore_errors=True)


def write_manifest(directory: Path, step: int) -> None:
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel != MANIFEST:
            files[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {"format": MANIFEST_FORMAT, "step": step, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def verify(directory: Path) -> None:
    """Raise StoreError naming the first file that is missing, resized, changed or added since the save."""
    file = directory / MANIFEST
    try:
        manifest = json.loads(file.read_text())
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"format: expected {MANIFEST_FORMAT!r}")
    except FileNotFoundError:
        raise StoreError(f"{file}: missing (the checkpoint is incomplete or predates manifests)") from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise StoreError(f"{file}: unreadable manifest ({err})") from None
    size = sum(entry.get("size", 0) for entry in files.values() if isinstance(entry, dict))
    if size / HASH_BYTES_PER_S >= LONG_WAIT_S:  # a resume reads every byte back first: minutes at electra-large
        log.info("verifying checkpoint %s (~%s, the sha256 of every file): %s", directory, human_bytes(size),
                 about(size / HASH_BYTES_PER_S))
    # Readers find files by name or glob (weights, trainer_state_rank*.pt): a file the save did not
    # write must not be read as part of the checkpoint.
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel != MANIFEST and rel not in files:
            raise StoreError(f"{path}: not listed in {file} (added after the save; a checkpoint holds only the "
                             f"files its manifest lists)")
    for rel, entry in files.items():
        path = directory / rel
        if not path.is_file():
            raise StoreError(f"{path}: missing (listed in {file})")
        size = path.stat().st_size
        if size != entry["size"]:
            raise StoreError(f"{path}: {size} bytes, the manifest says {entry['size']} (truncated or overwritten)")
        if sha256_file(path) != entry["sha256"]:
            raise StoreError(f"{path}: sha256 differs from the manifest (the file was damaged after the save)")


def newest_intact(run_dir: str | Path) -> Path | None:
    """The newest checkpoint that verifies; each damaged newer one is reported in one warning line."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            verify(path)
            return path
        except StoreError as err:
            log.warning("checkpoint %s is damaged, falling back to an older one: %s", path.name, err)
    return None


def commit(tmp: Path, final: Path, step: int, keep_last: int) -> None:
    """Rank 0, after all ranks wrote: manifest, the umask's permissions (`fsutil.apply_umask`), fsync,
    publish `tmp` as `final`, prune older ones.

    Saving a step that is already published (a signal right after a periodic save) replaces it.
    Pruning keeps the newest `keep_last` by step and never the checkpoint just written. Ownership of
    the run directory is checked first and again just before the publishing rename; a job that lost it
    raises `RunDirTakenOver` with `tmp` removed.
    """
    _check_owner_or_abort(tmp, final)
    write_manifest(tmp, step)
    apply_umask(tmp)
    fsync_tree(tmp)
    _check_owner_or_abort(tmp, final)
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{time.time_ns()}")
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep_last > 0:
        others = [p for p in list_checkpoints(final.parent.parent) if p != final]
        for stale in others[:max(0, len(others) - (keep_last - 1))]:
            doomed = stale.with_name(f".pruned-{stale.name}")
            stale.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
    log.info("saved checkpoint %s", final)


def _check_owner_or_abort(tmp: Path, final: Path) -> None:
    try:
        rundir.check_owner(final.parent)
    except rundir.RunDirTakenOver:
        abort(tmp)
        raise


def rank_state_path(directory: Path, rank: int) -> Path:
    return directory / f"trainer_state_rank{rank:05d}.pt"


def save_rank_state(directory: Path, rank: int, state: dict) -> None:
    save_state(state, rank_state_path(directory, rank))


def load_rank_state(directory: Path, rank: int) -> dict:
    path = rank_state_path(directory, rank)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the checkpoint was written with a different world size or is incomplete"
        )
    return load_state(path)
