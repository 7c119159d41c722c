"""Shared fixtures: a small real tokenizer and real shards cut from the bundled corpus.

The session fixtures are built once per test run, not once per pytest-xdist worker (`built_once`):
each is read-only for the tests that share it (copy it before changing it).
"""

from __future__ import annotations

import gzip
import itertools
import os
import random
import sys
from collections import Counter
from pathlib import Path

import pytest

# Triton reads this once, at import, and DeepSpeed imports Triton while test modules are being
# collected: set it here, before anything, so the kernel tests' interpreter path works in a full
# run too. `auto` never picks the interpreter, so nothing else changes.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: torch's default of a thread per core would run four on two. Set before
    # torch is imported, and inherited by the commands the tests start.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
import torch._dynamo.mutation_guard
import torch.utils.data._utils.signal_handling

from tests import global_state
from tests.helpers import TINY_SEQ_LEN, TINY_VOCAB, built_once

# The tools are scripts (`python tools/x.py`), not a package: tests import them, and the support code the
# tools share with tests (tools/device_audit.py, tools/make_glue_data.py), by their bare names.
sys.path.append(str(Path(__file__).parents[1] / "tools"))

# What torch installs once per process, for good, on first use, installed before any test so that every
# test sees the same process whatever ran before it: the SIGCHLD handler of the first DataLoader with
# workers, and the nn.Module.__init__/__setstate__ wrappers of the first torch.compile (they tag each
# module for dynamo's guards and change nothing else).
torch.utils.data._utils.signal_handling._set_SIGCHLD_handler()
torch._dynamo.mutation_guard.install_generation_tagging_init()


def pytest_addoption(parser):
    parser.addoption("--shuffle-files", type=int, metavar="SEED",
                     help="run the test files in an order shuffled by SEED (each file's tests together, in their "
                          "own order): a test that passes only beside certain neighbours fails in some order")


def pytest_collection_modifyitems(config, items):
    """Files with more slow tests first. Under pytest-xdist each worker takes a file at a time
    (`--dist loadfile`), so a long file that started last would run alone at the end. With
    `--shuffle-files SEED` the files come in a shuffled order instead (the same on every worker)."""
    seed = config.getoption("--shuffle-files")
    if seed is not None:
        files = sorted({item.path for item in items})
        random.Random(seed).shuffle(files)
        position = {path: i for i, path in enumerate(files)}
        items.sort(key=lambda item: position[item.path])
        return
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])  # stable: each file keeps its own order


@pytest.fixture(autouse=True)
def _same_random_start():
    """Every test starts from seed 0, whatever ran before it in this worker: a test that draws without a
    seed of its own sees the same numbers in any order and beside any neighbour."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


_file_start: dict = {}  # the process-wide state when the running file's first test began
_changed_by: dict[str, str] = {}  # state key -> the test after which it first differed from _file_start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    if not _file_start:
        _file_start.update(global_state.snapshot())
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """A test file leaves the process as it found it (tests/global_state.py): a leak fails the file's
    last test, naming what changed and the test after which it first differed, and is put back, so
    the files after it in this worker do not see it."""
    result = yield
    changed = global_state.changes(_file_start, global_state.snapshot())
    for key in changed:
        _changed_by.setdefault(key, item.nodeid)
    if nextitem is not None and nextitem.path == item.path:
        return result
    before = dict(_file_start)
    _file_start.clear()
    if changed:
        global_state.restore(before, changed)
        culprits = sorted({_changed_by[key] for key in changed})
        _changed_by.clear()
        pytest.fail(f"{item.path.name} left process-wide state changed (now put back): "
                    f"{global_state.describe(changed)}; first seen after {', '.join(culprits)}", pytrace=False)
    _changed_by.clear()
    return result


@pytest.fixture
def wandb_torn_down(monkeypatch):
    """For a test that starts a wandb run: the wandb service it starts ends with the test (with it goes
    WANDB_SERVICE, which would point this worker's next wandb run at it), and the sys.exit and
    sys.excepthook wandb wraps when its service starts are put back."""
    import wandb

    monkeypatch.setattr(sys, "exit", sys.exit)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    yield
    wandb.teardown()


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
