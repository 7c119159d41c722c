"""Bad input to every command → exit 2 and one line naming the file or key; outputs not created.

Each row runs the real CLI in a fresh process on files made here (a garbage SentencePiece model,
an empty or binary corpus, an HF directory without or with garbage weights, megakd's own
remote-code export with a field removed, a size changed or garbage weights, a garbage config
file, non-finite config values) and checks the last stderr line, that no traceback was printed,
and that the command's output directory does not exist afterwards.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from megakd import cli
from megakd.cli import data as data_cli
from megakd.convert import save_hf_model
from megakd.errors import UserError
from megakd.models.electra import MaskedLM
from megakd.models.encoder import EncoderConfig
from tests.faults.harness import megakd, snapshot
from tests.helpers import tiny_overrides

BERT_CONFIG = {"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 100, "hidden_size": 32,
               "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
               "max_position_embeddings": 64, "hidden_act": "gelu", "type_vocab_size": 2}


def junk(n: int = 4000) -> bytes:
    return bytes((i * 167 + 89) % 256 for i in range(n))  # not UTF-8, not a protobuf, not a pickle


def edit_json(file: Path, edit) -> None:
    config = json.loads(file.read_text())
    edit(config)
    file.write_text(json.dumps(config))


def make_inputs(root: Path) -> None:
    (root / "badtok").mkdir()
    (root / "badtok" / "spm.model").write_bytes(junk())
    (root / "empty.txt").write_text("")
    (root / "junk.txt").write_bytes(junk())
    (root / "small.txt").write_text("a few words of text\n\n\nand another short document\n")
    for name, weights in (("hf-noweights", None), ("hf-garbage-safetensors", "model.safetensors"),
                          ("hf-garbage-bin", "pytorch_model.bin")):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(BERT_CONFIG))
        if weights:
            (root / name / weights).write_bytes(junk())
    for name in ("megakd-nofield", "megakd-resized", "megakd-garbage"):  # T5 relative: a remote-code export
        (root / name).mkdir()
        save_hf_model(MaskedLM(EncoderConfig(vocab_size=100, hidden_size=32, num_layers=1, num_heads=2,
                                             intermediate_size=64, position_encoding="t5_relative")),
                      "electra_generator", root / name, tokenizer_dir=None)
    edit_json(root / "megakd-nofield" / "config.json", lambda c: c.pop("relative_buckets"))
    edit_json(root / "megakd-resized" / "config.json", lambda c: c.update(intermediate_size=48))
    (root / "megakd-garbage" / "model.safetensors").write_bytes(junk())
    (root / "garbage.yaml").write_bytes(junk())
    (root / "list.yaml").write_text("- just\n- a list\n")


# (id, argv (paths relative to the test's directory), error-line pattern, output that must not appear)
ROWS = [
    ("garbage-spm-model", ["data", "shards", "--input", "small.txt", "--tokenizer", "badtok", "--seq-len", "64",
                           "--out", "out"], r"tokenizer badtok/spm.model: not a SentencePiece model \(", "out"),
    ("empty-corpus", ["data", "tokenizer", "--input", "empty.txt", "--vocab-size", "400", "--out", "out"],
     r"inputs \['empty.txt'\]: no text to train a tokenizer on \(empty corpus\)$", "out"),
    ("vocab-too-large", ["data", "tokenizer", "--input", "small.txt", "--vocab-size", "5000", "--out", "out"],
     r"--vocab-size 5000: too large for inputs \['small.txt'\], which support at most \d+ pieces", "out"),
    ("binary-corpus-tokenizer", ["data", "tokenizer", "--input", "junk.txt", "--vocab-size", "400", "--out", "out"],
     r"input junk.txt: not UTF-8 text \(invalid start byte at byte \d+ of a line\)$", "out"),
    ("from-hf-no-weights", ["convert", "from-hf", "hf-noweights", "out"],
     r"hf-noweights: no weights \(expected one of model.safetensors, .*beside config.json\)$", "out"),
    ("from-hf-garbage-safetensors", ["convert", "from-hf", "hf-garbage-safetensors", "out"],
     r"hf-garbage-safetensors/model.safetensors: cannot read as safetensors \(Error while deserializing header",
     "out"),
    ("from-hf-garbage-bin", ["convert", "from-hf", "hf-garbage-bin", "out"],
     r"hf-garbage-bin: cannot load the BertForMaskedLM weights \(Weights only load failed", "out"),
    ("from-hf-megakd-missing-field", ["convert", "from-hf", "megakd-nofield", "out"],
     r"megakd-nofield/config.json: relative_buckets: missing \(a MegakdForMaskedLM config.json lists every", "out"),
    ("from-hf-megakd-resized", ["convert", "from-hf", "megakd-resized", "out"],
     r"megakd-resized/model.safetensors: 'encoder.layers.0.\S+' has shape \[\d+(, \d+)?\] but "
     r"megakd-resized/config.json expects", "out"),
    ("from-hf-megakd-garbage-safetensors", ["convert", "from-hf", "megakd-garbage", "out"],
     r"megakd-garbage/model.safetensors: not a readable safetensors file \(", "out"),
    ("garbage-config-file", ["pretrain", "-c", "garbage.yaml", "run.dir=out"],
     r"\S+/garbage.yaml: not a YAML text file \(not UTF-8\)$", "out"),
    ("config-not-a-mapping", ["pretrain", "-c", "list.yaml", "run.dir=out"],
     r"\S+/list.yaml: expected a mapping at the top level$", "out"),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("inputs")
    make_inputs(root)
    return root


@pytest.mark.parametrize(("argv", "pattern", "output"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_input_is_one_line_exit_2(inputs, tmp_path, argv, pattern, output):
    work = tmp_path / "work"
    os.symlink(inputs, work)  # relative paths in the messages, as a user typing them would see
    before = snapshot(inputs)
    out = megakd(*argv, cwd=work)
    assert out.code == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    line = out.error_line()
    assert line.startswith("megakd: error: ") and re.search(pattern, line), line
    assert not (inputs / output).exists()
    assert snapshot(inputs) == before


CONFIG_ROWS = [
    ("override-typo", ["train.max_stepz=3"],
     r"unknown config key 'train.max_stepz'; did you mean 'train.max_steps'\? \(on the command line\)$"),
    ("override-inf-loss-weight", ["electra.loss_weight=.inf"],
     r"electra.loss_weight: expected a finite number, got inf \(on the command line\)$"),
    ("override-nan-lr", ["optim.generator.lr=.nan"],
     r"optim.generator.lr: expected a finite number, got nan \(on the command line\)$"),
    ("override-inf-clip", ["optim.discriminator.clip_norm=inf"],
     r"optim.discriminator.clip_norm: expected a finite number, got 'inf' \(on the command line\)$"),
    ("override-inf-temperature", ["distill.temperature=-.inf"],
     r"distill.temperature: expected a finite number, got -inf \(on the command line\)$"),
    ("file-key-typo", "inherit",
     r"unknown config key 'train.max_stepz'; did you mean 'train.max_steps'\? \(in \S+/typo.yaml\)$"),
]


@pytest.mark.parametrize(("overrides", "pattern"), [r[1:] for r in CONFIG_ROWS], ids=[r[0] for r in CONFIG_ROWS])
def test_config_errors_say_where_the_value_came_from(tmp_path, overrides, pattern):
    config = "configs/electra-tiny.yaml"
    if overrides == "inherit":
        config = tmp_path / "typo.yaml"
        config.write_text(f"inherit: {Path('configs/electra-tiny.yaml').resolve()}\ntrain:\n  max_stepz: 3\n")
        overrides = ["train.max_steps=4"]  # a valid override beside it: the file is still named
    out = megakd("pretrain", "-c", str(config), f"run.dir={tmp_path / 'run'}", *overrides)
    assert out.code == 2, out.stderr
    assert re.search(pattern, out.error_line()), out.error_line()
    assert not (tmp_path / "run").exists()


def test_max_bad_steps_stop_is_one_line(tiny_data, tmp_path):
    """λ = 1e300 is a finite config value whose weighted loss overflows in backward: finite loss,
    non-finite gradient norm. Every step is skipped; after train.max_bad_steps the run stops with
    exit 2 and one line, and writes no checkpoint."""
    run = tmp_path / "run"
    out = megakd("pretrain", "-c", "configs/electra-tiny.yaml",
                 *tiny_overrides(tiny_data, run, **{"train.max_steps": 5, "train.max_bad_steps": 3,
                                                    "electra.loss_weight": 1e300}))
    assert out.code == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert re.search(r"^megakd: error: train.max_bad_steps=3: 3 steps in a row had a non-finite loss or gradient "
                     r"norm \(last: non-finite gradient norm\); stopped at step 0 without saving", out.error_line())
    assert out.stderr.count("non-finite gradient norm at step 1: update skipped") == 3
    assert not (run / "checkpoints").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_run_dir(tiny_data, tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        out = megakd("pretrain", "-c", "configs/electra-tiny.yaml",
                     *tiny_overrides(tiny_data, parent / "run", **{"train.max_steps": 1}))
    finally:
        parent.chmod(0o755)
    assert out.code == 2, out.stderr
    assert re.search(rf"^megakd: error: {re.escape(str(parent))}\S*: permission denied$", out.error_line())


def test_only_user_errors_become_one_line(monkeypatch, tmp_path, capsys):
    """A UserError is a message and exit 2; any other ValueError is a bug and keeps its traceback."""
    def user_mistake(_args):
        raise UserError("input x.txt: expected text")

    def bug(_args):
        raise ValueError("internal invariant broken")

    args = ["data", "tokenizer", "--input", "x", "--vocab-size", "400", "--out", str(tmp_path / "o")]
    monkeypatch.setattr(data_cli, "cmd_data_tokenizer", user_mistake)
    assert cli.main(args) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "megakd: error: input x.txt: expected text"
    monkeypatch.setattr(data_cli, "cmd_data_tokenizer", bug)
    with pytest.raises(ValueError, match="internal invariant broken"):
        cli.main(args)
