"""Pack tokenized documents into fixed-maximum-length samples and write WebDataset shards.

Cutting rule: a document's tokens are cut into consecutive chunks of at most ``seq_len - 2``
tokens, and each chunk becomes a piece ``[CLS] chunk [SEP]``. A chunk with fewer than
``min_tokens`` tokens (a document's short tail, or a short document) is not written; the manifest
counts such chunks and their tokens. By default each piece is one sample: samples never cross a
document boundary, and short documents leave most of a sample as padding.

With ``pack=True`` consecutive pieces (in corpus order) share a sample while they fit in
``seq_len`` (next-fit), so a short-document corpus fills its samples. Every piece keeps its own
``[CLS]`` and ``[SEP]``: a piece in a packed sample is token for token the sample it would be
unpacked, the model sees each document exactly as alone (the [CLS] feature a classifier reads is
the document's own), and the boundaries need no extra storage: [CLS] never comes out of encoding
text (`Tokenizer.encode` treats literal special-token text as ordinary text), so each [CLS] starts a segment
(:func:`megakd.data.masking.collate` turns them into ``segment_ids``). A piece of full length
still fills a sample alone, so a long document is still cut at sample boundaries.

Layout of ``out_dir``: ``shard-000000.tar`` ... and ``manifest.json``. Each tar member is
``{index:012d}.ids.npy``: a 1-D uint16 (vocab ≤ 65536) or uint32 array of token ids, keyed by the
sample's global index (its position in write order). Tar headers carry no time or owner, so the
same inputs, tokenizer and settings give byte-identical shards for any ``num_workers``.

Beside each shard, ``shard-000000.idx`` indexes its members (manifest version 2): per sample, in
order, the member's size in bytes (little-endian uint32; members are contiguous from offset 0)
and the first 8 bytes of the member's sha256. The manifest carries each index's sha256, so a
reader that fetches only some members (its share of the corpus, by ranged reads) still checks
every byte it uses against the manifest (docs/decisions.md § Reads proportional to the share).
Version-1 manifests (no index) are still read, whole shard by whole shard.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import tarfile
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from megakd.data.sources import expand_inputs, iter_documents
from megakd.data.storage import ShardStore, is_remote
from megakd.data.tokenizer import Tokenizer
from megakd.errors import UserError
from megakd.fsutil import atomic_output_dir

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "megakd-shards"
MANIFEST_VERSION = 2  # 2 = with member indexes; 1 (no index) is still read
INDEX_DTYPE = np.dtype([("size", "<u4"), ("digest", "V8")])  # one record per member, see the module docstring
_TASK_CHARS = 1 << 20  # documents are sent to workers in batches of about this many characters
# The writer's smallest possible shard: each sample is a tar header block plus at least one data
# block (the .npy header alone is 10+ bytes), and the archive ends with two zero blocks. Counts
# above what the bytes can hold are refused, so no reader sizes anything by an impossible count.
_MIN_SAMPLE_BYTES = 2 * tarfile.BLOCKSIZE
_END_OF_ARCHIVE = 2 * tarfile.BLOCKSIZE
# What one shard of a manifest may claim, checked before anything is sized from it on any store: a
# reader holds a shard group's sample order (8 bytes a sample) and a shard's index in memory, so an
# absurd count must be refused, not allocated. `data shards` writes 8,192 samples (~1 GB at seq 512).
MAX_SHARD_SAMPLES = 1 << 24
MAX_SHARD_BYTES = 1 << 40


def shard_name(i: int) -> str:
    return f"shard-{i:06d}.tar"


def index_name(shard: str) -> str:
    return shard.removesuffix(".tar") + ".idx"


def member_digest(member: bytes) -> bytes:
    """The 8 bytes of a member's sha256 that its index record holds."""
    return hashlib.sha256(member).digest()[:8]


def sample_key(index: int) -> str:
    return f"{index:012d}"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def next_fit(pieces: list[np.ndarray], seq_len: int) -> list[np.ndarray]:
    """Concatenate consecutive pieces into samples of at most ``seq_len`` tokens, in order."""
    samples: list[np.ndarray] = []
    current: list[np.ndarray] = []
    used = 0
    for piece in pieces:
        if used + len(piece) > seq_len:
            samples.append(np.concatenate(current))
            current, used = [], 0
        current.append(piece)
        used += len(piece)
    if current:
        samples.append(np.concatenate(current))
    return samples


def pack_document(ids: list[int], seq_len: int, cls_id: int, sep_id: int,
                  min_tokens: int) -> tuple[list[list[int]], int, int]:
    """Cut one document into samples; returns (samples, dropped_chunks, dropped_tokens)."""
    body = seq_len - 2
    samples, dropped_chunks, dropped_tokens = [], 0, 0
    for start in range(0, len(ids), body):
        chunk = ids[start : start + body]
        if len(chunk) < min_tokens:
            dropped_chunks += 1
            dropped_tokens += len(chunk)
            continue
        samples.append([cls_id, *chunk, sep_id])
    return samples, dropped_chunks, dropped_tokens


# Worker-process state: one tokenizer per process, loaded once.
_worker_tok: Tokenizer | None = None


def _init_worker(tokenizer_dir: str) -> None:
    global _worker_tok
    _worker_tok = Tokenizer.load(tokenizer_dir)


def _pack_batch(docs: list[str], seq_len: int, min_tokens: int, dtype: str, tok: Tokenizer | None = None) -> dict:
    tok = tok or _worker_tok
    assert tok is not None
    samples: list[list[int]] = []
    stats = {"documents": len(docs), "empty_documents": 0, "dropped_chunks": 0, "dropped_tokens": 0}
    for ids in tok.encode_batch(docs):
        if not ids:
            stats["empty_documents"] += 1
            continue
        s, dc, dt = pack_document(ids, seq_len, tok.cls_id, tok.sep_id, min_tokens)
        samples.extend(s)
        stats["dropped_chunks"] += dc
        stats["dropped_tokens"] += dt
    lengths = np.array([len(s) for s in samples], dtype=np.int64)
    flat = np.concatenate([np.asarray(s, dtype=dtype) for s in samples]) if samples else np.zeros(0, dtype)
    return {"flat": flat, "lengths": lengths, "stats": stats}


def in_valid_split(text: str, fraction: float) -> bool:
    """Whether a document belongs to the held-out split: a stable function of its text alone.

    sha256 of the UTF-8 text read as a number in [0, 1): the same document lands on the same side
    for any input order, file layout or number of workers.
    """
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def _doc_batches(sources: list[Path], text_field: str, counts: dict[str, int],
                 keep: Callable[[str], bool] | None = None) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for src in sources:
        for doc in iter_documents(src, text_field):
            if keep is not None and not keep(doc):
                continue
            counts[str(src)] = counts.get(str(src), 0) + 1
            batch.append(doc)
            chars += len(doc)
            if chars >= _TASK_CHARS:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


def _npy_header(length: int, dtype: np.dtype) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.zeros(length, dtype=dtype), allow_pickle=False)
    return buf.getvalue()[: -length * dtype.itemsize or None]


def tar_member(name: str, data: bytes) -> bytes:
    """One USTAR member exactly as ``tarfile`` writes it (mode 644, no owner, mtime 0).

    Built from a fixed header template with name, size and checksum patched in: ``TarInfo.tobuf``
    costs ~30 µs a call, and the shard writer's single ordered process pays it per sample.
    """
    header = bytearray(_TAR_TEMPLATE)
    raw = name.encode()
    if len(raw) > 100:
        raise ValueError(f"tar member name {name!r} longer than 100 bytes")
    header[0 : len(raw)] = raw
    header[124:136] = b"%011o\0" % len(data)
    header[148:156] = b" " * 8
    header[148:155] = b"%06o\0" % sum(header)
    return bytes(header) + data + bytes(-len(data) % tarfile.BLOCKSIZE)


def _tar_template() -> bytes:
    info = tarfile.TarInfo("")
    info.mode, info.mtime = 0o644, 0
    return info.tobuf(tarfile.USTAR_FORMAT)


_TAR_TEMPLATE = _tar_template()


class _ShardWriter:
    """Collects samples and writes full shards in order, with deterministic tar headers."""

    def __init__(self, out: Path, samples_per_shard: int, pack_len: int | None = None, shuffle: bool = False) -> None:
        self.out = out
        self.shuffle = shuffle  # each shard's samples in a seeded permutation (a function of the shard number)
        self.samples_per_shard = samples_per_shard
        self.pack_len = pack_len  # None: one piece per sample; else pieces are packed up to this length
        self.open_pieces: list[np.ndarray] = []  # packing: pieces not yet known to complete a sample
        self.pieces = 0
        self.pending: list[np.ndarray] = []
        self.next_index = 0
        self.shards: list[dict[str, Any]] = []
        self.tokens = 0
        self._npy_headers: dict[tuple[int, str], bytes] = {}

    def add(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        pieces = [flat[offsets[i] : offsets[i + 1]] for i in range(len(lengths))]
        self.pieces += len(pieces)
        if self.pack_len is None:
            self._add_samples(pieces)
            return
        # Every sample but the last is final; the last may still take pieces of the next batch.
        samples = next_fit(self.open_pieces + pieces, self.pack_len)
        self._add_samples(samples[:-1])
        self.open_pieces = [samples[-1]] if samples else []

    def finish(self) -> None:
        """Write the open packed sample and the last, partial shard."""
        self._add_samples(self.open_pieces)
        self.open_pieces = []
        self.flush()

    def _add_samples(self, samples: list[np.ndarray]) -> None:
        for sample in samples:
            self.pending.append(sample)
            if len(self.pending) == self.samples_per_shard:
                self.flush()

    def _npy(self, arr: np.ndarray) -> bytes:
        key = (len(arr), arr.dtype.str)
        if key not in self._npy_headers:
            self._npy_headers[key] = _npy_header(len(arr), arr.dtype)
        return self._npy_headers[key] + arr.tobytes()

    def flush(self) -> None:
        if not self.pending:
            return
        name = shard_name(len(self.shards))
        path = self.out / name
        first = self.next_index
        if self.shuffle:
            order = np.random.default_rng([len(self.shards), 0x5EED]).permutation(len(self.pending))
            self.pending = [self.pending[j] for j in order]
        digest, size = hashlib.sha256(), 0
        index = np.zeros(len(self.pending), INDEX_DTYPE)
        with open(path, "wb") as f:
            def put(block: bytes) -> None:
                nonlocal size
                f.write(block)
                digest.update(block)
                size += len(block)

            for j, arr in enumerate(self.pending):
                member = tar_member(f"{sample_key(first + j)}.ids.npy", self._npy(arr))
                index[j] = (len(member), member_digest(member))
                put(member)
                self.tokens += len(arr)
            # End of archive as tarfile writes it: two zero blocks, then zeros up to a full record.
            put(bytes(2 * tarfile.BLOCKSIZE))
            put(bytes(-size % tarfile.RECORDSIZE))
        index_bytes = index.tobytes()
        (self.out / index_name(name)).write_bytes(index_bytes)
        self.shards.append({"file": name, "samples": len(self.pending), "first_index": first,
                            "bytes": size, "sha256": digest.hexdigest(),
                            "index": {"file": index_name(name), "bytes": len(index_bytes),
                                      "sha256": hashlib.sha256(index_bytes).hexdigest()}})
        self.next_index += len(self.pending)
        self.pending = []


def _tokenize_into(writer: _ShardWriter, batches: Iterator[list[str]], tokenizer: Tokenizer, seq_len: int,
                   min_tokens: int, dtype: str, num_workers: int) -> dict[str, int]:
    """Tokenize and chunk each batch of documents (in ``num_workers`` processes when more than one), add
    the pieces to ``writer`` in batch order, and return the documents' and dropped chunks' counts."""
    stats = {"documents": 0, "empty_documents": 0, "dropped_chunks": 0, "dropped_tokens": 0}

    def consume(result: dict) -> None:
        for k, v in result["stats"].items():
            stats[k] += v
        writer.add(result["flat"], result["lengths"])

    if num_workers == 1:
        for docs in batches:
            consume(_pack_batch(docs, seq_len, min_tokens, dtype, tokenizer))
        return stats
    with ProcessPoolExecutor(num_workers, initializer=_init_worker, initargs=(str(tokenizer.path),)) as pool:
        # Bounded in-flight queue: Executor.map would read the whole corpus ahead.
        inflight: deque[Future] = deque()
        for docs in batches:
            inflight.append(pool.submit(_pack_batch, docs, seq_len, min_tokens, dtype))
            if len(inflight) >= 2 * num_workers:
                consume(inflight.popleft().result())
        while inflight:
            consume(inflight.popleft().result())
    return stats


def write_shards(
    inputs: list[str | Path],
    tokenizer: Tokenizer,
    seq_len: int,
    out_dir: str | Path,
    *,
    samples_per_shard: int = 8192,
    num_workers: int = 1,
    text_field: str = "text",
    min_tokens: int = 8,
    keep: Callable[[str], bool] | None = None,
    pack: bool = False,
    shuffle: bool = False,
) -> dict:
    """Tokenize and pack ``inputs`` into WebDataset shards in ``out_dir``; returns the manifest.

    ``pack`` puts several short documents into one sample (see the module docstring). ``shuffle``
    writes each shard's samples in a seeded permutation instead of input order, so that a run of
    consecutive samples is a random subset of the shard (what ``data.read_block`` > 1 reads together).

    ``num_workers`` processes tokenize batches of documents; results are consumed in submission
    order, so the output does not depend on the number of workers. The whole directory is built
    under a temporary sibling name and renamed at the end: a killed run leaves no half-written
    shards under ``out_dir``. An existing non-empty ``out_dir`` is an error, never overwritten.
    ``keep`` (a predicate on a document's text) writes only the documents it accepts: the
    train/validation split of :func:`in_valid_split`.
    """
    if is_remote(out_dir):
        return _write_remote(inputs, tokenizer, seq_len, str(out_dir), samples_per_shard=samples_per_shard,
                             num_workers=num_workers, text_field=text_field, min_tokens=min_tokens, keep=keep,
                             pack=pack, shuffle=shuffle)
    out = Path(out_dir)
    if seq_len < 3:
        raise UserError(f"seq_len={seq_len}: expected at least 3 ([CLS], one token, [SEP])")
    if not 1 <= min_tokens <= seq_len - 2:
        raise UserError(f"min_tokens={min_tokens}: expected 1..seq_len-2={seq_len - 2}")
    if samples_per_shard < 1 or num_workers < 1:
        raise UserError(f"samples_per_shard={samples_per_shard}, num_workers={num_workers}: expected ≥ 1")
    sources = expand_inputs(inputs)
    dtype = token_dtype(tokenizer.vocab_size).name
    with atomic_output_dir(out) as tmp:
        writer = _ShardWriter(tmp, samples_per_shard, seq_len if pack else None, shuffle)
        doc_counts: dict[str, int] = {}
        batches = _doc_batches(sources, text_field, doc_counts, keep)
        stats = _tokenize_into(writer, batches, tokenizer, seq_len, min_tokens, dtype, num_workers)
        writer.finish()
        if writer.next_index == 0:
            raise UserError(f"inputs {[str(s) for s in sources]}: produced no samples "
                             f"(every document shorter than min_tokens={min_tokens})")
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "seq_len": seq_len,
            "dtype": dtype,
            "min_tokens": min_tokens,
            "samples_per_shard": samples_per_shard,
            "num_samples": writer.next_index,
            "total_tokens": writer.tokens,
            "mean_fill": round(writer.tokens / (writer.next_index * seq_len), 6),
            "packed": pack,
            "shuffled": shuffle,
            "pieces": writer.pieces,  # [CLS] chunk [SEP] pieces; = num_samples unless packed
            "tokenizer": {"kind": tokenizer.kind, "vocab_hash": tokenizer.vocab_hash,
                          "vocab_size": tokenizer.vocab_size, **tokenizer.special_layout()},
            "sources": [{"path": str(s), "documents": doc_counts.get(str(s), 0)} for s in sources],
            **stats,
            "shards": writer.shards,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    logger.info("wrote %d samples in %d shards to %s (mean fill %.3f, %d short chunks dropped)",
                manifest["num_samples"], len(manifest["shards"]), out, manifest["mean_fill"],
                manifest["dropped_chunks"])
    return manifest


def _write_remote(inputs: list[str | Path], tokenizer: Tokenizer, seq_len: int, url: str, **options: Any) -> dict:
    """Write the shards in a local staging directory, then upload them under ``url``, manifest last.

    The prefix must hold no object yet (nothing is overwritten); until the manifest lands, readers
    find no data set there, so an interrupted upload is never taken for a complete one.
    """
    store = ShardStore(url)
    if not store.is_empty():
        raise UserError(f"{url}: holds objects already; expected an unused prefix (nothing is overwritten)")
    with tempfile.TemporaryDirectory(prefix="megakd-shards-") as staging:
        local = Path(staging) / "out"
        manifest = write_shards(inputs, tokenizer, seq_len, local, **options)
        store.upload(local, last=MANIFEST)
    return manifest


def read_manifest(shards: str | Path | ShardStore) -> dict:
    """Read and validate ``manifest.json``; errors name the file, the entry and the problem (values cut
    to 100 characters).

    Besides the layout (format, keys and their types, a non-empty shard list, integer sample counts
    that the shard sizes can hold), every shard entry must name a file inside the shards directory
    (no absolute path, no ``..``, no symlink leading out) and carry a real sha256 (and, from version
    2, its index's): the loader checks each shard against it, so an all-zero or malformed digest is
    refused here.
    """
    store = shards if isinstance(shards, ShardStore) else ShardStore(shards)
    path = store.url(MANIFEST)
    try:
        raw = store.read(MANIFEST)
    except FileNotFoundError:
        raise FileNotFoundError(f"shards {store}: missing {MANIFEST}") from None
    except IsADirectoryError:
        raise FileNotFoundError(f"shards {store}: {MANIFEST} is a directory") from None
    try:
        m = json.loads(raw.decode("utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a JSON text file (not UTF-8)") from None
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT or m.get("version") not in (1, MANIFEST_VERSION):
        got = (m.get("format"), m.get("version")) if isinstance(m, dict) else (None, None)
        raise UserError(f"{path}: expected format {MANIFEST_FORMAT!r} version 1 or {MANIFEST_VERSION}, "
                        f"got {got[0]!r} version {got[1]!r}")
    for key in ("seq_len", "dtype", "num_samples", "tokenizer", "shards"):
        if key not in m:
            raise UserError(f"{path}: missing key {key!r}")
    if not _is_int(m["seq_len"]) or m["seq_len"] < 3:
        raise UserError(f"{path}: seq_len={m['seq_len']!r:.100}, expected an integer >= 3")
    if m["dtype"] not in ("uint16", "uint32"):
        raise UserError(f"{path}: dtype={m['dtype']!r:.100}, expected 'uint16' or 'uint32'")
    if not isinstance(m["tokenizer"], dict) or not isinstance(m["tokenizer"].get("vocab_hash"), str):
        raise UserError(f"{path}: tokenizer={m['tokenizer']!r:.100}, expected a mapping with a 'vocab_hash' string")
    if not _is_int(m["num_samples"]) or m["num_samples"] < 1:
        raise UserError(f"{path}: num_samples={m['num_samples']!r:.100}, expected an integer >= 1")
    if not isinstance(m["shards"], list) or not m["shards"]:
        raise UserError(f"{path}: shards={m['shards']!r:.100}, expected a non-empty list of entries")
    first = 0
    for s in m["shards"]:
        _check_shard_entry(store, s)
        if not _is_int(s.get("first_index")) or s["first_index"] != first or not _is_int(s.get("samples")) \
                or s["samples"] < 1:
            raise UserError(f"{path}: shard entry {s.get('file')!r} has inconsistent first_index/samples")
        if s["samples"] > (s["bytes"] - _END_OF_ARCHIVE) // _MIN_SAMPLE_BYTES:
            raise UserError(f"{path}: shard {s['file']!r} has samples={s['samples']}, more than its "
                            f"bytes={s['bytes']} can hold (at most (bytes - {_END_OF_ARCHIVE}) // "
                            f"{_MIN_SAMPLE_BYTES})")
        if s["samples"] > MAX_SHARD_SAMPLES or s["bytes"] > MAX_SHARD_BYTES:
            raise UserError(f"{path}: shard {s['file']!r} has samples={s['samples']} and bytes={s['bytes']}, expected "
                            f"at most {MAX_SHARD_SAMPLES} samples and {MAX_SHARD_BYTES} bytes per shard")
        first += s["samples"]
    if first != m["num_samples"]:
        raise UserError(f"{path}: shard sample counts sum to {first}, num_samples says {m['num_samples']}")
    for s in m["shards"] if m["version"] >= 2 else []:
        _check_index_entry(store, s)
    return m


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_file_entry(store: ShardStore, entry: Any, what: str) -> None:
    """A manifest entry naming a file: one that stays inside the shards dir, a size and a real sha256."""
    manifest = store.url(MANIFEST)
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or not entry["file"]:
        raise UserError(f"{manifest}: {what} entry {entry!r:.100} has no 'file' name")
    name = entry["file"]
    if Path(name).is_absolute() or ".." in Path(name).parts or "://" in name:
        raise UserError(f"{manifest}: {what} file {name!r:.100} must be a relative path inside {store} (no '..')")
    if not store.remote:
        root = store.local_path
        if not (root / name).resolve().is_relative_to(root.resolve()):
            raise UserError(f"{manifest}: {what} file {name!r} resolves to {(root / name).resolve()}, outside "
                            f"{root} (a symlink leading out of the shards directory)")
    if not _is_int(entry.get("bytes")) or entry["bytes"] < 0:
        raise UserError(f"{manifest}: {what} {name!r} has bytes={entry.get('bytes')!r:.100}, expected a size in bytes")
    digest = entry.get("sha256")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest) or not digest.strip("0"):
        raise UserError(f"{manifest}: {what} {name!r} has sha256={digest!r:.100}, expected 64 lowercase hex digits "
                        f"(not all zero)")


def _check_shard_entry(store: ShardStore, entry: Any) -> None:
    _check_file_entry(store, entry, "shard")


def _check_index_entry(store: ShardStore, entry: dict) -> None:
    """Version 2: the shard's member index, one record per sample."""
    index = entry.get("index")
    _check_file_entry(store, index, f"index of shard {entry['file']!r}:")
    if not _is_int(entry.get("samples")) or index["bytes"] != entry["samples"] * INDEX_DTYPE.itemsize:
        raise UserError(f"{store.url(MANIFEST)}: index {index['file']!r} has bytes={index['bytes']}, expected "
                        f"{INDEX_DTYPE.itemsize} per sample x samples={entry.get('samples')!r:.100}")

