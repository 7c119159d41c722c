"""The bundled corpora (see corpus/README.md), tokenized and sharded once into a cache.

Two named sets:

- ``classic``: Austen + KJV, ~1.5M words of 19th/17th-century English; the tiny smoke demo.
- ``mixed``: classic + modern English (Amazon review, NYT editorial and tweet snippets; WordNet
  adjective/adverb/verb glosses) + the *training* sentences of the bundled RT sentiment task,
  repeated (task-adaptive pretraining; RT dev sentences are never included). The mini recipe.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path

from megakd.data.shards import MANIFEST, write_shards
from megakd.data.tokenizer import META_FILE, train_tokenizer
from megakd.fsutil import OutputError, apply_umask, is_disk_full

logger = logging.getLogger(__name__)

CORPUS_DIR = Path(__file__).parent / "corpus"
PRETRAINING_FILES = ("austen.jsonl.gz", "kjv.jsonl.gz")
MODERN_FILES = ("snippets.jsonl.gz", "wordnet.jsonl.gz")
SENTIMENT_FILE = CORPUS_DIR / "rt_sentences.tsv.gz"
BUNDLED_CORPORA = ("classic", "mixed")
# The mixed corpus: RT training sentences, 20 to a document (shuffled, so a sample packs unrelated
# sentences as the task's own inputs are unrelated), repeated: task text is 24% of the tokens (4K vocabulary).
RT_TRAIN_SENTENCES_PER_DOCUMENT = 20
RT_TRAIN_REPEATS = 4
DEV_BYTE_THRESHOLD = 26  # of 256: ≈ 10% dev (`in_dev`, the split rule of the tasks built on this corpus)
# Bump when the tokenizer or shard format changes, so old caches are not reused.
_CACHE_VERSION = 1
_SAMPLES_PER_SHARD = 1024  # ~16 shards at seq_len 128: enough for several ranks x workers


def default_corpus_files() -> list[Path]:
    return [CORPUS_DIR / f for f in PRETRAINING_FILES]


def bundled_corpus_files(corpus: str) -> list[Path]:
    """The bundled files of a named set (the RT training text of ``mixed`` is built on top)."""
    if corpus not in BUNDLED_CORPORA:
        raise ValueError(f"data.corpus: expected one of {BUNDLED_CORPORA}, got {corpus!r}")
    names = PRETRAINING_FILES + (MODERN_FILES if corpus == "mixed" else ())
    return [CORPUS_DIR / f for f in names]


def in_dev(text: str) -> bool:
    """The fixed split rule: sha256 of the text, first byte below DEV_BYTE_THRESHOLD."""
    return hashlib.sha256(text.encode("utf-8")).digest()[0] < DEV_BYTE_THRESHOLD


def write_rt_train_documents(path: Path, *, repeats: int = RT_TRAIN_REPEATS) -> int:
    """Write the RT task's training sentences as JSONL documents; return the number of sentences.

    Uses the task's own split rule (`in_dev`), so no dev sentence can reach pretraining. Each repeat is a
    different seeded shuffle, so the packed samples differ between repeats.
    """
    with gzip.open(SENTIMENT_FILE, "rt", encoding="utf-8") as f:
        rows = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        train = [r["sentence"] for r in rows if not in_dev(r["sentence"])]
    n = RT_TRAIN_SENTENCES_PER_DOCUMENT
    with path.open("w", encoding="utf-8") as out:
        for seed in range(repeats):
            order = train[:]
            random.Random(seed).shuffle(order)
            for i in range(0, len(order), n):
                out.write(json.dumps({"text": "\n".join(order[i : i + n])}, ensure_ascii=False) + "\n")
    return len(train)


def _corpus_digest(corpus: str) -> str:
    h = hashlib.sha256(f"v{_CACHE_VERSION}".encode())
    if corpus != "classic":  # keeps the classic cache key of earlier versions
        h.update(f"{corpus}-rt{RT_TRAIN_REPEATS}x{RT_TRAIN_SENTENCES_PER_DOCUMENT}".encode())
        h.update(SENTIMENT_FILE.read_bytes())
    for path in bundled_corpus_files(corpus):
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _complete(entry: Path) -> bool:
    return (entry / "tokenizer" / META_FILE).is_file() and (entry / "shards" / MANIFEST).is_file()


def prepare_default_data(cache_dir: str | Path, *, vocab_size: int, seq_len: int, seed: int = 0,
                         num_workers: int = 1, corpus: str = "classic") -> tuple[Path, Path]:
    """Return (tokenizer_dir, shards_dir) for a bundled corpus, building them once per setting.

    The cache entry is keyed by the parameters and a digest of the corpus files, built in a
    temporary directory and renamed into place, so a killed build never leaves a half entry and
    concurrent builders (e.g. several ranks) end with one complete copy.
    """
    cache = Path(cache_dir)
    prefix = "default" if corpus == "classic" else corpus
    entry = cache / f"{prefix}-v{vocab_size}-L{seq_len}-s{seed}-{_corpus_digest(corpus)}"
    if _complete(entry):
        return entry / "tokenizer", entry / "shards"
    logger.info("building the bundled %s corpus's tokenizer and shards in %s: once, 5-10 s on 2 cores", corpus, entry)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.partial-", dir=cache))
    try:
        files = bundled_corpus_files(corpus)
        if corpus == "mixed":
            rt_train = tmp / "rt_train.jsonl"
            write_rt_train_documents(rt_train)
            files.append(rt_train)
        tok = train_tokenizer(files, vocab_size, tmp / "tokenizer", seed=seed)
        write_shards(files, tok, seq_len, tmp / "shards", samples_per_shard=_SAMPLES_PER_SHARD,
                     num_workers=num_workers)
        apply_umask(tmp)
        try:
            os.replace(tmp, entry)
        except OSError:
            if not _complete(entry):  # lost a race to a builder that did not finish: a real error
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, Exception) and is_disk_full(err):
            raise OutputError(f"{entry}: no space left on device while building the bundled corpus's tokenizer and "
                              "shards; the partial build was removed") from None
        raise
    logger.info("built default data in %s", entry)
    return entry / "tokenizer", entry / "shards"
