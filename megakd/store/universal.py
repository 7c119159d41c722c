"""DeepSpeed universal checkpoints: a ZeRO checkpoint re-cut for another number of processes.

A ZeRO-1/2/3 checkpoint holds one optimizer partition per saving rank, so a run at another world
size cannot read it directly. DeepSpeed's `ds_to_universal` rewrites it with one file per
parameter and state (`zero/<param>/fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt`, `step.pt`), which an
engine of any data-parallel size loads with `checkpoint.load_universal` (megakd/engine/
deepspeed_backend.py).

The published checkpoint is never touched (its manifest lists exactly what the save wrote, see
`megakd.store.checkpoint.verify`): the converted copy goes to `<run.dir>/universal/step_NNNNNNNN/
<unit>/ds/`, written as `.tmp-step_NNNNNNNN` and renamed into place when complete, with
`source.json` naming the checkpoint and its manifest's sha256. A later elastic resume from the same
checkpoint reuses it; converting another checkpoint replaces it (one copy at a time, about the size
of the checkpoint itself).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

from megakd.fsutil import sha256_file
from megakd.store.checkpoint import DEEPSPEED_TAG, MANIFEST
from megakd.store.files import (
    StoreError,
    deepspeed_safe_loading,
    first_line,
    fsync_dir,
    fsync_tree,
    load_state,
)

log = logging.getLogger(__name__)

UNIVERSAL_DIR = "universal"
SOURCE_FILE = "source.json"
SOURCE_FORMAT = "megakd-universal/1"


def universal_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / UNIVERSAL_DIR


def universal_support() -> str | None:
    """None if the installed DeepSpeed converts and loads universal checkpoints, else why not."""
    try:
        import deepspeed
        from deepspeed.checkpoint import ds_to_universal  # noqa: F401
        from deepspeed.runtime.engine import DeepSpeedEngine
    except ImportError as err:
        return f"DeepSpeed has no universal checkpoint converter ({first_line(err)})"
    if not hasattr(DeepSpeedEngine, "load_universal_checkpoint"):
        return f"DeepSpeed {deepspeed.__version__} cannot load universal checkpoints"
    return None


def _source(checkpoint_dir: Path, units: list[str]) -> dict:
    return {"format": SOURCE_FORMAT, "checkpoint": str(checkpoint_dir.resolve()),
            "manifest_sha256": sha256_file(checkpoint_dir / MANIFEST), "units": sorted(units)}


def cached_copy(run_dir: str | Path, checkpoint_dir: Path, units: list[str]) -> Path | None:
    """The converted copy of `checkpoint_dir` in `run_dir`, if one was completed for exactly it."""
    final = universal_root(run_dir) / checkpoint_dir.name
    try:
        recorded = json.loads((final / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return final if recorded == _source(checkpoint_dir, units) else None


def convert_to_universal(run_dir: str | Path, checkpoint_dir: Path, units: list[str]) -> Path:
    """Rank 0: `checkpoint_dir`'s DeepSpeed units in universal form under `run_dir` (reused if converted).

    Returns `<run.dir>/universal/<step dir name>`, holding `<unit>/ds/` per unit. Other copies in
    `universal/` (older checkpoints, a conversion killed midway) are removed first.
    """
    found = cached_copy(run_dir, checkpoint_dir, units)
    if found is not None:
        log.info("elastic resume: reusing the universal checkpoint %s", found)
        return found
    root = universal_root(run_dir)
    final = root / checkpoint_dir.name
    tmp = root / f".tmp-{checkpoint_dir.name}"
    if root.is_dir():
        for stale in sorted(root.iterdir()):
            doomed = stale.with_name(f".old-{stale.name}-{time.time_ns()}") if stale.name == final.name else stale
            if doomed != stale:
                stale.rename(doomed)  # never leave a half-deleted copy under its final name
            shutil.rmtree(doomed, ignore_errors=True)
    tmp.mkdir(parents=True)
    started = time.perf_counter()
    try:
        for unit in units:
            _convert_unit(checkpoint_dir / unit / DEEPSPEED_TAG, tmp / unit / DEEPSPEED_TAG)
        (tmp / SOURCE_FILE).write_text(json.dumps(_source(checkpoint_dir, units), indent=1) + "\n")
        fsync_tree(tmp)
        tmp.rename(final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.warning("elastic resume: converted %s to a DeepSpeed universal checkpoint in %s (%.1f s)",
                checkpoint_dir, final, time.perf_counter() - started)
    return final


def _convert_unit(source: Path, out: Path) -> None:
    """`ds_to_universal` of one engine's tag directory, in this process, its progress output at debug level."""
    from deepspeed.checkpoint import ds_to_universal

    if not source.is_dir():
        raise StoreError(f"{source}: missing (expected a DeepSpeed ZeRO checkpoint of this unit)")
    args = SimpleNamespace(input_folder=str(source), output_folder=str(out), num_extract_workers=1,
                           num_merge_workers=1, keep_temp_folder=False, strict=True,
                           # megakd's modules carry no Megatron-style UNIVERSAL_CHECKPOINT_INFO: plain
                           # data parallelism needs none beyond the version DeepSpeed injects
                           inject_missing_state=True)
    chatter = io.StringIO()
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter), \
                deepspeed_safe_loading(source):
            ds_to_universal.main(args)
    except StoreError:
        raise
    except Exception as err:
        raise StoreError(f"{source}: DeepSpeed could not convert it to a universal checkpoint "
                         f"({first_line(err)})") from None
    finally:
        log.debug("ds_to_universal %s: %s", source, chatter.getvalue())


def saved_param_groups(tag_dir: Path) -> list[dict]:
    """The optimizer's hyperparameters per parameter group (no 'params') in a converted unit `<unit>/ds/`.

    DeepSpeed 0.19's ZeRO-3 universal loader gives every group the first group's values (so the
    no-decay group would get weight decay); the backend puts these back.
    """
    path = tag_dir / "zero" / "optimizer_state.pt"
    try:
        with deepspeed_safe_loading(tag_dir):
            groups = load_state(path)["param_groups"]
    except (OSError, KeyError, TypeError, RuntimeError) as err:
        raise StoreError(f"{path}: cannot read the optimizer's parameter groups ({first_line(err)})") from None
    return [{k: v for k, v in group.items() if k != "params"} for group in groups]
