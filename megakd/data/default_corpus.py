"""The bundled default corpus (Austen + KJV, see corpus/README.md), ready for the tiny demo."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from megakd.data.shards import MANIFEST, write_shards
from megakd.data.tokenizer import META_FILE, train_tokenizer

logger = logging.getLogger(__name__)

CORPUS_DIR = Path(__file__).parent / "corpus"
PRETRAINING_FILES = ("austen.jsonl.gz", "kjv.jsonl.gz")
SENTIMENT_FILE = CORPUS_DIR / "rt_sentences.tsv.gz"
# Bump when the tokenizer or shard format changes, so old caches are not reused.
_CACHE_VERSION = 1
_SAMPLES_PER_SHARD = 1024  # ~16 shards at seq_len 128: enough for several ranks x workers


def default_corpus_files() -> list[Path]:
    return [CORPUS_DIR / f for f in PRETRAINING_FILES]


def _corpus_digest() -> str:
    h = hashlib.sha256(f"v{_CACHE_VERSION}".encode())
    for path in default_corpus_files():
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _complete(entry: Path) -> bool:
    return (entry / "tokenizer" / META_FILE).is_file() and (entry / "shards" / MANIFEST).is_file()


def prepare_default_data(cache_dir: str | Path, *, vocab_size: int, seq_len: int, seed: int = 0,
                         num_workers: int = 1) -> tuple[Path, Path]:
    """Return (tokenizer_dir, shards_dir) for the bundled corpus, building them once per setting.

    The cache entry is keyed by the parameters and a digest of the corpus files, built in a
    temporary directory and renamed into place, so a killed build never leaves a half entry and
    concurrent builders (e.g. several ranks) end with one complete copy.
    """
    cache = Path(cache_dir)
    entry = cache / f"default-v{vocab_size}-L{seq_len}-s{seed}-{_corpus_digest()}"
    if _complete(entry):
        return entry / "tokenizer", entry / "shards"
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.partial-", dir=cache))
    tmp.chmod(0o755)
    try:
        files = default_corpus_files()
        tok = train_tokenizer(files, vocab_size, tmp / "tokenizer", seed=seed)
        write_shards(files, tok, seq_len, tmp / "shards", samples_per_shard=_SAMPLES_PER_SHARD,
                     num_workers=num_workers)
        try:
            os.replace(tmp, entry)
        except OSError:
            if not _complete(entry):  # lost a race to a builder that did not finish: a real error
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("built default data in %s", entry)
    return entry / "tokenizer", entry / "shards"
