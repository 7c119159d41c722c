"""Streaming pretraining data with an exact, cheap resume that survives a change of layout.

Order (a pure function of the seed, never of timing or of the world layout):

1. Epoch ``e`` has one global sequence of all N samples: shards in a seeded permutation, cut
   into groups of ``shuffle_shards`` consecutive shards, and inside each group all its samples in
   one seeded permutation (shards are written in input order, so a single shard is a few pages of
   one source; interleaving a group's shards makes every batch a mix). Epochs follow each other,
   so global position ``p`` is sample ``p mod N`` of epoch ``p div N``'s sequence.
2. Micro-batches are consecutive slices of that global sequence, dealt to ranks in turn: a rank's
   ``m``-th micro-batch is positions ``[(m*W + r)*B, (m*W + r + 1)*B)`` for rank ``r`` of ``W``
   with micro-batch size ``B``. An optimizer step of ``A`` accumulation rounds thus consumes the
   consecutive global batch ``[t*G, (t+1)*G)`` (``G = A*W*B``) whatever ``W``, ``B`` and ``A`` are,
   and the same micro-batches in the same order as one process accumulating ``A*W`` of them.
   A batch may straddle an epoch boundary; each sample carries its own ``epoch``.
3. ``num_workers`` only decides who reads: worker ``k`` of ``K`` builds micro-batches
   ``m ≡ k (mod K)`` and the DataLoader hands them out round-robin, i.e. in order.
4. State = the next micro-batch index, which in layout terms is the global position
   ``m*W*B``: a resume with the same layout continues at ``m``; with another world size,
   micro-batch size or worker count it continues at position ``m*W*B`` of the same global order
   (it must fall on the new layout's micro-batch grid, which holds at every step boundary since
   ``W*B`` divides the global batch). Nothing is replayed or skipped, and nothing before the
   position is read.

Each rank reads the shard groups that hold its slices; a group's shards are read together and kept
in memory while the global order passes through it (``shuffle_shards`` shards per rank and per
DataLoader worker), so every rank reads every shard once per epoch: the price of a layout-free
order; decoding is cheap next to a training step.
Masks are pure functions of (seed, epoch, index) too (:mod:`megakd.data.masking`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import gc
import hashlib
import io
import json
import logging
import multiprocessing
import shutil
import signal
import tarfile
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from webdataset.tariterators import base_plus_ext

from megakd.config import DataConfig
from megakd.data.masking import Masking
from megakd.data.shards import INDEX_DTYPE, MANIFEST, member_digest, read_manifest, sample_key
from megakd.data.storage import (
    ContentCache,
    ReadCancelled,
    ShardStore,
    StorageError,
    cancel_on,
    check_cancelled,
    transient,
)
from megakd.data.tokenizer import Tokenizer
from megakd.errors import UserError
from megakd.signals import STOP_SIGNALS

logger = logging.getLogger(__name__)

STATE_VERSION = 2  # 1 = per-slot cursors of the old contiguous-range layout


class StoppedWaitingForData(BaseException):
    """A stop asked for while the training loop waited for its next batch.

    Raised by the run's signal handler (in-process reads) or by the loader's poll of
    ``PretrainingLoader.stop_waiting`` (DataLoader workers). A ``BaseException`` like
    ``KeyboardInterrupt``: it ends the wait (a fetch, a retry's backoff) and nothing on the way up
    may take it for a storage error.
    """


class ShardError(UserError):
    """A shard that is missing, truncated, corrupt or inconsistent with the manifest.

    With ``skip_bad_shards`` the loader logs, counts and skips such a shard.
    """


class BadSampleError(UserError):
    """A sample the model cannot take (token id outside the vocabulary, longer than ``seq_len``).

    The shard is intact (its sha256 matched), so it was written this way: with another tokenizer or
    another ``seq_len``. Skipping would only hide that, so this always stops the run.
    """


def epoch_shard_order(num_shards: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, 0]).permutation(num_shards)


def in_group_order(shard_counts: np.ndarray, seed: int, epoch: int, group: int, block: int = 1) -> np.ndarray:
    """The group's samples (numbered through its shards in epoch order) in one seeded permutation.

    ``block`` > 1 permutes runs of ``block`` consecutive samples of a shard (the last run of a shard
    may be shorter) instead of single samples, so a reader's slice of the order is a few contiguous
    byte ranges rather than one range per sample (docs/decisions.md § Reads proportional to the share).
    """
    rng = np.random.default_rng([seed, epoch, 1, group])
    total = int(np.sum(shard_counts))
    if block == 1:
        return rng.permutation(total)
    ends = np.cumsum(shard_counts)
    starts = np.concatenate([np.arange(e - c, e, block)
                             for e, c in zip(ends.tolist(), np.asarray(shard_counts).tolist())])
    lengths = np.minimum(block, np.repeat(ends, -(-np.asarray(shard_counts) // block)) - starts)
    order = rng.permutation(len(starts))
    first, size = starts[order], lengths[order]
    return np.repeat(first - np.cumsum(size) + size, size) + np.arange(total)


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


def shard_problem(store: ShardStore, entry: dict) -> str | None:
    """Why the shard object cannot be the one its manifest entry describes, or None."""
    path = store.url(entry["file"])
    size = store.size(entry["file"])
    if size is None:
        return f"shard {path}: missing (listed in {MANIFEST})"
    if size != entry["bytes"]:
        return f"shard {path}: {size} bytes, {MANIFEST} says {entry['bytes']} (truncated or replaced?)"
    return None


class _HashingReader:
    """A file object that feeds every byte it returns into sha256, so the tar parser's single read
    of a shard also hashes it (no second pass over the file)."""

    def __init__(self, f) -> None:
        self._f = f
        self.digest = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        check_cancelled()  # a closed read-ahead stops streaming a whole shard between reads, too
        data = self._f.read(n)
        self.digest.update(data)
        self.size += len(data)
        return data

    def drain(self) -> None:
        """Read (and hash) what the tar parser left: the end-of-archive padding."""
        while self.read(1 << 16):
            pass


def _plain_members(path: Path, stream: tarfile.TarFile, limit: int) -> Iterator[tuple[str, bytes]]:
    """(name, data) of each member, refusing before its data is read anything the shard writer never
    writes: a sparse, linked or special member, or one declaring more than ``limit`` bytes (a member
    cannot be larger than the shard holding it, so a bigger declared size is never allocated)."""
    for info in stream:
        if info.type not in (tarfile.REGTYPE, tarfile.AREGTYPE) or info.issparse():
            kind = "sparse" if info.issparse() else f"type {info.type!r}"
            raise ShardError(f"shard {path}: member {info.name!r} is {kind}, expected a plain regular file")
        if info.size > limit:
            raise ShardError(f"shard {path}: member {info.name!r} declares {info.size} bytes, more than the "
                             f"shard's {limit} bytes")
        data = stream.extractfile(info).read()
        stream.members = []  # stream mode: keep no list of all members
        yield info.name, data


def read_shard(path: Path, entry: dict, dtype: str, *, vocab_size: int | None = None,
               seq_len: int | None = None, verify: bool = True) -> list[np.ndarray]:
    """All samples of the local shard file ``path`` (see :func:`read_whole_shard`)."""
    return read_whole_shard(ShardStore(path.parent), entry, dtype, vocab_size=vocab_size, seq_len=seq_len,
                            verify=verify)


def read_whole_shard(store: ShardStore, entry: dict, dtype: str, *, vocab_size: int | None = None,
                     seq_len: int | None = None, verify: bool = True) -> list[np.ndarray]:
    """All samples of one shard in stored order, checked against its manifest entry.

    The file is hashed while it is parsed and its sha256 compared with the manifest's at the end
    (``ShardError``); the whole shard is read before any of its samples is returned, so a shard
    that fails the check never contributes a sample. Only an uncompressed tar of plain regular
    members is read (``r|``: a compressed or sparse member could expand far beyond the file), and no
    member larger than the shard is allocated. A shard that fails to parse is still hashed to its
    end: if its bytes differ from the manifest's, the sha256 mismatch is the error named first (what
    parsing found follows it). Then every sample must have at most ``seq_len`` tokens and ids in
    ``[0, vocab_size)`` (``BadSampleError``). ``verify=False`` skips the sha256 and range checks; it
    exists only to measure their cost (``tools/bench_data.py``).
    """
    if not store.remote and (problem := shard_problem(store, entry)):
        raise ShardError(problem)  # an object store answers a wrong size by the sha256 below
    path = store.url(entry["file"])
    out: list[np.ndarray] = []
    headers: dict[bytes, tuple[np.dtype, tuple[int, ...]]] = {}
    first = entry["first_index"]
    failure: ShardError | None = None
    with store.open(entry["file"], entry["bytes"]) as f:
        reader = _HashingReader(f)
        try:
            with tarfile.open(fileobj=reader, mode="r|") as stream:
                for name, data in _plain_members(path, stream, entry["bytes"]):
                    expected = sample_key(first + len(out))
                    key, field = base_plus_ext(name)
                    if key != expected or field != "ids.npy":
                        raise ShardError(f"shard {path}: member {len(out)} is {name!r}, expected {expected}.ids.npy")
                    arr = _decode_npy(data, headers)
                    if arr.dtype != dtype or arr.ndim != 1:
                        raise ShardError(f"shard {path}: sample {expected} is {arr.dtype}{list(arr.shape)}, "
                                         f"expected 1-D {dtype}")
                    out.append(arr)
        except ShardError as e:
            failure = e
        except StorageError:
            raise
        except Exception as e:  # tarfile/numpy raise many types for corrupt bytes
            if store.remote and transient(e):
                raise  # a dropped connection, not damaged bytes: `ShardStore.retrying` reads it again
            failure = ShardError(f"shard {path}: unreadable after {len(out)} samples ({type(e).__name__}: {e}); "
                                 f"expected an uncompressed tar")
        if verify or failure is not None:
            reader.drain()
        store.streamed(reader.size)
        if verify or failure is not None:
            if reader.size != entry["bytes"] or reader.digest.hexdigest() != entry["sha256"]:
                found = "" if failure is None else "; reading it: " + str(failure).removeprefix(f"shard {path}: ")
                raise ShardError(f"shard {path}: sha256 {reader.digest.hexdigest()} differs from {MANIFEST}'s "
                                 f"{entry['sha256']} (corrupted or replaced){found}")
    if failure is not None:
        raise failure
    if len(out) != entry["samples"]:
        raise ShardError(f"shard {path}: holds {len(out)} samples, {MANIFEST} says {entry['samples']}")
    if verify:
        _check_samples(path, out, range(first, first + len(out)), vocab_size, seq_len)
    return out


def _check_samples(path: str, samples: list[np.ndarray], indices, vocab_size: int | None,
                   seq_len: int | None) -> None:
    """Every sample fits the model: at most ``seq_len`` tokens, ids below ``vocab_size``."""
    if seq_len is not None:
        lengths = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
        if (too_long := np.flatnonzero(lengths > seq_len)).size:
            j = int(too_long[0])
            raise BadSampleError(f"shard {path}: sample {sample_key(indices[j])} has {lengths[j]} tokens, "
                                 f"more than {MANIFEST}'s seq_len={seq_len}")
    if vocab_size is not None and samples and int(np.concatenate(samples).max()) >= vocab_size:
        j = next(j for j, s in enumerate(samples) if int(s.max()) >= vocab_size)
        raise BadSampleError(f"shard {path}: sample {sample_key(indices[j])} has token id {int(samples[j].max())} "
                             f"outside the vocabulary [0, {vocab_size})")


def read_index(store: ShardStore, entry: dict, cache: ContentCache | None = None) -> np.ndarray:
    """A shard's member index (sizes and digests), checked against the manifest's sha256 first.

    With a ``cache``, an index fetched once is read from local disk afterwards (by every reader
    sharing the cache directory, e.g. all ranks and workers of a node).
    """
    meta = entry["index"]
    fetch = functools.partial(store.read, meta["file"], meta["bytes"])
    raw = cache.get(meta["sha256"], fetch) if cache is not None else fetch()
    if len(raw) != meta["bytes"] or hashlib.sha256(raw).hexdigest() != meta["sha256"]:
        raise ShardError(f"index {store.url(meta['file'])}: {len(raw)} bytes with sha256 "
                         f"{hashlib.sha256(raw).hexdigest()}, {MANIFEST} says {meta['bytes']} bytes with "
                         f"{meta['sha256']} (corrupted or replaced)")
    index = np.frombuffer(raw, INDEX_DTYPE)
    if int(index["size"].astype(np.int64).sum()) > entry["bytes"]:
        raise ShardError(f"index {store.url(meta['file'])}: members add up to more than the shard's "
                         f"{entry['bytes']} bytes")
    return index


def coalesce(starts: np.ndarray, ends: np.ndarray, overfetch: float = 0.0) -> list[tuple[int, int]]:
    """Sorted, disjoint byte ranges merged into fewer requests, reading at most ``overfetch`` x their
    bytes more: ranges that touch always merge; then the smallest gaps are read through while the
    bytes they add stay within the budget (an object store charges per request and answers each
    with a round trip, so a few hundred bytes of gap are cheaper than another request)."""
    if not len(starts):
        return []
    gaps = starts[1:] - ends[:-1]
    order = np.argsort(gaps, kind="stable")
    spent = np.cumsum(gaps[order])
    merge = np.zeros(len(gaps), bool)
    merge[order[spent <= overfetch * int((ends - starts).sum())]] = True
    breaks = np.flatnonzero(~merge) + 1
    firsts = np.concatenate([[0], breaks])
    lasts = np.concatenate([breaks - 1, [len(starts) - 1]])
    return list(zip(starts[firsts].tolist(), ends[lasts].tolist()))


@dataclass
class SharedRead:
    """Members that all DataLoader workers of a rank want from one shard in one group, read once
    between them: by the first to ask, into the node-local cache, where the others find them."""

    cache: ContentCache
    together: np.ndarray  # sorted in-shard positions all the rank's readers want here (⊇ each one's)
    names: list[str]  # cache objects this read used, appended to (their reader discards them later)


def _members(pieces: list[bytes], ranges: list[tuple[int, int]], starts: np.ndarray, ends: np.ndarray,
             positions: np.ndarray) -> Iterator[tuple[int, bytes]]:
    """(position, its member's bytes) for each in-shard position, cut out of ``pieces``, the bytes of
    ``ranges`` (sorted and disjoint, together covering every member asked for)."""
    range_of = np.searchsorted(np.asarray([start for start, _ in ranges]), starts[positions], side="right") - 1
    for j, r in zip(positions.tolist(), range_of.tolist()):
        at = int(starts[j]) - ranges[r][0]
        yield j, pieces[r][at:at + int(ends[j] - starts[j])]


def _shared_ranges(store: ShardStore, entry: dict, index: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                   shared: SharedRead, overfetch: float) -> tuple[list[tuple[int, int]], list[bytes]]:
    """The ranges of ``shared.together`` and their bytes, from the cache or fetched into it. The
    cached object is named by the shard's sha256 and the ranges (the same name in every worker)
    and used only if each of its members matches its index digest."""
    ranges = coalesce(starts[shared.together], ends[shared.together], overfetch)
    bounds = np.cumsum([0] + [end - start for start, end in ranges]).tolist()
    name = hashlib.sha256(json.dumps([entry["sha256"], ranges]).encode()).hexdigest()

    def split(blob: bytes) -> list[bytes]:
        return [blob[a:b] for a, b in zip(bounds, bounds[1:])]

    def valid(blob: bytes) -> bool:
        return len(blob) == bounds[-1] and all(
            member_digest(member) == index["digest"][j].tobytes()
            for j, member in _members(split(blob), ranges, starts, ends, shared.together))

    blob = shared.cache.get(name, lambda: b"".join(store.read_ranges(entry["file"], ranges)), valid)
    shared.names.append(name)
    return ranges, split(blob)


def read_members(store: ShardStore, entry: dict, index: np.ndarray, wanted: np.ndarray, dtype: str, *,
                 vocab_size: int | None, seq_len: int | None, overfetch: float = 0.0,
                 shared: SharedRead | None = None) -> dict[int, np.ndarray]:
    """The samples at sorted, unique in-shard positions ``wanted``, by ranged reads of their members
    (and of gaps between them worth at most ``overfetch`` x their bytes: :func:`coalesce`); with
    ``shared``, by the ranged reads of all the rank's workers together, made once between them.

    Each member is checked against the digest its (verified) index holds before it is parsed, then
    parsed as the writer wrote it: one plain regular tar member ``{index}.ids.npy``.
    """
    path = store.url(entry["file"])
    sizes = index["size"].astype(np.int64)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    if shared is not None and np.isin(wanted, shared.together).all():
        ranges, pieces = _shared_ranges(store, entry, index, starts, ends, shared, overfetch)
    else:
        ranges = coalesce(starts[wanted], ends[wanted], overfetch)
        pieces = store.read_ranges(entry["file"], ranges)
    out: dict[int, np.ndarray] = {}
    headers: dict[bytes, tuple[np.dtype, tuple[int, ...]]] = {}
    first = entry["first_index"]
    for j, member in _members(pieces, ranges, starts, ends, wanted):
        key = sample_key(first + j)
        if member_digest(member) != index["digest"][j].tobytes():
            raise ShardError(f"shard {path}: sample {key} (bytes {starts[j]}..{ends[j]}) differs from its index "
                             f"digest (corrupted or replaced)")
        try:
            info = tarfile.TarInfo.frombuf(member[:tarfile.BLOCKSIZE], "utf-8", "surrogateescape")
            if info.type not in (tarfile.REGTYPE, tarfile.AREGTYPE) or info.name != f"{key}.ids.npy" \
                    or info.size > len(member) - tarfile.BLOCKSIZE:
                raise ValueError(f"member {info.name!r} of type {info.type!r}, {info.size} bytes")
            arr = _decode_npy(member[tarfile.BLOCKSIZE:tarfile.BLOCKSIZE + info.size], headers)
        except Exception as e:  # tarfile/numpy raise many types for malformed bytes
            raise ShardError(f"shard {path}: sample {key} unreadable ({type(e).__name__}: {e}); expected a plain "
                             f"tar member {key}.ids.npy") from None
        if arr.dtype != dtype or arr.ndim != 1:
            raise ShardError(f"shard {path}: sample {key} is {arr.dtype}{list(arr.shape)}, expected 1-D {dtype}")
        out[j] = arr
    if out:
        _check_samples(path, list(out.values()), [first + j for j in out], vocab_size, seq_len)
    return out


@dataclass(frozen=True)
class ReadPlan:
    """Everything a worker needs, small and picklable."""

    store: ShardStore
    indexed: bool  # manifest version 2: ranged reads of this reader's members only
    entries: tuple[dict, ...]  # the manifest's shard entries
    dtype: str
    total: int
    seed: int  # of the order and of the masks
    rank: int
    world_size: int
    micro_batch_size: int
    masking: Masking
    shuffle_shards: int  # shards whose samples are interleaved (one seeded permutation per group)
    skip_bad_shards: bool
    known_bad: frozenset[str]
    vocab_size: int
    seq_len: int
    verify: bool
    overfetch: float  # gap bytes a ranged read may read through, as a fraction of the wanted bytes
    read_block: int  # consecutive samples of a shard kept together in the order (in_group_order)
    index_cache: str | None  # directory of a ContentCache for member indexes (None: fetch them each time)
    shared_reads: str | None = None  # directory of a ContentCache for the rank's workers' shared reads (SharedRead)

    @functools.cached_property
    def files(self) -> tuple[str, ...]:
        return tuple(e["file"] for e in self.entries)

    @functools.cached_property
    def counts(self) -> tuple[int, ...]:
        return tuple(e["samples"] for e in self.entries)

    def batch_positions(self, batch: int) -> range:
        """Global positions of this rank's micro-batch number ``batch``."""
        start = (batch * self.world_size + self.rank) * self.micro_batch_size
        return range(start, start + self.micro_batch_size)

    def reader_positions(self, from_batch: int, every: int, lo: int, hi: int) -> np.ndarray:
        """Global positions in ``[lo, hi)`` of this rank's micro-batches ``from_batch``, ``from_batch + every``, ...

        One DataLoader worker reads every ``every``-th batch: this is exactly what it will ask for
        while the order passes through ``[lo, hi)``, so it is all that it fetches there.
        """
        size, stride = self.micro_batch_size, self.world_size * self.micro_batch_size
        first = max(from_batch, (lo - (self.rank + 1) * size) // stride + 1)  # first batch ending after lo
        first += (from_batch - first) % every  # ... that this reader owns
        last = -(-(hi - self.rank * size) // stride) - 1  # last batch starting before hi
        if last < first:
            return np.zeros(0, np.int64)
        starts = (np.arange(first, last + 1, every, dtype=np.int64) * self.world_size + self.rank) * size
        positions = (starts[:, None] + np.arange(size, dtype=np.int64)).ravel()
        return positions[(positions >= lo) & (positions < hi)]


@dataclass
class ShardGroup:
    """One shard group of one epoch, as a reader sees it: its shards, their order and what it read."""

    epoch: int
    index: int  # the group's number in its epoch
    shards: np.ndarray  # shard numbers, in epoch order
    shard_ends: np.ndarray  # cumulative sample counts of those shards
    first: int  # the epoch offset of the group's first position
    perm: np.ndarray  # the group's sample order (in_group_order)
    loaded: list = field(default_factory=list)  # per shard: its samples (list or dict by position) or None
    bad: list[tuple[str, str]] = field(default_factory=list)  # shards found bad while reading it
    shared: list[str] = field(default_factory=list)  # its shared reads' cache objects (SharedRead)

    @property
    def key(self) -> tuple[int, int]:
        return self.epoch, self.index


def _in_daemon_threads(call, jobs: list, width: int) -> list:
    """``[call(job) for job in jobs]``, at most ``width`` at a time, each in a daemon thread; once all
    have ended, the first error (in job order) is raised.

    Not ``concurrent.futures``: a process joins its pool threads when it exits. A DataLoader worker
    whose read-ahead was cancelled with a request in flight then waited for that request, and at exit
    the HTTP client's own retries (its resolver's executor already shut down) made that 10 s and more,
    which closing the loader paid (docs/data.md, "Read-ahead").
    """
    results: list = [None] * len(jobs)
    errors: list[BaseException | None] = [None] * len(jobs)
    pending = iter(range(len(jobs)))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = next(pending, None)
            if i is None:
                return
            try:
                results[i] = call(jobs[i])
            except BaseException as error:  # raised in the caller's thread below
                errors[i] = error

    threads = [threading.Thread(target=work, daemon=True, name="shard read") for _ in range(min(width, len(jobs)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if (error := next((e for e in errors if e is not None), None)) is not None:
        raise error
    return results


class _Prefetch(threading.Thread):
    """Reads one shard group in the background (a daemon: a run that ends never waits for it).

    ``cancel()`` gives the read up: its reads stop between shards, between retries and out of a
    backoff wait (:func:`megakd.data.storage.cancel_on`), and the thread ends with
    :class:`ReadCancelled` as its ``error``, which nobody reads: the group was dropped, so nothing it
    held (samples, bad shards, a storage error) reaches the loader.
    """

    def __init__(self, read, group: ShardGroup) -> None:
        super().__init__(daemon=True, name=f"read-ahead epoch {group.epoch} group {group.index}")
        self.read, self.group, self.error = read, group, None
        self.cancelled = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            self.read(self.group, self.cancelled)
        except BaseException as error:  # handed to the reader's thread, which raises it
            self.error = error

    def cancel(self) -> None:
        self.cancelled.set()

    def close(self, timeout: float) -> bool:
        """Cancel, and wait up to ``timeout`` s for the thread to end; whether it has."""
        self.cancel()
        self.join(timeout)
        return not self.is_alive()

    def result(self) -> ShardGroup:
        self.join()
        if self.error is not None:
            raise self.error
        return self.group


class SampleReader:
    """Samples by global position; holds the current shard group in memory while positions stay in
    it, and reads the next one in the background meanwhile (``prefetch``).

    Unindexed shards (manifest version 1) are read whole. Indexed ones: on entering a group the
    reader fetches the members of exactly the positions it will be asked for there (its batches
    from ``at_batch`` on, every ``every``-th), nothing else. From an object store, with an index
    cache and more than one reader per rank (``every`` > 1), the rank's readers fetch what they
    want of a shard together, once (:class:`SharedRead`): the rank's batches from ``first_batch``
    on, in as few requests as for one reader. Those cache objects are discarded two groups later.
    """

    def __init__(self, plan: ReadPlan, bad: list[tuple[str, str]], every: int = 1, prefetch: bool = True,
                 first_batch: int = 0) -> None:
        self.plan = plan
        self.bad = bad
        self.every = every
        self.prefetch = prefetch
        self.first_batch = first_batch  # the rank's first batch in this pass (the same in all its readers)
        self.at_batch = 0  # the batch being built; set by the caller before it asks for positions
        self.index_cache = ContentCache(plan.index_cache) if plan.index_cache else None
        self.shared_reads = ContentCache(plan.shared_reads) if plan.shared_reads and every > 1 else None
        self._previous: ShardGroup | None = None
        self.known_bad = set(plan.known_bad)
        self.counts = np.asarray(plan.counts)
        self.first_index = np.asarray([e["first_index"] for e in plan.entries])
        self._epochs: dict[int, tuple[list[np.ndarray], np.ndarray]] = {}
        self.current: ShardGroup | None = None
        self._ahead: _Prefetch | None = None

    def epoch_groups(self, epoch: int) -> tuple[list[np.ndarray], np.ndarray]:
        """The epoch's shard groups (the seeded shard order cut into ``shuffle_shards``) and their end offsets."""
        if epoch not in self._epochs:
            order = epoch_shard_order(len(self.counts), self.plan.seed, epoch)
            size = self.plan.shuffle_shards
            groups = [order[i:i + size] for i in range(0, len(order), size)]
            self._epochs = {e: v for e, v in self._epochs.items() if e >= epoch - 1}
            self._epochs[epoch] = groups, np.cumsum([self.counts[g].sum() for g in groups])
        return self._epochs[epoch]

    def group_of(self, position: int) -> tuple[int, int]:
        """(epoch, group number) of the group that holds global ``position``."""
        epoch, offset = divmod(position, self.plan.total)
        _, ends = self.epoch_groups(epoch)
        return epoch, int(np.searchsorted(ends, offset, side="right"))

    def group_at(self, epoch: int, index: int) -> ShardGroup:
        """Group ``index`` of ``epoch``, nothing read yet."""
        groups, ends = self.epoch_groups(epoch)
        shards = groups[index]
        shard_ends = np.cumsum(self.counts[shards])
        perm = in_group_order(self.counts[shards], self.plan.seed, epoch, index, self.plan.read_block)
        return ShardGroup(epoch, index, shards, shard_ends, int(ends[index]) - int(shard_ends[-1]), perm)

    def wanted(self, group: ShardGroup, every: int | None = None, from_batch: int | None = None) -> list[np.ndarray]:
        """For each shard of ``group``: the sorted in-shard positions of the samples this reader will
        be asked for in it (from batch ``at_batch`` on); or those of every ``every``-th batch from
        ``from_batch`` on."""
        base = group.epoch * self.plan.total + group.first
        positions = self.plan.reader_positions(self.at_batch if from_batch is None else from_batch,
                                               self.every if every is None else every,
                                               base, base + int(group.shard_ends[-1]))
        j = group.perm[positions - base]
        owner = np.searchsorted(group.shard_ends, j, side="right")
        local = j - (group.shard_ends[owner] - self.counts[group.shards][owner])
        return [np.unique(local[owner == i]) for i in range(len(group.shards))]

    def _load_shard(self, group: ShardGroup, shard: int, wanted: np.ndarray | None,
                    together: np.ndarray | None, cancel: threading.Event | None = None):
        """The shard's samples (all of them, or the in-shard positions ``wanted``), or None if it is bad.

        Once ``cancel`` is set (a read-ahead given up) it raises :class:`ReadCancelled` instead, and
        records nothing: a read cut short is neither data nor a bad shard.
        """
        p = self.plan
        name = p.files[shard]
        if name in self.known_bad:
            return None
        with cancel_on(cancel):
            check_cancelled()
            return self._load_or_skip(group, shard, name, wanted, together, cancel)

    def _load_or_skip(self, group: ShardGroup, shard: int, name: str, wanted: np.ndarray | None,
                      together: np.ndarray | None, cancel: threading.Event | None):
        p = self.plan
        try:
            if wanted is None:
                return p.store.retrying("read", name, lambda: read_whole_shard(
                    p.store, p.entries[shard], p.dtype, vocab_size=p.vocab_size, seq_len=p.seq_len, verify=p.verify))
            if not len(wanted):
                return {}
            index = read_index(p.store, p.entries[shard], self.index_cache)
            shared = None if together is None else SharedRead(self.shared_reads, together, group.shared)
            return read_members(p.store, p.entries[shard], index, wanted, p.dtype, vocab_size=p.vocab_size,
                                seq_len=p.seq_len, overfetch=p.overfetch, shared=shared)
        except (ShardError, FileNotFoundError) as e:
            if cancel is not None and cancel.is_set():
                raise ReadCancelled(f"{p.store.url(name)}: read cancelled") from None
            if not p.skip_bad_shards:
                raise ShardError(str(e)) from None
            group.bad.append((name, str(e)))
            return None

    def _read(self, group: ShardGroup, cancel: threading.Event | None = None) -> None:
        """Read what this reader needs of the group's shards; an object store's shards concurrently.
        ``cancel``: see :meth:`_load_shard`."""
        wanted = self.wanted(group) if self.plan.indexed else [None] * len(group.shards)
        together = self.wanted(group, every=1, from_batch=self.first_batch) if self.shared_reads \
            else [None] * len(group.shards)
        jobs = [(int(shard), w, t) for shard, w, t in zip(group.shards, wanted, together)]
        if self.plan.store.remote and len(jobs) > 1:
            group.loaded = _in_daemon_threads(lambda job: self._load_shard(group, *job, cancel), jobs, width=8)
        else:
            group.loaded = [self._load_shard(group, *job, cancel) for job in jobs]

    def _next_key(self, group: ShardGroup) -> tuple[int, int]:
        groups, _ = self.epoch_groups(group.epoch)
        return (group.epoch, group.index + 1) if group.index + 1 < len(groups) else (group.epoch + 1, 0)

    def _enter(self, epoch: int, index: int) -> None:
        """Make group ``index`` of ``epoch`` current (the prefetched one if it is that), then start
        reading the group after it."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.group.key == (epoch, index):
            group = ahead.result()
        else:
            if ahead is not None:  # the position moved elsewhere: nobody will use that group
                ahead.cancel()
                self._discard(ahead.group)
            group = self.group_at(epoch, index)
            self._read(group)
        for name, reason in group.bad:
            logger.warning("skipping bad shard (skip_bad_shards=True): %s", reason)
            self.known_bad.add(name)
            self.bad.append((name, reason))
        self._discard(self._previous)  # two groups back: the rank's other readers are past it too
        self._previous, self.current = self.current, group
        if self.prefetch:
            self._ahead = _Prefetch(self._read, self.group_at(*self._next_key(group)))

    def _discard(self, group: ShardGroup | None) -> None:
        """Remove the shared reads of ``group`` from the cache (a reader still needing one fetches it again)."""
        if group is not None and self.shared_reads is not None:
            for name in group.shared:
                self.shared_reads.discard(name)

    def close(self, timeout: float = 2.0) -> bool:
        """Give up the read-ahead (if any) and wait up to ``timeout`` s for its thread to end; whether it
        has (a request already under way is not interrupted; if one is, the cache locks of its fetches
        are given up, so the rank's other readers do not wait for it). The reader stays usable: a
        later :meth:`sample` reads again."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.close(timeout):
            if ahead is not None:
                self._discard(ahead.group)
            return True
        logger.debug("read-ahead of epoch %d group %d still finishing a request after %.1f s", ahead.group.epoch,
                     ahead.group.index, timeout)
        for cache in (self.index_cache, self.shared_reads):
            if cache is not None:  # the rank's other readers must not wait for what it may never fetch
                cache.release()
        return False

    def sample(self, position: int) -> tuple[int, int, np.ndarray] | None:
        """(epoch, global index, ids) at ``position``, or None if its shard is bad (and skipped)."""
        epoch, offset = divmod(position, self.plan.total)
        group = self.current
        if group is None or group.epoch != epoch or not group.first <= offset < group.first + group.shard_ends[-1]:
            self._enter(*self.group_of(position))
            group = self.current
        j = int(group.perm[offset - group.first])
        i = int(np.searchsorted(group.shard_ends, j, side="right"))
        samples = group.loaded[i]
        if samples is None:
            return None
        shard = int(group.shards[i])
        j -= int(group.shard_ends[i]) - int(self.counts[shard])
        return epoch, int(self.first_index[shard] + j), samples[j]


@dataclass(frozen=True)
class ReadBatch:
    """What a reader hands the loader for one micro-batch number, across the DataLoader worker boundary.

    ``tensors`` is None for a batch whose samples all sit in skipped bad shards (it keeps the
    round-robin order of batch numbers, and training never sees it); ``bad`` the shards found bad
    since the reader's previous record; ``io`` its storage counters' growth since then (retries,
    bytes fetched, requests); ``error`` a :class:`UserError` that ended the reader, which the
    loader raises as a one-line error (one raised in a worker arrives wrapped in a worker traceback).
    """

    batch: int
    tensors: dict[str, torch.Tensor] | None = None
    bad: tuple[tuple[str, str], ...] = ()
    io: tuple[int, int, int] = (0, 0, 0)
    error: UserError | None = None

    def pin_memory(self) -> ReadBatch:
        """The record with its tensors pinned: DataLoader's ``pin_memory`` calls this on an object that
        has it, and passes a dataclass through untouched otherwise."""
        if self.tensors is None:
            return self
        return dataclasses.replace(self, tensors={k: v.pin_memory() for k, v in self.tensors.items()})


class _RankDataset(IterableDataset):
    """Worker ``k`` builds micro-batches ``first + k``, ``first + k + K``, ...: one :class:`ReadBatch` per
    batch number."""

    def __init__(self, plan: ReadPlan, first_batch: int) -> None:
        self.plan = plan
        self.first_batch = first_batch
        self._readers: list[SampleReader] = []  # made in this process (num_workers=0), for close()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_readers": []}

    def close(self, timeout: float = 2.0) -> None:
        """Give up the read-ahead of the readers iterating in this process (a worker's ends with its process)."""
        for reader in self._readers:  # kept: one that goes on reading reads ahead again, and is closed again
            reader.close(timeout)

    def __iter__(self) -> Iterator[ReadBatch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        p = self.plan
        bad: list[tuple[str, str]] = []
        reader = SampleReader(p, bad, every=workers, first_batch=self.first_batch)
        self._readers.append(reader)
        batch_number = self.first_batch + worker
        counted = p.store.retried, p.store.fetched, p.store.requested
        try:
            while True:
                reader.at_batch = batch_number
                found = [x for x in map(reader.sample, p.batch_positions(batch_number)) if x is not None]
                tensors = None
                if found:
                    epochs, indices, samples = (list(column) for column in zip(*found))
                    tensors = p.masking.collate(samples, epochs, indices, p.seed)
                elif len(reader.known_bad) == len(p.files):
                    raise ShardError(f"shards {p.store}: every shard is bad; nothing left to read")
                now = p.store.retried, p.store.fetched, p.store.requested
                record = ReadBatch(batch_number, tensors, tuple(bad), tuple(b - a for a, b in zip(counted, now)))
                counted = now
                bad.clear()
                yield record
                batch_number += workers
        except UserError as e:
            yield ReadBatch(batch_number, error=e)
        finally:
            # Ended (a worker told to stop, an in-process iterator dropped): give the read-ahead up now,
            # and with it the cache locks of its fetches, which the rank's other workers may be waiting for.
            reader.close(timeout=0)


@contextlib.contextmanager
def _stop_signals_blocked() -> Iterator[None]:
    """A DataLoader worker that died of a stop signal first would take the run down without a
    checkpoint when the signal goes to the whole process group (Slurm, `timeout`, a terminal's
    Ctrl-C), so workers ignore them. Hold the stop signals back while DataLoader workers are
    forked: a child inherits the mask, so none can die of one before `_init_worker` runs.
    Held signals reach the training process (its handlers) when the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _init_worker(_worker_id: int) -> None:
    """DataLoader `worker_init_fn`: ignore the stop signals (dropping any already pending), then
    unblock them; and put every object inherited from the parent out of the garbage collector's reach.

    A forked worker holds a copy of its parent's whole heap. Left to the collector, a full collection
    walks all of it (0.3-0.9 s here, writing to every page it touches), and inherited garbage
    is finalized in the worker: an fsspec filesystem's finalizer waits about 1 s on the parent's event
    loop, which does not run here. Either stalls whichever thread triggered it, a read-ahead or the
    worker between two batches (docs/performance.md, "Reading shards from object storage").
    """
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    gc.freeze()


def _kill_leftover_workers() -> None:
    """At exit, SIGKILL daemonic children (DataLoader workers) that are still alive.

    multiprocessing's own exit handler stops them with SIGTERM, which our workers ignore, and then
    waits forever. That happens whenever a loader iterator is still open at exit (a caller keeps a
    reference to it). atexit runs handlers last-registered-first, so this must be registered after
    multiprocessing's handler: :func:`_kill_leftover_workers_at_exit` does that. An open iterator's
    SIGCHLD handler (DataLoader's) would report each of these deaths as a failed worker, with a
    traceback out of whichever exit handler runs next, so SIGCHLD goes back to its default first.
    """
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


@functools.cache
def _kill_leftover_workers_at_exit() -> None:
    """Register :func:`_kill_leftover_workers` at exit, once, when a loader's first DataLoader workers
    have started: multiprocessing registered its exit handler before it started them, so this one
    runs first. Importing this module registers nothing."""
    atexit.register(_kill_leftover_workers)


def _check_arguments(rank: int, world_size: int, micro_batch_size: int, num_workers: int, mask_prob: float,
                     shuffle_shards: int, read_block: int) -> None:
    """The loader arguments that callers pass directly (a command's flags, a tool's, a test's) as well as
    from data.*; read_overfetch comes only from data.read_overfetch, which ``Config.validate`` checked."""
    if not 0 <= rank < world_size:
        raise UserError(f"rank={rank}, world_size={world_size}: expected 0 <= rank < world_size")
    if micro_batch_size < 1 or num_workers < 0 or not 0.0 <= mask_prob <= 1.0 or shuffle_shards < 1 \
            or read_block < 1:
        raise UserError(f"micro_batch_size={micro_batch_size}, num_workers={num_workers}, "
                         f"mask_prob={mask_prob}, shuffle_shards={shuffle_shards}, "
                         f"read_block={read_block}: expected ≥ 1, ≥ 0, in [0, 1], ≥ 1, ≥ 1")


def _bad_local_shards(store: ShardStore, manifest: dict, skip_bad_shards: bool) -> dict[str, str]:
    """Local shards that are missing or of the wrong size, by file (:func:`shard_problem`): skipped
    (logged) with ``skip_bad_shards``, else the first is a :class:`ShardError`. An object store is
    asked nothing before the first read (one request per shard and rank would be a storm at scale):
    a missing or resized object is named when it is read."""
    bad: dict[str, str] = {}
    for entry in [] if store.remote else manifest["shards"]:
        problem = shard_problem(store, entry)
        if problem and not skip_bad_shards:
            raise ShardError(problem)
        if problem:
            logger.warning("skipping bad shard (skip_bad_shards=True): %s", problem)
            bad[entry["file"]] = problem
    return bad


WAIT_POLL_S = 1.0  # how often a loader with workers asks `stop_waiting` while it waits for a batch


class PretrainingLoader:
    """Endless micro-batches for one rank, with ``state_dict``/``load_state_dict`` for exact resume.

    Batch keys: ``input_ids``, ``attention_mask``, ``masked_input_ids``, ``mlm_mask``, ``mlm_positions``, ``index``,
    ``epoch``, and ``segment_ids`` for packed shards (see :func:`megakd.data.masking.collate`).
    The state counts only batches this object has handed out, so DataLoader prefetching never
    leaks into a checkpoint.

    ``shards_dir`` is a local directory, an object-store URL or a :class:`ShardStore`. Every sample
    is verified as it is read (indexed shards: each member against its index digest, see
    :func:`read_members`; unindexed ones: :func:`read_whole_shard`'s sha256), with its length and
    token ids below ``tokenizer.vocab_size``; ``verify=False`` (unindexed shards only) exists only
    for ``tools/bench_data.py``. ``index_cache``: a directory where member indexes are kept once
    fetched (:class:`ContentCache`; node-local disk shared by the node's ranks and workers).

    A run's training stream comes from its ``data`` section (:meth:`from_config`); the keyword
    arguments are for callers that choose their own (validation, Admin's profiling, ``megakd eval-rtd``,
    tools and tests).
    """

    def __init__(
        self,
        shards_dir: str | Path | ShardStore,
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
        verify: bool = True,
        shuffle_shards: int = 16,
        read_overfetch: float = 0.2,
        read_block: int = 1,
        index_cache: str | Path | None = None,
    ) -> None:
        self.store = shards_dir if isinstance(shards_dir, ShardStore) else ShardStore(shards_dir)
        manifest = read_manifest(self.store)
        if check_tokenizer and manifest["tokenizer"]["vocab_hash"] != tokenizer.vocab_hash:
            raise UserError(f"{self.store.url(MANIFEST)}: shards were written with tokenizer vocab_hash "
                             f"{manifest['tokenizer']['vocab_hash']}, but tokenizer {tokenizer.path} has "
                             f"{tokenizer.vocab_hash}")
        _check_arguments(rank, world_size, micro_batch_size, num_workers, mask_prob, shuffle_shards, read_block)
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.bad_shards: dict[str, str] = _bad_local_shards(self.store, manifest, skip_bad_shards)
        self.read_retries = 0  # transient storage errors retried so far by this rank's readers
        self.read_bytes = 0  # bytes this rank's readers fetched from storage so far (shards and indexes)
        self.read_requests = 0  # reads they asked of it (an object store charges and waits for each)
        self._fingerprint = hashlib.sha256(
            json.dumps([manifest["shards"], manifest["tokenizer"]], sort_keys=True).encode()).hexdigest()[:16]
        # The rank's workers read from an object store together (SharedRead), through node-local disk.
        shared_reads = Path(index_cache) / "shared-reads" / f"{self._fingerprint}-rank{rank}-of-{world_size}" \
            if index_cache and self.store.remote and manifest["version"] >= 2 and num_workers > 1 else None
        self.plan = ReadPlan(
            store=self.store,
            indexed=manifest["version"] >= 2,
            entries=tuple(manifest["shards"]),
            dtype=manifest["dtype"],
            total=manifest["num_samples"],
            seed=seed,
            rank=rank,
            world_size=world_size,
            micro_batch_size=micro_batch_size,
            masking=Masking(tokenizer.pad_id, tokenizer.mask_id, tuple(sorted(tokenizer.special_ids)), mask_prob,
                            tokenizer.cls_id if manifest.get("packed") else None),
            skip_bad_shards=skip_bad_shards,
            known_bad=frozenset(self.bad_shards),
            vocab_size=tokenizer.vocab_size,
            seq_len=manifest["seq_len"],
            verify=verify,
            shuffle_shards=shuffle_shards,
            overfetch=read_overfetch,
            read_block=read_block,
            index_cache=str(index_cache) if index_cache else None,
            shared_reads=str(shared_reads) if shared_reads else None,
        )
        if read_block > 1 and not manifest.get("shuffled"):
            logger.warning("%s: read_block=%d keeps %d consecutive samples of a shard together, but these shards "
                           "were written in input order (consecutive pieces of one document); write them with "
                           "`megakd data shards --shuffle` for mixed batches", self.store.url(MANIFEST), read_block,
                           read_block)
        self.seq_len: int = manifest["seq_len"]
        self.packed: bool = bool(manifest.get("packed", False))
        self.num_samples: int = manifest["num_samples"]
        self._next_batch = 0  # this rank's next micro-batch number (see the module docstring)
        # Asked every WAIT_POLL_S while DataLoader workers have no batch ready: true ends the wait
        # with StoppedWaitingForData (the training loop's stop flag; None: wait as long as it takes).
        self.stop_waiting: Callable[[], bool] | None = None
        self._datasets: weakref.WeakSet = weakref.WeakSet()  # those of the open iterators, for close()

    @classmethod
    def from_config(cls, data: DataConfig, shards: ShardStore, tokenizer: Tokenizer, *, micro_batch_size: int,
                    seed: int, rank: int = 0, world_size: int = 1, index_cache: str | Path | None = None,
                    pin_memory: bool = False) -> PretrainingLoader:
        """The training stream a run's data section describes; the rest is the run's: its micro-batch
        size, data-parallel rank and world size, train.seed, the node-local index cache."""
        return cls(shards, tokenizer, micro_batch_size=micro_batch_size, rank=rank, world_size=world_size,
                   num_workers=data.num_workers, seed=seed, mask_prob=data.mask_prob,
                   skip_bad_shards=data.skip_bad_shards, pin_memory=pin_memory, shuffle_shards=data.shuffle_shards,
                   read_overfetch=data.read_overfetch, read_block=data.read_block, index_cache=index_cache)

    @property
    def skipped_shards(self) -> int:
        """Distinct shards skipped so far on this rank (only with ``skip_bad_shards=True``)."""
        return len(self.bad_shards)

    def close(self, timeout: float = 2.0) -> None:
        """Give up the shard read-ahead of the iterators handed out so far, waiting up to ``timeout`` s
        for each to end (see :meth:`__iter__`): for the end of a run, a loader given up after an error,
        a test done with it. Nothing else changes: an iterator that goes on reads its next group when
        it gets there, and ``iter()`` starts at the loader's position as before."""
        for dataset in list(self._datasets):
            dataset.close(timeout)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """Micro-batches from this loader's position on.

        When the iterator ends (closed, dropped, or raising), the shard group its reader read ahead
        is given up at once (:meth:`close`): against a store that stopped answering, that read would
        otherwise go on retrying for a minute. The read-ahead of DataLoader workers ends with the
        worker processes, when the iterator is released (or at exit).
        """
        dataset = _RankDataset(self.plan, self._next_batch)
        self._datasets.add(dataset)
        # A private generator: DataLoader otherwise draws its base seed from the global RNG on
        # every iter(), which would shift dropout randomness and break bit-exact resume.
        loader = DataLoader(dataset, batch_size=None, num_workers=self.num_workers, pin_memory=self.pin_memory,
                            generator=torch.Generator().manual_seed(0),
                            worker_init_fn=_init_worker if self.num_workers else None,
                            timeout=WAIT_POLL_S if self.num_workers and self.stop_waiting else 0)
        self._clear_shared_reads()  # a crashed run's, or this loader's last pass's
        if self.store.remote:
            self._announce_first_read()
        with _stop_signals_blocked():  # workers start here, with the stop signals held back
            batches = iter(loader)
        if self.num_workers:
            _kill_leftover_workers_at_exit()
        try:
            while (record := self._next(batches)) is not None:
                if record.error is not None:
                    raise record.error
                self._next_batch = record.batch + 1
                retries, fetched, requests = record.io
                self.read_retries += retries
                self.read_bytes += fetched
                self.read_requests += requests
                for name, reason in record.bad:
                    self.bad_shards.setdefault(name, reason)
                if record.tensors is not None:
                    yield record.tensors
        finally:
            dataset.close()  # closed, dropped or raising: the group read ahead is no one's now
            del batches  # DataLoader's workers stop here (not whenever the collector gets to them)
            self._clear_shared_reads()

    def _announce_first_read(self) -> None:
        """One line before the first batch from an object store: the rank's readers fetch their part of the
        shard group at this position (and the member indexes the node's cache lacks) before their first
        batches; later groups are read ahead meanwhile."""
        p = self.plan
        reader = SampleReader(p, [], prefetch=False)
        group = reader.group_at(*reader.group_of(p.batch_positions(self._next_batch)[0]))
        entries = [p.entries[shard] for shard in group.shards]
        if not p.indexed:  # each reader reads the group's shards whole
            size = sum(e["bytes"] for e in entries) * max(1, self.num_workers)
        else:
            size = 0.0
            for wanted, e in zip(reader.wanted(group, every=1, from_batch=self._next_batch), entries):
                if len(wanted):
                    cached = p.index_cache and (Path(p.index_cache) / e["index"]["sha256"]).is_file()
                    size += len(wanted) * e["bytes"] / e["samples"] + (0 if cached else e["index"]["bytes"])
        logger.info("reading shard group %d of epoch %d from %s before the first batch: %d shards, ~%.1f MB for "
                    "this rank", group.index, group.epoch, self.store, len(entries), size / 1e6)

    def _next(self, batches) -> ReadBatch | None:
        """The next batch (None at the end); while workers have none ready, ``stop_waiting`` is asked
        every WAIT_POLL_S (DataLoader's own timeout, which leaves its iterator as it was)."""
        while True:
            try:
                return next(batches)
            except StopIteration:
                return None
            except RuntimeError as error:
                if not str(error).startswith("DataLoader timed out") or self.stop_waiting is None:
                    raise
                if self.stop_waiting():
                    # The workers are mid-read (stalled, or retrying) and would be joined for 5 s each
                    # before DataLoader gives up on them: they ignore stop signals, so end them now.
                    for worker in getattr(batches, "_workers", ()):  # DataLoader's worker processes
                        worker.kill()
                    raise StoppedWaitingForData("a stop was asked for while the workers read") from None

    def _clear_shared_reads(self) -> None:
        """Empty this rank's shared-reads directory (its workers discard as they go; this takes what a
        pass leaves behind: the groups they were in when it ended). A worker still reading fetches again."""
        if self.plan.shared_reads:
            shutil.rmtree(self.plan.shared_reads, ignore_errors=True)

    @property
    def position(self) -> int:
        """Global position of this rank's next micro-batch grid point: ``next batch × world × micro-batch``."""
        return self._next_batch * self.plan.world_size * self.plan.micro_batch_size

    def state_dict(self) -> dict[str, Any]:
        """Position after the batches handed out so far (JSON-able)."""
        p = self.plan
        return {
            "version": STATE_VERSION,
            "data_fingerprint": self._fingerprint,
            "seed": p.seed,
            "mask_prob": p.masking.mask_prob,
            "read_block": p.read_block,
            "rank": p.rank,
            "world_size": p.world_size,
            "num_workers": self.num_workers,
            "micro_batch_size": p.micro_batch_size,
            "next_batch": self._next_batch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the saved loader stopped, in this loader's layout.

        Same world size, rank and micro-batch size: the saved batch number. Otherwise the saved
        global position, which must fall on this layout's grid of ``world × micro-batch`` samples.
        The worker count never matters. Another seed, mask rate or data set is refused.
        """
        mine = self.state_dict()
        if state.get("version") != STATE_VERSION:
            raise UserError(f"loader state: version {state.get('version')!r} (written by an older megakd with "
                             f"per-slot cursors), expected {STATE_VERSION}")
        for key in ("data_fingerprint", "seed", "mask_prob", "read_block"):
            if state.get(key, 1 if key == "read_block" else None) != mine[key]:  # states before read_block had 1
                raise UserError(f"loader state: {key}={state.get(key)!r} does not match this loader's {mine[key]!r}")
        self.close(timeout=0)  # a position set anew: what open iterators read ahead is no one's now
        if all(state.get(k) == mine[k] for k in ("world_size", "rank", "micro_batch_size")):
            self._next_batch = int(state["next_batch"])
            return
        position, grid = int(state["position"]), self.plan.world_size * self.plan.micro_batch_size
        if position % grid:
            raise UserError(f"loader state: global position {position} (world_size={state.get('world_size')} x "
                             f"micro_batch_size={state.get('micro_batch_size')} x {state.get('next_batch')} batches) "
                             f"is not a multiple of world_size={self.plan.world_size} x "
                             f"micro_batch_size={self.plan.micro_batch_size}")
        self._next_batch = position // grid
