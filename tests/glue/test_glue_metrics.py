"""GLUE's metrics against scikit-learn and scipy on random predictions, the benchmark's averaging against a
published score, and the submission files' format."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from megakd.glue.metrics import electra_score, glue_score, split_metrics, task_score
from megakd.glue.run import write_submission_file
from megakd.glue.tasks import AX, TASKS


@pytest.mark.parametrize("seed", range(5))
def test_each_task_metric_matches_sklearn_and_scipy(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(20, 200))
    for name, task in TASKS.items():
        if task.regression:
            labels = rng.uniform(0, 5, n).round(1)  # ties, as STS-B's scores have
            logits = (labels + rng.normal(0, 2, n)).round(1)[:, None]
            got = split_metrics(task, logits, labels)
            assert got == {"pearson": pytest.approx(pearsonr(logits[:, 0], labels).statistic, abs=1e-12),
                           "spearman": pytest.approx(spearmanr(logits[:, 0], labels).statistic, abs=1e-12)}
            continue
        labels = rng.integers(0, task.num_labels, n)
        logits = rng.normal(size=(n, task.num_labels)) + 0.7 * np.eye(task.num_labels)[labels]
        pred = logits.argmax(-1)
        want = {"mcc": matthews_corrcoef(labels, pred), "accuracy": accuracy_score(labels, pred),
                "f1": f1_score(labels, pred) if task.num_labels == 2 else None}
        got = split_metrics(task, logits, labels, "_m" if name == "mnli" else "")
        expected = {m: want[m.removesuffix("_m")] for m in got}
        assert set(got) == {"cola": {"mcc"}, "mrpc": {"f1", "accuracy"}, "qqp": {"f1", "accuracy"},
                            "mnli": {"accuracy_m"}}.get(name, {"accuracy"})
        assert got == pytest.approx(expected, abs=1e-12)


def test_glue_score_averages_two_metric_tasks_first():
    """BERT-large's GLUE test results as the leaderboard lists them; its GLUE score is 80.5."""
    published = {"cola": {"mcc": 60.5}, "sst2": {"accuracy": 94.9}, "mrpc": {"f1": 89.3, "accuracy": 85.4},
                 "stsb": {"pearson": 87.6, "spearman": 86.5}, "qqp": {"f1": 72.1, "accuracy": 89.3},
                 "mnli": {"accuracy_m": 86.7, "accuracy_mm": 85.9}, "qnli": {"accuracy": 92.7},
                 "rte": {"accuracy": 70.1}, "wnli": {"accuracy": 65.1}}
    scores = {t: task_score(TASKS[t], m) for t, m in published.items()}
    assert scores["mrpc"] == pytest.approx(87.35) and scores["mnli"] == pytest.approx(86.3)
    assert round(glue_score(scores), 1) == 80.5
    assert electra_score({t: m for t, m in published.items() if t != "rte"}) is None


@pytest.mark.parametrize("row, average", [
    ((86.9, 91.9, 92.6, 93.6, 66.2, 75.1, 88.2, 89.7), 85.5),  # ELECTRA-Base, the dissertation's Table 1.1
    ((89.4, 92.4, 93.6, 94.7, 70.6, 88.8, 92.2, 91.1), 89.1),  # DecoupledOptim-Base, the same table
])
def test_electra_dev_average_reproduces_the_papers_tables(row, average):
    """One metric per task (MNLI-m, QQP and MRPC accuracy, CoLA MCC, STS-B Spearman), WNLI left out."""
    mnli, qqp, qnli, sst2, cola, rte, mrpc, stsb = row
    metrics = {"mnli": {"accuracy_m": mnli, "accuracy_mm": 0.0}, "qqp": {"accuracy": qqp, "f1": 0.0},
               "qnli": {"accuracy": qnli}, "sst2": {"accuracy": sst2}, "cola": {"mcc": cola},
               "rte": {"accuracy": rte}, "mrpc": {"accuracy": mrpc, "f1": 0.0},
               "stsb": {"spearman": stsb, "pearson": 0.0}}
    assert round(electra_score(metrics), 1) == average


def test_submission_rows_use_the_servers_labels(tmp_path):
    write_submission_file(tmp_path / "MNLI-m.tsv", TASKS["mnli"], [3, 9], np.array([0, 2]))
    write_submission_file(tmp_path / "CoLA.tsv", TASKS["cola"], [0, 1], np.array([1, 0]))
    write_submission_file(tmp_path / "STS-B.tsv", TASKS["stsb"], [0, 1, 2], np.array([-0.3, 2.25, 6.0]))
    write_submission_file(tmp_path / "AX.tsv", AX, [0], np.array([1]))
    assert (tmp_path / "MNLI-m.tsv").read_text() == "index\tprediction\n3\tentailment\n9\tcontradiction\n"
    assert (tmp_path / "CoLA.tsv").read_text() == "index\tprediction\n0\t1\n1\t0\n"
    assert (tmp_path / "STS-B.tsv").read_text() == "index\tprediction\n0\t0.000\n1\t2.250\n2\t5.000\n"
    assert (tmp_path / "AX.tsv").read_text() == "index\tprediction\n0\tneutral\n"
