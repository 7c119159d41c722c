"""Reading one shard, whole or the members a reader wants, and checking every byte of it.

A shard is checked against its manifest entry: read whole, by the sha256 of the file hashed while
it is parsed; read by members, each member by the digest in the shard's (verified) index. Either
way every sample must fit the model (length, token ids). A damaged shard is a :class:`ShardError`
(skippable with ``skip_bad_shards``), a sample the model cannot take a :class:`BadSampleError`.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from webdataset.tariterators import base_plus_ext

from megakd.data.shards import INDEX_DTYPE, MANIFEST, member_digest, sample_key
from megakd.data.storage import ContentCache, ShardStore, StorageError, check_cancelled, transient
from megakd.errors import UserError


class ShardError(UserError):
    """A shard that is missing, truncated, corrupt or inconsistent with the manifest.

    With ``skip_bad_shards`` the loader logs, counts and skips such a shard.
    """


class BadSampleError(UserError):
    """A sample the model cannot take (token id outside the vocabulary, longer than ``seq_len``).

    The shard is intact (its sha256 matched), so it was written this way: with another tokenizer or
    another ``seq_len``. Skipping would only hide that, so this always stops the run.
    """


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
