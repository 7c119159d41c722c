"""`megakd finetune` prints its score beside random init and the tf-idf floor once they are recorded: the floor by
tools/baseline_tfidf.py, random init by any run with model.init=random and otherwise the same settings."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from megakd.config import load_config
from megakd.finetune.baselines import baseline_report
from megakd.finetune.config import FinetuneConfig

ROOT = Path(__file__).parents[2]
SMALL_TASK = ["task.max_train_examples=300", "task.max_dev_examples=100"]


def _summary(values: list[float]) -> dict:
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
    return {"headline": "accuracy", "metrics": {"accuracy": {"mean": mean, "std": std, "values": values}}}


def _tool():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import baseline_tfidf
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return baseline_tfidf


def test_scores_are_shown_beside_the_recorded_baselines(tiny_electra_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEGAKD_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    shutil.copytree(tiny_electra_run / "hf" / "discriminator", model)
    base = ["configs/finetune-rt.yaml", [f"model.path={model}", *SMALL_TASK]]

    def cfg(*extra: str) -> FinetuneConfig:
        return load_config(base[0], [*base[1], *extra], cls=FinetuneConfig)

    first = baseline_report(cfg("run.dir=runs/a"), _summary([0.70, 0.72]))
    assert first.startswith("rt accuracy: 0.7100 ± 0.0141 over 2 seed(s)")
    assert "random init: not measured" in first and "tf-idf floor: not recorded" in first

    assert _tool().main(["-c", base[0], *SMALL_TASK]) == 0
    floor = json.loads(capsys.readouterr().out)["dev"]["accuracy"]
    random_run = baseline_report(cfg("model.init=random", "run.dir=runs/random"), _summary([0.60, 0.64]))
    assert "random init: this run (recorded" in random_run

    report = baseline_report(cfg("run.dir=runs/b"), _summary([0.70, 0.72]))
    assert "random init: 0.6200 ± 0.0283 over 2 seed(s) (run runs/random); +9.0 points" in report
    assert f"tf-idf floor: {floor:.4f}" in report and f"{100 * (0.71 - floor):+.1f} points" in report

    # Another fine-tuning setting, or another architecture or tokenizer, was not measured from random init.
    assert "random init: not measured" in baseline_report(cfg("finetune.lr=1e-3"), _summary([0.7, 0.7]))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    assert "random init: not measured" in baseline_report(cfg(), _summary([0.7, 0.7]))


def test_regression_tasks_have_no_tfidf_floor(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAKD_CACHE", str(tmp_path))
    cfg = load_config("configs/finetune-rt.yaml", ["task.num_labels=1", "task.name=rt_score", *SMALL_TASK,
                                                   "model.init=random"], cls=FinetuneConfig)
    summary = {"headline": "spearman", "metrics": {"spearman": {"mean": 0.3, "std": 0.0, "values": [0.3]}}}
    assert "tf-idf" not in baseline_report(cfg, summary)
