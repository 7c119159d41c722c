"""`megakd` end to end through its command line: data commands, pretrain, run directory, errors."""

from __future__ import annotations

import json

import pytest

from megakd.cli import main
from megakd.data.default_corpus import CORPUS_DIR
from tests.helpers import tiny_overrides


def test_pretrain_writes_the_documented_run_directory(tiny_data, tmp_path):
    run = tmp_path / "run"
    overrides = [o for o in tiny_overrides(tiny_data, run) if not o.startswith(("run.plots", "run.tensorboard"))]
    assert main(["pretrain", "-c", "configs/electra-tiny.yaml", *overrides, "train.max_steps=3"]) == 0
    assert (run / "config.yaml").is_file() and (run / "metrics.jsonl").is_file()
    assert sorted(p.name for p in (run / "plots").iterdir()) == ["loss.png", "rtd.png"]
    assert any((run / "tb").iterdir())
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000003"]
    for model, arch in (("discriminator", "ElectraForPreTraining"), ("generator", "ElectraForMaskedLM")):
        config = json.loads((run / "hf" / model / "config.json").read_text())
        assert config["architectures"] == [arch]
    # --resume auto on a finished run continues nothing and changes nothing
    before = (run / "metrics.jsonl").read_text()
    assert main(["pretrain", "-c", "configs/electra-tiny.yaml", *overrides, "train.max_steps=3",
                 "--resume", "auto"]) == 0
    assert (run / "metrics.jsonl").read_text() == before


def test_data_commands_build_a_usable_dataset(tmp_path):
    tok, shards = tmp_path / "tok", tmp_path / "shards"
    kjv = CORPUS_DIR / "kjv.jsonl.gz"
    assert main(["data", "tokenizer", "--input", str(kjv), "--vocab-size", "400", "--out", str(tok)]) == 0
    assert main(["data", "shards", "--input", str(kjv), "--tokenizer", str(tok), "--seq-len", "64",
                 "--out", str(shards), "--samples-per-shard", "2000"]) == 0
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["seq_len"] == 64 and manifest["num_samples"] == sum(s["samples"] for s in manifest["shards"])


@pytest.mark.parametrize("args, message", [
    (["train.max_stpes=3"], "unknown config key 'train.max_stpes'; did you mean 'train.max_steps'?"),
    (["data.tokenizer=/nonexistent"], "data.tokenizer and data.shards: set both"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, message, tmp_path, capsys):
    assert main(["pretrain", "-c", "configs/electra-tiny.yaml", f"run.dir={tmp_path}", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not any(tmp_path.iterdir())  # nothing written
