"""Fine-tuning defaults that learn, the learning-rate list chosen on a slice of train, long inputs."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest

import megakd.data.tasks as tasks
import megakd.finetune.trainer as trainer
from megakd.cli import main
from megakd.config import load_config
from megakd.finetune.config import FinetuneConfig, auto_lr
from megakd.finetune.lr_select import selection_rows

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "configs" / "finetune-rt.yaml"
POSITIVE = ("happy", "pleasant", "agreeable", "delighted", "cheerful")
NEGATIVE = ("unhappy", "wretched", "dreadful", "miserable", "angry")
FILLER = ("the", "lady", "house", "was", "very", "and", "walk", "letter", "with", "her", "sister", "evening",
          "said", "he", "much", "great", "gentleman", "morning", "young", "friend")


def write_keyword_task(directory: Path, train_size: int, dev_size: int, seed: int = 0, words: int = 8) -> Path:
    """A sentiment-like TSV task: `words` filler words and one keyword; the keyword's list is the label."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for split, size in (("train", train_size), ("dev", dev_size)):
        lines = ["sentence\tlabel"]
        for _ in range(size):
            label = rng.randrange(2)
            sentence = [rng.choice(FILLER) for _ in range(words)]
            sentence.insert(rng.randrange(words + 1), rng.choice(POSITIVE if label else NEGATIVE))
            lines.append(f"{' '.join(sentence)}\t{label}")
        (directory / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    return directory


def random_init(tokenizer: Path, hidden: int = 32, max_positions: int = 64) -> list[str]:
    return ["model.path=", "model.init=random", f"model.tokenizer={tokenizer}", "model.encoder.vocab_size=512",
            f"model.encoder.hidden_size={hidden}", "model.encoder.num_layers=2", "model.encoder.num_heads=2",
            f"model.encoder.intermediate_size={4 * hidden}", f"model.encoder.max_position_embeddings={max_positions}"]


def files_task(directory: Path) -> list[str]:
    return ["task.name=files", f"task.train={directory / 'train.tsv'}", f"task.dev={directory / 'dev.tsv'}"]


def test_auto_lr_is_the_dissertation_value_at_bert_base_width():
    assert auto_lr(768) == pytest.approx(1e-4) and auto_lr(128) == pytest.approx(1e-3)
    assert auto_lr(256) == pytest.approx(1e-3 * 2 ** -(np.log(10) / np.log(6)))  # the power law between them
    assert auto_lr(1024) < 1e-4 and auto_lr(32) == 3e-3  # capped for narrow models
    assert load_config(CONFIG, cls=FinetuneConfig).finetune.lr == "auto"


def test_defaults_learn_a_keyword_task_from_random_init(tiny_data, tmp_path):
    """The recipe's defaults (lr auto, 3 epochs, batch 32): a 2-layer 32-wide encoder from scratch learns
    which of ten keywords a sentence of three filler words holds. Measured (lr auto = 3e-3): dev accuracy 1.0
    for seeds 0, 1, 2 (seed 0's train loss 0.693 → 0.522 → 0.131 by epoch); 0.9 leaves margin, chance is 0.5."""
    data = write_keyword_task(tmp_path / "task", train_size=1200, dev_size=200, words=3)
    run = tmp_path / "run"
    assert main(["finetune", "-c", str(CONFIG), f"run.dir={run}", "run.progress_bar=false", "finetune.seeds=[0,1,2]",
                 *random_init(tiny_data[0]), *files_task(data)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["lr"]["lr"] == pytest.approx(auto_lr(32)) and summary["lr"]["setting"] == "auto"
    accuracy = summary["metrics"]["accuracy"]["values"]
    assert min(accuracy) >= 0.9, accuracy
    curve = summary["dev_curve"]["0"]
    assert [c["epoch"] for c in curve] == [0, 1, 2] and curve[-1]["accuracy"] == accuracy[0]


def test_lr_list_is_chosen_on_a_train_slice_before_dev_is_read(tiny_data, tmp_path, monkeypatch):
    """Dev is first parsed after the last selection trial; the learning candidate beats one that cannot learn."""
    data = write_keyword_task(tmp_path / "task", train_size=800, dev_size=100, words=3)
    events: list[str] = []
    read_rows, train_seed = tasks._read_rows, trainer.train_seed

    def spy_read_rows(path):
        events.append(f"read {Path(path).name}")
        return read_rows(path)

    def spy_train_seed(*args, **kwargs):
        events.append(f"train {kwargs.get('eval_split', 'dev')}")
        return train_seed(*args, **kwargs)

    monkeypatch.setattr(tasks, "_read_rows", spy_read_rows)
    monkeypatch.setattr(trainer, "train_seed", spy_train_seed)
    run = tmp_path / "run"
    assert main(["finetune", "-c", str(CONFIG), f"run.dir={run}", "run.progress_bar=false", "finetune.seeds=[3]",
                 "finetune.epochs=5", "finetune.lr=[1e-8,3e-3]", "finetune.lr_select_frac=0.25",
                 *random_init(tiny_data[0]), *files_task(data)]) == 0
    first_dev = events.index("read dev.tsv")
    assert events[:first_dev].count("train slice") == 2 and "train dev" not in events[:first_dev]
    assert events[first_dev + 1:] == ["train dev"]
    summary = json.loads((run / "summary.json").read_text())
    selection = summary["lr"]["selection"]
    assert selection["slice_examples"] == 200 and selection["fit_examples"] == 600 and selection["seed"] == 3
    scores = selection["slice_scores"]
    assert scores["1e-08"] < 0.7 < scores["0.003"], scores
    assert summary["lr"]["lr"] == 3e-3
    # The trial's score is its last epoch's accuracy on the held-out rows, recorded in its own result.
    trial = json.loads((run / "lr_select" / "lr_0.003" / "result.json").read_text())
    assert trial["slice"]["accuracy"] == scores["0.003"] and not (run / "lr_select" / "lr_0.003" / "model").exists()


def test_selection_rows_partition_train():
    fit, held = selection_rows(1000, 0.1)
    assert len(held) == 100 and sorted(fit + held) == list(range(1000))
    assert selection_rows(1000, 0.1) == (fit, held)  # fixed: the same slice for every run and candidate
    assert [len(part) for part in selection_rows(2, 0.01)] == [1, 1]


def test_inputs_longer_than_the_position_table_are_truncated_once(tiny_data, tmp_path, caplog):
    data = write_keyword_task(tmp_path / "task", train_size=40, dev_size=20, words=40)
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="megakd.finetune.trainer"):
        assert main(["finetune", "-c", str(CONFIG), f"run.dir={run}", "run.progress_bar=false", "finetune.epochs=1",
                     "finetune.max_seq_len=256", *random_init(tiny_data[0], max_positions=16),
                     *files_task(data)]) == 0
    warnings = [r.getMessage() for r in caplog.records if "max_position_embeddings" in r.getMessage()]
    assert warnings == ["finetune.max_seq_len=256 exceeds the model's max_position_embeddings=16: inputs are "
                        "truncated to 16 tokens"]
    assert json.loads((run / "summary.json").read_text())["metrics"]["accuracy"]["values"]


@pytest.mark.parametrize("recipe", ["soteacher-rt.yaml", "tgt-rt.yaml"])
def test_recipe_without_its_encoder_names_the_command_that_makes_it(recipe, tmp_path, monkeypatch, capsys):
    """SoTeacher and TGT start from bert-mini-long (the smoke demo's encoder fine-tunes below random init);
    before it exists they stop at once, in one line naming the directory and the command that writes it,
    and make no run directory."""
    long = load_config(ROOT / "configs" / "bert-mini-long.yaml")
    assert load_config(ROOT / "configs" / recipe, cls=FinetuneConfig).model.path == long.run.dir
    monkeypatch.chdir(tmp_path)  # the recipes' relative runs/ paths then never meet a run made in the checkout
    run = tmp_path / "run"
    assert main(["finetune", "-c", str(ROOT / "configs" / recipe), f"run.dir={run}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"megakd: error: model.path={long.run.dir}: no such directory")
    assert err.endswith(f"; `megakd pretrain -c {ROOT / 'configs' / 'bert-mini-long.yaml'}` writes it")
    assert not run.exists()


@pytest.mark.parametrize("recipe, present, missing, writer", [
    ("soteacher-rt.yaml", ["model.path"], "soteacher.student.path=runs/bert-mini-long", "megakd pretrain -c"),
    ("tgt-rt.yaml", ["model.path", "tgt.generator"], "tgt.labeler=runs/rt-labeler/seed_0/model",
     "megakd finetune -c CONFIG run.dir=runs/rt-labeler"),
])
def test_every_model_a_job_reads_is_checked_before_it_starts(recipe, present, missing, writer, tmp_path, monkeypatch,
                                                             capsys):
    """The SoTeacher student's encoder is read only after the teachers trained; it is checked first all the same."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    assert main(["finetune", "-c", str(ROOT / "configs" / recipe), f"run.dir={run}",
                 *(f"{key}={tmp_path}" for key in present)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"megakd: error: {missing}: no such directory") and f"`{writer}" in err
    assert not run.exists()
