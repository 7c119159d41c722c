"""Published outputs get the permissions a plain open() or mkdir() gives under the umask (docs/reliability.md).

Libraries write through private temporary files (safetensors: mkstemp's 0600) and atomic outputs are
built in mkdtemp's 0700 directories; published like that, a colleague on a shared filesystem cannot
load an export. Each row runs the real writers under umask 0022 and 0077 (the fast rows also 0002,
a group-shared project's) and checks every file and directory they leave.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from make_glue_data import write_glue_data
from megakd import fsutil
from megakd.cli import main
from megakd.convert import to_hf
from megakd.data import default_corpus
from megakd.data.tokenizer import Tokenizer
from megakd.engine.runlog import append_whole
from megakd.models.electra import Discriminator, MaskedLM, SequenceClassifier
from megakd.models.encoder import EncoderConfig
from megakd.store import checkpoint
from megakd.store.files import save_weights
from megakd.store.model_dir import save_classifier, save_model_dir
from megakd.store.rundir import RunDirLock
from tests.helpers import TINY_SEQ_LEN, TINY_VOCAB, tiny_overrides

ROOT = Path(__file__).parents[2]
MODES = [pytest.param(0o022, 0o644, 0o755, id="umask-022"), pytest.param(0o077, 0o600, 0o700, id="umask-077")]
GROUP_SHARED = pytest.param(0o002, 0o664, 0o775, id="umask-002")  # also catches a writer's hard-coded 0o644


@contextmanager
def _umask(mask: int) -> Iterator[None]:
    """The process's umask set to `mask` for the block (process-wide state: always put back)."""
    before = os.umask(mask)
    try:
        yield
    finally:
        os.umask(before)


def _wrong_modes(root: Path, file_mode: int, dir_mode: int) -> dict[str, str]:
    """{path under `root`: its mode} for every file or directory whose permissions are not the expected ones."""
    wrong = {}
    for path in (root, *root.rglob("*")):
        mode = stat.S_IMODE(path.lstat().st_mode)
        if mode != (dir_mode if path.is_dir() else file_mode):
            wrong[str(path.relative_to(root))] = oct(mode)
    return wrong


@pytest.mark.parametrize("source", ["proc", "os.umask"])
def test_the_umask_is_read_without_changing_it(source, monkeypatch):
    """/proc/self/status where Linux has it; elsewhere os.umask, set and put back."""
    if source == "os.umask":
        monkeypatch.setattr(fsutil, "_STATUS", "/nonexistent/status")
    with _umask(0o027):
        assert fsutil.umask() == 0o027
        assert os.umask(0o027) == 0o027


@pytest.mark.parametrize("mask, file_mode, dir_mode", [*MODES, GROUP_SHARED])
def test_every_store_writer_publishes_with_the_umasks_modes(mask, file_mode, dir_mode, tiny_data, tmp_path,
                                                            monkeypatch):
    """The writers under the commands, in one process: the bundled corpus's cache entry (tokenizer and
    shards), model and classifier directories, both HF export flavours, a run's lock, metrics and checkpoint."""
    text = tiny_data[0].parent / "slice.jsonl"
    monkeypatch.setattr(default_corpus, "bundled_corpus_files", lambda corpus: [text])  # a slice: under a second
    config = EncoderConfig(vocab_size=TINY_VOCAB, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                           max_position_embeddings=TINY_SEQ_LEN)
    out = tmp_path / "out"
    with _umask(mask):
        out.mkdir()
        tokenizer_dir, _ = default_corpus.prepare_default_data(out / "cache", vocab_size=TINY_VOCAB,
                                                                seq_len=TINY_SEQ_LEN)
        save_model_dir(MaskedLM(config), "masked_lm", out / "mlm", tokenizer_dir=tokenizer_dir)
        to_hf(out / "mlm", out / "hf-native")  # transformers' save_pretrained
        relative = dataclasses.replace(config, position_encoding="t5_relative")
        save_model_dir(Discriminator(relative), "discriminator", out / "relative", tokenizer_dir=tokenizer_dir)
        to_hf(out / "relative", out / "hf-remote-code")  # safetensors' save_file
        save_classifier(SequenceClassifier(config, 2), Tokenizer.load(tokenizer_dir), out / "classifier")
        with RunDirLock(out / "run") as lock:
            lock.announce()
            append_whole(out / "run" / "metrics.jsonl", b"{}\n")
            tmp, final = checkpoint.begin(out / "run", 1, True)
            save_weights({"w": torch.zeros(2)}, tmp / "model.safetensors")
            checkpoint.commit(tmp, final, 1, keep_last=1)
    assert _wrong_modes(out, file_mode, dir_mode) == {}


def test_a_setgid_parent_still_hands_its_group_down(tmp_path):
    """A shared directory's setgid bit, which mkdtemp's directory inherits, survives publishing: the
    output's later files keep the shared group."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o2775)
    with fsutil.atomic_output_dir(shared / "out") as tmp:
        (tmp / "file").write_text("x")
    assert (shared / "out").stat().st_mode & stat.S_ISGID


@pytest.mark.slow
@pytest.mark.parametrize("mask, file_mode, dir_mode", MODES)
def test_a_pretraining_run_and_glue_publish_with_the_umasks_modes(mask, file_mode, dir_mode, tiny_data, tmp_path):
    """The commands end to end: a pretraining run's checkpoint, hf/ export, config, metrics and plots;
    then GLUE on that export: seed_*/model, task and results files, the submission and its zip."""
    out = tmp_path / "out"
    with _umask(mask):
        out.mkdir()
        assert main(["pretrain", "-c", str(ROOT / "configs" / "electra-tiny.yaml"),
                     *tiny_overrides(tiny_data, out / "run", **{"train.max_steps": 2, "run.plots": "true"})]) == 0
        data = write_glue_data(out / "glue_data", "glue", ["rte"], train=8, dev=4, test=4)
        assert main(["glue", "-c", str(ROOT / "configs" / "glue.yaml"), f"model.path={out}/run/hf/discriminator",
                     f"glue.data_dir={data}", f"run.dir={out}/glue", "glue.tasks=[rte]", "finetune.seeds=[1]",
                     "finetune.epochs=1", "glue.long_epochs=1", "finetune.batch_size=4", "finetune.max_seq_len=32",
                     "run.progress_bar=false", "run.tensorboard=false"]) == 0
    assert (out / "run" / "plots").is_dir() and (out / "glue" / "submission.zip").is_file()
    assert _wrong_modes(out, file_mode, dir_mode) == {}
