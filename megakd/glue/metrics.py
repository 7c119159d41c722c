"""GLUE's official metrics per task and the benchmark's averages (docs/glue.md § Metrics).

The metric functions are fine-tuning's (megakd/finetune/scores.py, float64 numpy); this module says
which of them each task reports and how the GLUE score averages them: a task with two metrics
(MRPC and QQP F1 and accuracy, STS-B Pearson and Spearman, MNLI matched and mismatched accuracy)
scores their mean, and the GLUE score is the mean of the task scores. ELECTRA's dev-set average
(its papers' tables) differs: one metric per task (CoLA MCC, STS-B Spearman, MNLI matched accuracy,
accuracy elsewhere) over the tasks other than WNLI.
"""

from __future__ import annotations

import numpy as np

from megakd.finetune.scores import accuracy, f1, mcc, pearson, spearman
from megakd.glue.tasks import TASKS, GlueTask

ELECTRA_METRIC = {"cola": "mcc", "stsb": "spearman", "mnli": "accuracy_m", "mrpc": "accuracy", "qqp": "accuracy"}
ELECTRA_TASKS = tuple(t for t in TASKS if t != "wnli")


def predictions(task: GlueTask, logits: np.ndarray) -> np.ndarray:
    """Class ids (argmax), or for STS-B the regression output."""
    return logits.reshape(-1) if task.regression else np.asarray(logits).argmax(-1)


def split_metrics(task: GlueTask, logits: np.ndarray, labels: np.ndarray, suffix: str = "") -> dict[str, float]:
    """The task's official metrics on one labelled split (MNLI: `suffix` `_m` or `_mm`, accuracy only)."""
    pred = predictions(task, logits)
    if task.regression:
        return {"pearson": pearson(pred, labels), "spearman": spearman(pred, labels)}
    if task.name == "cola":
        return {"mcc": mcc(pred, labels)}
    if task.name in ("mrpc", "qqp"):
        return {"f1": f1(pred, labels), "accuracy": accuracy(pred, labels)}
    return {f"accuracy{suffix}": accuracy(pred, labels)}


def task_score(task: GlueTask, metrics: dict[str, float]) -> float:
    """The GLUE score of one task: the mean of its official metrics."""
    return float(np.mean([metrics[m] for m in task.metrics]))


def glue_score(task_scores: dict[str, float]) -> float:
    """The benchmark's average of task scores (the GLUE score proper when all nine are present)."""
    return float(np.mean(list(task_scores.values())))


def electra_score(task_metrics: dict[str, dict[str, float]]) -> float | None:
    """ELECTRA's dev average over every task but WNLI (None unless all eight are present)."""
    if not all(t in task_metrics for t in ELECTRA_TASKS):
        return None
    return float(np.mean([task_metrics[t][ELECTRA_METRIC.get(t, "accuracy")] for t in ELECTRA_TASKS]))
