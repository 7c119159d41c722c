"""Conveniences users trip on: vocab_size auto, --print-config, plan key=value, one wandb run per run dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megakd.cli import main
from megakd.config import ConfigError, load_config
from megakd.configio import config_to_dict
from megakd.data.tokenizer import Tokenizer
from megakd.finish import finish_config
from megakd.store.checkpoint import latest_checkpoint
from megakd.store.files import load_weights
from megakd.store.rundir import flatten
from tests.helpers import TINY_VOCAB, tiny_overrides


def _without_vocab(overrides: list[str]) -> list[str]:
    return [o for o in overrides if ".vocab_size=" not in o]


def test_vocab_size_auto_takes_the_tokenizers_size(tiny_data, tmp_path):
    """With data.tokenizer set and no vocab key anywhere, both models get the tokenizer's size."""
    run = tmp_path / "run"
    overrides = _without_vocab(tiny_overrides(tiny_data, run, **{"train.max_steps": 1, "run.export_hf": "false"}))
    assert main(["pretrain", "-c", "configs/electra-tiny.yaml", *overrides]) == 0
    tokenizer_size = Tokenizer.load(tiny_data[0]).vocab_size
    assert tokenizer_size == TINY_VOCAB
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["generator"]["vocab_size"] == tokenizer_size
    assert saved["model"]["discriminator"]["vocab_size"] == tokenizer_size
    state = load_weights(latest_checkpoint(run) / "generator.safetensors")
    embedding = next(v for k, v in state.items() if k.endswith("word_embeddings.weight"))
    assert embedding.shape[0] == tokenizer_size


def test_explicit_vocab_size_that_differs_is_refused(tiny_data, tmp_path, capsys):
    overrides = tiny_overrides(tiny_data, tmp_path / "run", **{"model.discriminator.vocab_size": 600})
    assert main(["pretrain", "-c", "configs/electra-tiny.yaml", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert "model.discriminator.vocab_size=600" in err and f"has {TINY_VOCAB} pieces" in err
    assert not (tmp_path / "run").exists()


def test_bundled_corpus_size_follows_an_explicit_model_size():
    cfg = finish_config(load_config("configs/electra-tiny.yaml", ["model.generator.vocab_size=4000",
                                                                   "data.vocab_size=auto"]))
    assert cfg.model.generator.vocab_size == cfg.model.discriminator.vocab_size == 4000
    assert finish_config(load_config(None)).model.generator.vocab_size == 8000  # the bundled default


def test_print_config_prints_the_resolved_config_and_writes_nothing(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    overrides = _without_vocab(tiny_overrides(tiny_data, run))
    assert main(["pretrain", "-c", "configs/electra-tiny.yaml", "--print-config", *overrides,
                 "train.max_steps=17"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["max_steps"] == 17
    assert printed["model"]["discriminator"]["vocab_size"] == TINY_VOCAB  # auto, resolved
    reloaded = load_config(None, [f"{k}={json.dumps(v)}" for k, v in flatten(printed).items()])
    assert flatten(config_to_dict(reloaded)) == flatten(printed)  # the printed config is complete and valid
    assert not run.exists()


def test_errors_say_whether_the_file_or_the_command_line_is_wrong(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'train.max_stpes'.*\(on the command line\)$"):
        load_config("configs/electra-tiny.yaml", ["train.max_stpes=3"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  max_stpes: 3\n")
    with pytest.raises(ConfigError, match=rf"\(in {bad}\)$"):
        load_config(bad, ["train.max_steps=3"])


def test_plan_takes_positional_overrides_and_set(capsys):
    args = ["plan", "configs/electra-base.yaml", "--gpus", "8", "--gpu-mem", "40", "--top", "1"]
    outputs = {}
    for name, overrides in (("positional", ["train.precision=fp16"]), ("set", ["--set", "train.precision=fp16"]),
                            ("none", [])):
        assert main([*args, *overrides]) == 0
        outputs[name] = capsys.readouterr().out
    assert outputs["positional"] == outputs["set"] != outputs["none"]


def test_wandb_keeps_one_run_per_run_dir(tmp_path, monkeypatch, wandb_torn_down):
    """A requeued job (a second MetricsWriter on the same dir) continues the first wandb run."""
    from megakd.engine.runlog import WANDB_ID_FILE, MetricsWriter

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    ids, run_dirs = [], []
    for step in (0, 5):
        writer = MetricsWriter(tmp_path, tensorboard=False, wandb=True, wandb_project="megakd-test",
                               wandb_mode="online", config={"a": 1}, resume_step=step)
        writer.write({"step": step + 1, "gen_loss": 1.0})
        ids.append(writer.wandb.id)
        run_dirs.append(Path(writer.wandb.dir).parent.name)  # wandb's offline-run-<time>-<id>
        assert writer.wandb.settings.mode == "offline"  # the environment wins over run.wandb_mode
        writer.close()
    stored = (tmp_path / WANDB_ID_FILE).read_text().strip()
    assert ids == [stored, stored]
    # offline-run-<second>-<id>, with "-1" appended when both runs started in the same second
    assert all(name.startswith("offline-run-") and f"-{stored}" in name for name in run_dirs), (run_dirs, stored)
