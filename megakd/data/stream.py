"""Streaming pretraining data with an exact, cheap resume.

Order (a pure function of seed, epoch and world layout, never of timing):

1. Epoch ``e`` has one global sequence of all N samples: shards in a seeded permutation, and
   inside each shard its samples in a seeded permutation. It does not depend on the world layout.
2. The layout has ``S = world_size * K`` slots (``K = max(num_workers, 1)`` per rank); slot
   ``s = rank * K + k`` owns the contiguous range ``[s*N//S, (s+1)*N//S)`` of every epoch's
   sequence. So each sample is in exactly one slot per epoch for any S, divisible or not, and a
   slot reads only ~N/S samples' worth of shards (at most two shards are shared with neighbours;
   the price is that a shared shard is read by both slots).
3. A slot's stream is its range of epoch 0, then of epoch 1, ... forever. Micro-batches are
   consecutive samples of one slot's stream (a batch may straddle an epoch boundary; each sample
   carries its own ``epoch``). With K workers the DataLoader returns worker batches round-robin.
4. State = per-slot cursor (samples consumed from the slot's stream) + the slot that yields next.
   A cursor maps straight to (epoch, position), so resuming opens the right shard at the right
   sample: nothing is replayed or skipped, and nothing before the cursor is read.

Masks are pure functions of (seed, epoch, index) too (:mod:`megakd.data.masking`).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from webdataset.tariterators import base_plus_ext, tar_file_iterator

from megakd.data.masking import collate
from megakd.data.shards import MANIFEST, read_manifest, sample_key
from megakd.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

STATE_VERSION = 1


class ShardError(ValueError):
    """A shard that is missing, truncated, corrupt or inconsistent with the manifest."""


def epoch_shard_order(num_shards: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, 0]).permutation(num_shards)


def in_shard_order(num_samples: int, seed: int, epoch: int, shard: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, 1, shard]).permutation(num_samples)


def slot_range(slot: int, num_slots: int, total: int) -> tuple[int, int]:
    return slot * total // num_slots, (slot + 1) * total // num_slots


def _decode_npy(data: bytes, headers: dict[bytes, tuple[np.dtype, tuple[int, ...]]]) -> np.ndarray:
    """``np.load`` with the header parse cached: samples of equal length share a header, and
    parsing it (``ast.literal_eval``) is a third of the loader's time otherwise."""
    if data[6:7] != b"\x01":  # only format 1.0 headers have the fixed 10-byte preamble
        return np.load(io.BytesIO(data), allow_pickle=False)
    end = 10 + int.from_bytes(data[8:10], "little")
    header = data[:end]
    if header not in headers:
        buf = io.BytesIO(data)
        np.lib.format.read_magic(buf)
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(buf)
        if fortran or dtype.hasobject or len(shape) != 1:
            raise ValueError(f"expected a 1-D C-order numeric array, header says {header[10:]!r}")
        headers[header] = (dtype, shape)
    dtype, shape = headers[header]
    if len(data) != end + shape[0] * dtype.itemsize:
        raise ValueError(f"array payload is {len(data) - end} bytes, header says {shape[0]} x {dtype}")
    return np.frombuffer(data, dtype=dtype, offset=end)


def shard_problem(path: Path, entry: dict) -> str | None:
    """Why the shard file cannot be the one its manifest entry describes, or None."""
    if not path.is_file():
        return f"shard {path}: missing (listed in {MANIFEST})"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"shard {path}: {size} bytes, {MANIFEST} says {entry['bytes']} (truncated or replaced?)"
    return None


def read_shard(path: Path, entry: dict, dtype: str) -> list[np.ndarray]:
    """All samples of one shard in stored order, checked against its manifest entry."""
    if problem := shard_problem(path, entry):
        raise ShardError(problem)
    out: list[np.ndarray] = []
    headers: dict[bytes, tuple[np.dtype, tuple[int, ...]]] = {}
    first = entry["first_index"]
    try:
        with open(path, "rb") as f:
            for member in tar_file_iterator(f):
                expected = sample_key(first + len(out))
                key, field = base_plus_ext(member["fname"])
                if key != expected or field != "ids.npy":
                    raise ShardError(f"shard {path}: member {len(out)} is {member['fname']!r}, "
                                     f"expected {expected}.ids.npy")
                arr = _decode_npy(member["data"], headers)
                if arr.dtype != dtype or arr.ndim != 1:
                    raise ShardError(f"shard {path}: sample {expected} is {arr.dtype}{list(arr.shape)}, expected 1-D {dtype}")
                out.append(arr)
    except ShardError:
        raise
    except Exception as e:  # tarfile/numpy raise many types for corrupt bytes
        raise ShardError(f"shard {path}: unreadable after {len(out)} samples ({type(e).__name__}: {e})") from e
    if len(out) != entry["samples"]:
        raise ShardError(f"shard {path}: holds {len(out)} samples, {MANIFEST} says {entry['samples']}")
    return out


@dataclass(frozen=True)
class _Plan:
    """Everything a worker needs, small and picklable."""

    shards_dir: str
    files: tuple[str, ...]
    counts: tuple[int, ...]
    entries: tuple[dict, ...]
    dtype: str
    total: int
    seed: int
    rank: int
    num_slots_per_rank: int
    world_size: int
    micro_batch_size: int
    mask_prob: float
    pad_id: int
    mask_id: int
    special_ids: tuple[int, ...]
    segment_start_id: int | None  # [CLS] for packed shards (see megakd.data.shards), else None
    skip_bad_shards: bool
    known_bad: frozenset[str]

    def slot_bounds(self, local_slot: int) -> tuple[int, int]:
        return slot_range(self.rank * self.num_slots_per_rank + local_slot,
                          self.world_size * self.num_slots_per_rank, self.total)


def _slot_samples(plan: _Plan, local_slot: int, cursor: int, bad: list[tuple[str, str]]
                  ) -> Iterator[tuple[int, int, np.ndarray, int]]:
    """(epoch, global index, ids, cursor after this sample) for one slot, from ``cursor`` on, forever."""
    lo, hi = plan.slot_bounds(local_slot)
    length = hi - lo
    counts = np.asarray(plan.counts)
    first_index = np.asarray([e["first_index"] for e in plan.entries])
    known_bad = set(plan.known_bad)
    while True:
        epoch, pos = divmod(cursor, length)
        order = epoch_shard_order(len(counts), plan.seed, epoch)
        ends = np.cumsum(counts[order])
        yielded, whole_epoch = 0, pos == 0
        k = int(np.searchsorted(ends, lo + pos, side="right"))
        while lo + pos < hi:
            shard = int(order[k])
            start = int(ends[k] - counts[shard])
            a, b = lo + pos - start, min(hi, int(ends[k])) - start
            name = plan.files[shard]
            samples = None
            if name not in known_bad:
                try:
                    samples = read_shard(Path(plan.shards_dir) / name, plan.entries[shard], plan.dtype)
                except ShardError as e:
                    if not plan.skip_bad_shards:
                        raise
                    logger.warning("skipping bad shard (skip_bad_shards=True): %s", e)
                    known_bad.add(name)
                    bad.append((name, str(e)))
            if samples is not None:
                perm = in_shard_order(len(samples), plan.seed, epoch, shard)
                for j in perm[a:b]:
                    cursor += 1
                    yielded += 1
                    yield epoch, int(first_index[shard] + j), samples[j], cursor
            else:
                cursor += b - a
            pos += b - a
            k += 1
        if whole_epoch and yielded == 0:
            raise ShardError(f"shards {plan.shards_dir}: every shard of slot {local_slot} (rank {plan.rank}) "
                             f"in epoch {epoch} is bad; nothing left to read")


class _SlotDataset(IterableDataset):
    """Worker ``w`` serves local slot ``(next_slot + w) % K`` and yields collated micro-batches."""

    def __init__(self, plan: _Plan, cursors: list[int], next_slot: int) -> None:
        self.plan = plan
        self.cursors = list(cursors)
        self.next_slot = next_slot

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        p = self.plan
        slot = (self.next_slot + worker) % p.num_slots_per_rank
        bad: list[tuple[str, str]] = []
        samples, epochs, indices = [], [], []
        try:
            for epoch, index, ids, cursor in _slot_samples(p, slot, self.cursors[slot], bad):
                samples.append(ids)
                epochs.append(epoch)
                indices.append(index)
                if len(samples) == p.micro_batch_size:
                    batch = collate(samples, epochs, indices, pad_id=p.pad_id, mask_id=p.mask_id,
                                    special_ids=p.special_ids, seed=p.seed, mask_prob=p.mask_prob,
                                    segment_start_id=p.segment_start_id)
                    batch["_slot"], batch["_cursor"], batch["_bad"] = slot, cursor, tuple(bad)
                    bad.clear()
                    yield batch
                    samples, epochs, indices = [], [], []
        except ShardError as e:
            # Hand the message to the main process, which raises it as a one-line error (an
            # exception raised in a DataLoader worker arrives wrapped in a worker traceback).
            yield {"_error": str(e)}


class PretrainingLoader:
    """Endless micro-batches for one rank, with ``state_dict``/``load_state_dict`` for exact resume.

    Batch keys: ``input_ids``, ``attention_mask``, ``masked_input_ids``, ``mlm_mask``, ``index``,
    ``epoch``, and ``segment_ids`` for packed shards (see :func:`megakd.data.masking.collate`). The state counts only batches this object
    has handed out, so DataLoader prefetching never leaks into a checkpoint.
    """

    def __init__(
        self,
        shards_dir: str | Path,
        tokenizer: Tokenizer,
        *,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        seed: int = 0,
        mask_prob: float = 0.15,
        check_tokenizer: bool = True,
        skip_bad_shards: bool = False,
        pin_memory: bool = False,
    ) -> None:
        self.shards_dir = Path(shards_dir)
        manifest = read_manifest(self.shards_dir)
        if check_tokenizer and manifest["tokenizer"]["vocab_hash"] != tokenizer.vocab_hash:
            raise ValueError(f"{self.shards_dir / MANIFEST}: shards were written with tokenizer vocab_hash "
                             f"{manifest['tokenizer']['vocab_hash']}, but tokenizer {tokenizer.path} has "
                             f"{tokenizer.vocab_hash}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size}: expected 0 <= rank < world_size")
        if micro_batch_size < 1 or num_workers < 0 or not 0.0 <= mask_prob <= 1.0:
            raise ValueError(f"micro_batch_size={micro_batch_size}, num_workers={num_workers}, "
                             f"mask_prob={mask_prob}: expected ≥ 1, ≥ 0, in [0, 1]")
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        k = max(num_workers, 1)
        total = manifest["num_samples"]
        if total < world_size * k:
            raise ValueError(f"{self.shards_dir / MANIFEST}: {total} samples cannot fill "
                             f"world_size*num_workers = {world_size * k} slots")
        self.bad_shards: dict[str, str] = {}
        for entry in manifest["shards"]:
            problem = shard_problem(self.shards_dir / entry["file"], entry)
            if problem and not skip_bad_shards:
                raise ShardError(problem)
            if problem:
                logger.warning("skipping bad shard (skip_bad_shards=True): %s", problem)
                self.bad_shards[entry["file"]] = problem
        self.plan = _Plan(
            shards_dir=str(self.shards_dir),
            files=tuple(e["file"] for e in manifest["shards"]),
            counts=tuple(e["samples"] for e in manifest["shards"]),
            entries=tuple(manifest["shards"]),
            dtype=manifest["dtype"],
            total=total,
            seed=seed,
            rank=rank,
            num_slots_per_rank=k,
            world_size=world_size,
            micro_batch_size=micro_batch_size,
            mask_prob=mask_prob,
            pad_id=tokenizer.pad_id,
            mask_id=tokenizer.mask_id,
            special_ids=tuple(sorted(tokenizer.special_ids)),
            segment_start_id=tokenizer.cls_id if manifest.get("packed") else None,
            skip_bad_shards=skip_bad_shards,
            known_bad=frozenset(self.bad_shards),
        )
        self.seq_len: int = manifest["seq_len"]
        self.packed: bool = bool(manifest.get("packed", False))
        self.num_samples: int = total
        self._fingerprint = hashlib.sha256(
            json.dumps([manifest["shards"], manifest["tokenizer"]], sort_keys=True).encode()).hexdigest()[:16]
        self._cursors = [0] * k
        self._next_slot = 0
        self._batches = 0

    @property
    def skipped_shards(self) -> int:
        """Distinct shards skipped so far on this rank (only with ``skip_bad_shards=True``)."""
        return len(self.bad_shards)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        p = self.plan
        dataset = _SlotDataset(p, self._cursors, self._next_slot)
        # A private generator: DataLoader otherwise draws its base seed from the global RNG on
        # every iter(), which would shift dropout randomness and break bit-exact resume.
        loader = DataLoader(dataset, batch_size=None, num_workers=self.num_workers, pin_memory=self.pin_memory,
                            generator=torch.Generator().manual_seed(0))
        for batch in loader:
            if "_error" in batch:
                raise ShardError(batch["_error"])
            slot = batch.pop("_slot")
            self._cursors[slot] = batch.pop("_cursor")
            self._next_slot = (slot + 1) % p.num_slots_per_rank
            self._batches += 1
            for name, reason in batch.pop("_bad"):
                self.bad_shards.setdefault(name, reason)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Position after the batches handed out so far (JSON-able)."""
        p = self.plan
        return {
            "version": STATE_VERSION,
            "data_fingerprint": self._fingerprint,
            "seed": p.seed,
            "rank": p.rank,
            "world_size": p.world_size,
            "num_workers": self.num_workers,
            "micro_batch_size": p.micro_batch_size,
            "mask_prob": p.mask_prob,
            "cursors": list(self._cursors),
            "next_slot": self._next_slot,
            "batches": self._batches,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the saved loader stopped; the layout must be the same."""
        mine = self.state_dict()
        for key in ("version", "data_fingerprint", "seed", "rank", "world_size", "micro_batch_size", "mask_prob"):
            if state.get(key) != mine[key]:
                raise ValueError(f"loader state: {key}={state.get(key)!r} does not match this loader's {mine[key]!r}")
        if max(state.get("num_workers", 0), 1) != self.plan.num_slots_per_rank:
            raise ValueError(f"loader state: num_workers={state.get('num_workers')!r} gives a different slot layout "
                             f"than this loader's num_workers={self.num_workers}")
        cursors = state.get("cursors")
        if not isinstance(cursors, list) or len(cursors) != len(self._cursors):
            raise ValueError(f"loader state: cursors={cursors!r}, expected a list of {len(self._cursors)} ints")
        if not 0 <= int(state.get("next_slot", -1)) < len(self._cursors):
            raise ValueError(f"loader state: next_slot={state.get('next_slot')!r}, expected 0..{len(self._cursors) - 1}")
        self._cursors = [int(c) for c in cursors]
        self._next_slot = int(state["next_slot"])
        self._batches = int(state["batches"])
