"""Small real fixtures shared by the data tests: a tokenizer and shards built from corpus slices."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from megakd.data.default_corpus import default_corpus_files
from megakd.data.shards import write_shards
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
