"""Safe file formats and durable writes: the only way megakd reads or writes state files.

Files from elsewhere are data, never code. Model weights are safetensors. Optimizer, schedule and
trainer state are `torch.save` files read back with `weights_only=True`, whose unpickler builds
only tensors and plain containers; RNG states are stored as tensors and plain tuples so they need
nothing more. DeepSpeed's own loaders pass `weights_only=False`; `deepspeed_safe_loading()` forces
them through the same restricted unpickler with an allow-list of the few DeepSpeed types its
checkpoints hold.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from megakd.errors import UserError
from megakd.fsutil import is_disk_full  # noqa: F401 (the store's writers import it from here)

log = logging.getLogger(__name__)

ALIASES = "megakd_aliases"  # safetensors metadata: {alias key: stored key} for tied weights


class StoreError(UserError):
    """A stored file is missing, damaged, unsafe or of the wrong kind: one line naming the file."""


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# -- safe reading ---------------------------------------------------------------------------------

def load_state(path: str | Path, map_location: str | torch.device = "cpu") -> Any:
    """A `torch.save` file of tensors and plain containers; anything else is refused, never run."""
    path = Path(path)
    if not path.is_file():
        raise StoreError(f"{path}: missing")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # pickle payloads, truncation, garbage: all one line naming the file
        raise StoreError(f"{path}: cannot read as a weights-only torch file "
                         f"({type(err).__name__}: {first_line(err)[:200]})") from None


def save_state(state: Any, path: str | Path) -> None:
    torch.save(state, path)


def save_weights(state_dict: Mapping[str, Tensor], path: str | Path) -> None:
    """A state dict as safetensors. A tensor that aliases an earlier key (tied weights) is stored
    once; the alias is recorded in the metadata, and `load_weights` gives it back under both keys."""
    kept: dict[tuple[int, int, tuple], str] = {}
    out, aliases = {}, {}
    for key, tensor in state_dict.items():
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if ident in kept:
            aliases[key] = kept[ident]
            continue
        kept[ident] = key
        out[key] = tensor.detach().contiguous()
    save_file(out, str(path), metadata={"format": "pt", ALIASES: json.dumps(aliases)})


def weight_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Key → shape of a safetensors file (aliases of `save_weights` included), from its header only:
    no tensor data is read, so shapes can be checked before anything the size of the model exists."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
            aliases = json.loads((f.metadata() or {}).get(ALIASES, "{}"))
    except Exception as err:
        raise StoreError(f"{path}: cannot read as safetensors ({first_line(err)[:200]})") from None
    shapes.update({alias: shapes[key] for alias, key in aliases.items() if key in shapes})
    return shapes


def load_weights(path: str | Path, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    path = Path(path)
    if not path.is_file():
        raise StoreError(f"{path}: missing")
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            weights = {key: f.get_tensor(key) for key in f.keys()}
            aliases = json.loads((f.metadata() or {}).get(ALIASES, "{}"))
    except Exception as err:
        raise StoreError(f"{path}: cannot read as safetensors ({first_line(err)[:200]})") from None
    for alias, key in aliases.items():
        if key not in weights:
            raise StoreError(f"{path}: alias {alias!r} points to missing tensor {key!r}")
        weights[alias] = weights[key]
    return weights


def _deepspeed_types() -> list:
    """Exactly the non-tensor, non-container types DeepSpeed 0.19 puts into its checkpoint files."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


@contextlib.contextmanager
def deepspeed_safe_loading(directory: str | Path) -> Iterator[None]:
    """Make DeepSpeed's `torch.load(..., weights_only=False)` calls weights-only for this block.

    torch reads `TORCH_FORCE_WEIGHTS_ONLY_LOAD` on every `torch.load`; with it set, a pickle
    payload in any DeepSpeed file under `directory` fails to load instead of running. The
    allow-list adds only DeepSpeed's own enum, loss-scaler and fragment-address classes.
    """
    key = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
    previous = os.environ.get(key)
    os.environ[key] = "1"
    try:
        with torch.serialization.safe_globals(_deepspeed_types()):
            yield
    except StoreError:
        raise
    except Exception as err:
        if "Weights only load failed" in str(err):
            raise StoreError(f"{directory}: refused to unpickle a DeepSpeed checkpoint file "
                             f"({_unpickle_culprit(err)})") from None
        raise
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous


def _unpickle_culprit(err: Exception) -> str:
    for line in str(err).splitlines():
        if "Unsupported global" in line or "Unsupported operand" in line:
            return line.strip().removeprefix("WeightsUnpickler error: ")[:200]
    return first_line(err)[:200]


# -- durable writing ------------------------------------------------------------------------------

def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (and `root` itself): the data is on disk before a rename."""
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        _fsync(path)
    _fsync(root)


def fsync_dir(path: Path) -> None:
    _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


LONG_WAIT_S = 5.0  # a wait expected to last this long is announced in the log before it starts
HASH_BYTES_PER_S = 300e6  # hashlib's sha256 on one core of the 2-core machine (docs/data.md)


def about(seconds: float) -> str:
    """A duration for a log line: seconds, or minutes from two minutes on."""
    return f"about {seconds:.0f} s" if seconds < 120 else f"about {seconds / 60:.0f} min"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


