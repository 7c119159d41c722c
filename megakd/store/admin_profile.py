"""`<run.dir>/admin_profile.json`: the ω Admin's profiling pass gave a run at its first start.

A checkpoint holds the trained ω, so a resume from one needs no profile. A run that died before its
first checkpoint restarts from step 0 (`--resume auto`), and reads its ω from here instead of profiling
again (at electra-base's size minutes on the CPU, `megakd.engine.pretrain.admin_profile`).

The file is JSON: a format tag and version, the train seed and, per profiled model (`generator`,
`discriminator`), its encoder config (less the fields that say how to compute, not what:
`COMPUTE_FIELDS`) and its 2N ω, plus the device the pass ran on and the sha256 of all of that. It is
written aside and renamed into place (whole or absent), and read back only if it is intact (the
checksum) and was profiled for this run's models and seed; anything else is one line naming the file,
which is left as it is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from megakd.models.encoder import COMPUTE_FIELDS, EncoderConfig
from megakd.store.files import StoreError, first_line, fsync_dir, is_disk_full

PROFILE_FILE = "admin_profile.json"
FORMAT = "megakd-admin-profile"
VERSION = 1
# Far above any real profile (2 models x 2 x 1,024 layers of ω and their configs: ~100 KB), so a file that
# is not one is refused before it is read whole.
MAX_BYTES = 1 << 20
_FIX = "remove it to profile again"


def profile_config(config: EncoderConfig) -> dict[str, Any]:
    """What of an encoder's config its ω depend on: everything but how it computes."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in COMPUTE_FIELDS}


def profile_record(seed: int, device: str, models: dict[str, tuple[EncoderConfig, list[float]]]) -> dict:
    """The file's content (without its checksum) for `models`: {name: (config, ω)}."""
    return {"format": FORMAT, "version": VERSION, "seed": seed, "device": device,
            "models": {name: {"config": profile_config(config), "omegas": list(omegas)}
                       for name, (config, omegas) in sorted(models.items())}}


def _digest(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=False)
                          .encode()).hexdigest()


def write_profile(path: Path, record: dict) -> None:
    """`record` with its sha256 at `path`, written aside, fsynced and renamed into place."""
    text = json.dumps({**record, "sha256": _digest(record)}, indent=1, allow_nan=False) + "\n"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
        fsync_dir(path.parent)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if not is_disk_full(err):
            raise
        raise StoreError(f"{path}: no space left on device while saving the Admin profile") from None


def read_profile(path: Path, seed: int, configs: dict[str, EncoderConfig]) -> dict:
    """The record at `path`, checked to be intact and profiled for `configs` ({name: encoder config}) and
    `seed`; its `models[name]["omegas"]` are the ω to apply. Anything else raises StoreError naming `path`."""
    if not path.is_file():  # a FIFO would block the open, a directory cannot be read
        raise StoreError(f"{path}: expected a regular file (the Admin profile); {_FIX}")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as err:
        raise StoreError(f"{path}: cannot read the Admin profile ({first_line(err)})") from None
    if len(raw) > MAX_BYTES:
        raise StoreError(f"{path}: over {MAX_BYTES} bytes, not an Admin profile; {_FIX}")
    try:
        data = json.loads(raw.decode("utf-8"))
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"expected a JSON object with format {FORMAT!r}")
        stored = data.pop("sha256", None)
        digest = _digest(data)
    except (ValueError, RecursionError) as err:  # not UTF-8, not JSON, NaN in it, nested too deep, not a profile
        raise StoreError(f"{path}: not an Admin profile ({type(err).__name__}: {first_line(err)[:120]}); "
                         f"{_FIX}") from None
    if data.get("version") != VERSION:
        raise StoreError(f"{path}: Admin profile version {data.get('version')!r:.20}, this megakd reads "
                         f"version {VERSION}; {_FIX}")
    if stored != digest:
        raise StoreError(f"{path}: damaged (its content does not match its sha256); {_FIX}")
    _check_profiled_for(path, data, seed, configs)
    return data


def _check_profiled_for(path: Path, data: dict, seed: int, configs: dict[str, EncoderConfig]) -> None:
    """An intact record (the checksum holds) may still belong to other models, or be written by hand."""
    models = data.get("models")
    if not isinstance(data.get("device"), str):
        raise StoreError(f"{path}: expected the device the profile ran on, got {data.get('device')!r:.40}; {_FIX}")
    if data.get("seed") != seed or not isinstance(models, dict) or sorted(models) != sorted(configs):
        found = sorted(models) if isinstance(models, dict) else models
        raise StoreError(f"{path}: profiled for seed {data.get('seed')!r:.20} and models {found!r:.80}, this run has "
                         f"train.seed={seed} and Admin init in {sorted(configs)}; {_FIX}")
    for name, config in configs.items():
        entry = models[name]
        saved = entry.get("config") if isinstance(entry, dict) else None
        saved = saved if isinstance(saved, dict) else {}
        wanted = profile_config(config)
        changed = sorted(k for k in set(saved) | set(wanted) if saved.get(k, ...) != wanted.get(k, ...))
        if changed:
            key = changed[0]
            raise StoreError(f"{path}: profiled for model.{name}.{key}={saved.get(key)!r:.40}, this run has "
                             f"{wanted.get(key)!r:.40} (its config changed before its first checkpoint); {_FIX}")
        omegas = entry.get("omegas")
        if not (isinstance(omegas, list) and len(omegas) == 2 * config.num_layers
                and all(type(w) is float and math.isfinite(w) and w > 0 for w in omegas)):
            raise StoreError(f"{path}: model.{name}: expected {2 * config.num_layers} finite positive ω, got "
                             f"{omegas!r:.60}; {_FIX}")
