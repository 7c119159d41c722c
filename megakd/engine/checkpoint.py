"""Checkpoint directories: atomic, complete-or-absent, newest-K kept.

`checkpoints/step_NNNNNNNN/` is first written as `checkpoints/.tmp-step_NNNNNNNN/` and renamed
only after every rank has finished writing, so a job killed mid-save never leaves a directory
that `--resume auto` would mistake for a complete checkpoint.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# The tag of every DeepSpeed checkpoint inside a step directory (`<step>/<unit>/ds/`); the
# converter reads the same name.
DEEPSPEED_TAG = "ds"

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def step_of(path: Path) -> int:
    match = _STEP_DIR.match(path.name)
    if not match:
        raise ValueError(f"{path}: not a checkpoint directory (expected step_NNNNNNNN)")
    return int(match.group(1))


def begin(run_dir: str | Path, step: int, is_main: bool) -> tuple[Path, Path]:
    """(temporary dir to write into, final dir). Rank 0 creates the temporary dir."""
    root = checkpoints_root(run_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}"
    if is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    return tmp, final


def commit(tmp: Path, final: Path, keep_last: int) -> None:
    """Rank 0, after all ranks wrote: publish `tmp` as `final` and prune old checkpoints."""
    if final.exists():  # re-saving the same step (e.g. a signal right after a periodic save)
        shutil.rmtree(tmp)
        return
    tmp.rename(final)
    if keep_last > 0:
        for old in list_checkpoints(final.parent.parent)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    log.info("saved checkpoint %s", final)


def save_rank_state(directory: Path, rank: int, state: dict) -> None:
    torch.save(state, directory / f"trainer_state_rank{rank:05d}.pt")


def load_rank_state(directory: Path, rank: int) -> dict:
    path = directory / f"trainer_state_rank{rank:05d}.pt"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the checkpoint was written with a different world size or is incomplete"
        )
    return torch.load(path, map_location="cpu", weights_only=False)
