"""`megakd config keys` and docs/configuration.md: each key's type, default and meaning, from the code."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megakd.cli import main
from megakd.config import Config, OptimizerConfig, PretrainRunConfig
from megakd.configio import config_keys, field_meanings
from megakd.finetune.config import FinetuneConfig

REFERENCE = Path(__file__).parents[1] / "docs" / "configuration.md"
REGENERATE = "megakd config keys --markdown > docs/configuration.md"


@dataclasses.dataclass
class Documented:
    # Above the field, over
    # two lines.
    above: int = 1
    beside: str = "x"  # beside the field
    both: float = 0.5  # and beside
    # (a blank line ends a comment block)

    bare: bool = False


def _keys(cls: type) -> dict:
    return {k.key: k for k in config_keys(cls)}


def _generated(capsys) -> str:
    assert main(["config", "keys", "--markdown"]) == 0
    return capsys.readouterr().out


def test_meanings_are_the_comments_above_and_beside_each_field():
    assert field_meanings(Documented) == {"above": "Above the field, over two lines.",
                                          "beside": "beside the field", "both": "and beside", "bare": ""}


@pytest.mark.parametrize("cls", [Config, FinetuneConfig])
def test_every_key_has_a_meaning(cls):
    missing = [k.key for k in config_keys(cls) if not k.meaning]
    assert not missing, f"document these fields with a comment above or beside them: {missing}"


def test_a_key_has_its_dataclass_type_default_and_comment():
    lr = _keys(Config)["optim.generator.lr"]
    assert (lr.type, lr.default) == ("float", Config().optim.generator.lr)
    assert lr.default != OptimizerConfig().lr  # the tree's default for this section, not the class's
    assert lr.meaning == field_meanings(OptimizerConfig)["lr"] and lr.meaning.startswith("peak learning rate")
    name = _keys(FinetuneConfig)["backend.name"]
    assert (name.type, name.default) == ("auto|single|ddp|deepspeed", "auto")
    assert "--print-config" in name.meaning
    encoder = _keys(FinetuneConfig)["model.encoder.hidden_size"]
    assert encoder.default == FinetuneConfig().model.encoder.hidden_size == 64
    assert _keys(Config)["init.from"].type == "str"  # the YAML key, not the field name from_


def test_keys_filters_by_glob_or_word_and_names_each_tree(capsys):
    assert main(["config", "keys", "optim.*.lr"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[1:]] == ["optim.generator.lr", "optim.discriminator.lr"]
    assert out[0].startswith("megakd pretrain and megakd distill (megakd.config.Config)")
    assert main(["config", "keys", "--finetune", "lr"]) == 0
    keys = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert keys == ["finetune.lr", "finetune.lr_select_frac", "finetune.layer_lr_decay",
                    "soteacher.lambda_lr"]  # no labelreg.*
    assert main(["config", "keys", "no_such_key"]) == 2
    assert "no config key matches 'no_such_key'" in capsys.readouterr().err


def test_the_committed_reference_is_current(capsys):
    assert REFERENCE.read_text() == _generated(capsys), f"docs/configuration.md is stale: run `{REGENERATE}`"


def test_a_changed_default_or_comment_makes_the_reference_stale(capsys, monkeypatch):
    defaults = PretrainRunConfig.__init__.__defaults__
    monkeypatch.setattr(PretrainRunConfig.__init__, "__defaults__", ("runs/elsewhere", *defaults[1:]))
    text = _generated(capsys)
    assert "| `run.dir` | `str` | `runs/elsewhere` |" in text and text != REFERENCE.read_text()
    monkeypatch.undo()
    meanings = field_meanings(PretrainRunConfig)
    monkeypatch.setattr("megakd.configio.field_meanings",
                        lambda cls: {**meanings, "dir": "moved"} if cls is PretrainRunConfig else field_meanings(cls))
    assert "| `run.dir` | `str` | `runs/electra-tiny` | moved |" in _generated(capsys)


def test_a_shared_section_is_documented_once_with_each_trees_defaults():
    """`run` and the optimizer settings are one class each: the same meaning in every tree, its own defaults."""
    pretraining, finetuning = _keys(Config), _keys(FinetuneConfig)
    for key, other in (("run.keep_last", "run.keep_last"), ("run.save_every", "run.save_every"),
                       ("optim.generator.eps", "finetune.eps"), ("optim.generator.betas", "finetune.betas")):
        assert pretraining[key].meaning == finetuning[other].meaning != ""
    assert (pretraining["run.keep_last"].default, finetuning["run.keep_last"].default) == (3, 2)
    assert (pretraining["optim.generator.clip_norm"].default, finetuning["finetune.clip_norm"].default) == (2.0, 1.0)
