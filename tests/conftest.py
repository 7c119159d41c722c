"""Shared fixtures: a small real tokenizer and real shards cut from the bundled corpus.

The session fixtures are built once per test run, not once per pytest-xdist worker (`built_once`):
each is read-only for the tests that share it (copy it before changing it).
"""

from __future__ import annotations

import gzip
import itertools
import os
from collections import Counter
from pathlib import Path

import pytest

# Triton reads this once, at import, and DeepSpeed imports Triton while test modules are being
# collected: set it here, before anything, so the kernel tests' interpreter path works in a full
# run too. `auto` never picks the interpreter, so nothing else changes.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

from tests.helpers import TINY_SEQ_LEN, TINY_VOCAB, built_once

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: torch's default of a thread per core would run four on two. Set before
    # torch is imported, and inherited by the commands the tests start.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """Files with more slow tests first. Under pytest-xdist each worker takes a file at a time
    (`--dist loadfile`), so a long file that started last would run alone at the end."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])  # stable: each file keeps its own order


LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR",
                      "MASTER_PORT")


@pytest.fixture(autouse=True)
def _launcher_variables_stay_put():
    """A test that builds a DeepSpeed backend in this process leaves `LOCAL_RANK` set (DeepSpeed wants it);
    under xdist the next test in the worker may be another file's, which would then think a launcher
    started it (HF's Trainer, `backend: auto`). Each test gets back the variables it started with."""
    saved = {k: os.environ.get(k) for k in LAUNCHER_VARIABLES}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """(tokenizer_dir, shards_dir): 512-piece SentencePiece BPE and seq-64 shards from ~300 KB of Austen."""
    from megakd.data.default_corpus import CORPUS_DIR
    from megakd.data.shards import write_shards
    from megakd.data.tokenizer import train_tokenizer

    def build(root: Path) -> None:
        text = root / "slice.jsonl"
        with gzip.open(CORPUS_DIR / "austen.jsonl.gz", "rt", encoding="utf-8") as src:
            text.write_text("".join(itertools.islice(src, 20)))
        tok = train_tokenizer([text], TINY_VOCAB, root / "tokenizer")
        write_shards([text], tok, TINY_SEQ_LEN, root / "shards", samples_per_shard=256)

    root = built_once(tmp_path_factory, "tiny_data", build)
    return root / "tokenizer", root / "shards"


@pytest.fixture(scope="session")
def tiny_electra_run(tiny_data, tmp_path_factory):
    """A 2-step ELECTRA pretraining run on the tiny data (checkpoint + hf/ export), shared read-only."""
    from tests.helpers import tiny_overrides

    return _two_step_electra_run(tmp_path_factory, "tiny_electra_run",
                                 lambda run: tiny_overrides(tiny_data, run, **{"train.max_steps": 2}))


def _two_step_electra_run(tmp_path_factory, name, overrides):
    """`megakd pretrain -c configs/electra-tiny.yaml` with `overrides(run_dir)`; the run dir."""
    from megakd.cli import main

    config = Path(__file__).parents[1] / "configs" / "electra-tiny.yaml"

    def build(root: Path) -> None:
        assert main(["pretrain", "-c", str(config), *overrides(root / "run")]) == 0

    return built_once(tmp_path_factory, name, build) / "run"


@pytest.fixture(scope="session")
def wordpiece_data(tiny_data, tmp_path_factory):
    """(tokenizer_dir, shards_dir): an HF WordPiece `vocab.txt` (BERT's special layout) and seq-64 shards
    of the same Austen slice as `tiny_data`."""
    import json

    from megakd.data.shards import write_shards
    from megakd.data.tokenizer import Tokenizer
    from tests.helpers import wordpiece_vocab

    text = tiny_data[0].parent / "slice.jsonl"
    docs = [json.loads(line)["text"] for line in text.read_text(encoding="utf-8").splitlines()]

    def build(root: Path) -> None:
        (root / "tokenizer").mkdir()
        (root / "tokenizer" / "vocab.txt").write_text("\n".join(wordpiece_vocab(docs, 400)) + "\n", encoding="utf-8")
        write_shards([text], Tokenizer.load(root / "tokenizer"), TINY_SEQ_LEN, root / "shards", samples_per_shard=256)

    root = built_once(tmp_path_factory, "wordpiece_data", build)
    return root / "tokenizer", root / "shards"


@pytest.fixture(scope="session")
def wordpiece_electra_run(wordpiece_data, tmp_path_factory):
    """A 2-step ELECTRA run on the WordPiece data (checkpoint + hf/ export), shared read-only."""
    from tests.helpers import auto_vocab_overrides

    return _two_step_electra_run(tmp_path_factory, "wordpiece_electra_run",
                                 lambda run: auto_vocab_overrides(wordpiece_data, run, **{"train.max_steps": 2}))
