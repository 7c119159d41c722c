"""Small real fixtures shared by the data tests: a tokenizer and shards built from corpus slices."""

from __future__ import annotations

import gzip
import hashlib
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from megakd.data.default_corpus import default_corpus_files
from megakd.data.shards import INDEX_DTYPE, MANIFEST, write_shards
from megakd.data.tokenizer import Tokenizer, train_tokenizer


def corpus_docs(n_austen: int, n_kjv: int) -> list[str]:
    austen, kjv = default_corpus_files()
    a = [json.loads(line)["text"] for line in gzip.open(austen, "rt", encoding="utf-8")][:n_austen]
    k = [json.loads(line)["text"] for line in gzip.open(kjv, "rt", encoding="utf-8")][:n_kjv]
    return a + k


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def corpus_jsonl(tmp_path_factory) -> Path:
    """~400 KB: 12 Austen chapters and 40 KJV passages."""
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "slice.jsonl", corpus_docs(12, 40))


@pytest.fixture(scope="session")
def tokenizer(corpus_jsonl, tmp_path_factory) -> Tokenizer:
    return train_tokenizer([corpus_jsonl], 600, tmp_path_factory.mktemp("tok") / "tok")


@pytest.fixture(scope="session")
def small_shards(tokenizer, tmp_path_factory) -> Path:
    """A few hundred samples in shards of 37 (counts that divide nothing), for loader tests."""
    src = write_jsonl(tmp_path_factory.mktemp("small") / "small.jsonl", corpus_docs(2, 6))
    out = tmp_path_factory.mktemp("shards") / "small"
    write_shards([src], tokenizer, 64, out, samples_per_shard=37)
    return out


def unindexed(shards_dir: Path) -> Path:
    """Turn the shards at ``shards_dir`` (a copy: edited in place) into a version-1 data set, as written
    before member indexes: no .idx files, no "index" keys, "version": 1. Returns ``shards_dir``."""
    shards_dir = Path(shards_dir)
    m = json.loads((shards_dir / MANIFEST).read_text())
    for entry in m["shards"]:
        (shards_dir / entry.pop("index")["file"]).unlink()
    m["version"] = 1
    (shards_dir / MANIFEST).write_text(json.dumps(m, indent=1))
    return shards_dir


def shard_entry(shards_dir: Path, name: str) -> dict:
    m = json.loads((Path(shards_dir) / MANIFEST).read_text())
    return next(s for s in m["shards"] if s["file"] == name)


def member_spans(shards_dir: Path, name: str) -> list[tuple[int, int]]:
    """(start, end) byte offsets of each member of shard ``name``, from its index (version 2)."""
    entry = shard_entry(shards_dir, name)
    sizes = np.frombuffer((Path(shards_dir) / entry["index"]["file"]).read_bytes(), INDEX_DTYPE)["size"]
    ends = np.cumsum(sizes.astype(np.int64)).tolist()
    return [(end - int(size), end) for end, size in zip(ends, sizes.tolist())]


def forge_member(shards_dir: Path, name: str, j: int, member: bytes) -> None:
    """Replace member ``j`` of shard ``name`` by ``member`` and make everything else agree with it, as
    a writer of hostile data would: the shard re-laid out (end-of-archive padding included), its
    index records (sizes and digests), and the manifest's shard and index sizes and sha256s."""
    shards_dir = Path(shards_dir)
    path = shards_dir / name
    data = path.read_bytes()
    members = [data[a:b] for a, b in member_spans(shards_dir, name)]
    members[j] = member
    body = b"".join(members) + bytes(2 * tarfile.BLOCKSIZE)
    body += bytes(-len(body) % tarfile.RECORDSIZE)
    path.write_bytes(body)
    index = np.zeros(len(members), INDEX_DTYPE)
    for k, m in enumerate(members):
        index[k] = (len(m), hashlib.sha256(m).digest()[:8])
    raw = index.tobytes()
    m = json.loads((shards_dir / MANIFEST).read_text())
    entry = next(s for s in m["shards"] if s["file"] == name)
    (shards_dir / entry["index"]["file"]).write_bytes(raw)
    entry.update(bytes=len(body), sha256=hashlib.sha256(body).hexdigest())
    entry["index"].update(bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest())
    (shards_dir / MANIFEST).write_text(json.dumps(m, indent=1))
