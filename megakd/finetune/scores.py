"""Task metrics (GLUE's), calibration (ECE, NLL, temperature scaling) and seed aggregation.

All functions take numpy arrays and return Python floats, computed in float64 with numpy only
(scipy is a test dependency, used there as the reference).
"""

from __future__ import annotations

import math

import numpy as np


def log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


def rankdata(x: np.ndarray) -> np.ndarray:
    """1-based ranks, tied values sharing their average rank."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(1, len(x) + 1)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.zeros(len(counts))
    np.add.at(sums, inverse, ranks)
    return (sums / counts)[inverse]


def accuracy(pred: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(np.asarray(pred) == np.asarray(labels)))


def f1(pred: np.ndarray, labels: np.ndarray, num_classes: int = 2) -> float:
    """F1 of class 1 for binary tasks (GLUE's MRPC/QQP convention), macro-F1 otherwise."""
    pred, labels = np.asarray(pred), np.asarray(labels)
    classes = [1] if num_classes == 2 else range(num_classes)
    scores = []
    for c in classes:
        tp = np.sum((pred == c) & (labels == c))
        fp = np.sum((pred == c) & (labels != c))
        fn = np.sum((pred != c) & (labels == c))
        scores.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores))


def mcc(pred: np.ndarray, labels: np.ndarray, num_classes: int = 2) -> float:
    """Matthews correlation (Gorodkin's K-class form; the usual φ for two classes); 0 when undefined."""
    c = np.zeros((num_classes, num_classes), dtype=np.float64)
    np.add.at(c, (np.asarray(labels, dtype=np.int64), np.asarray(pred, dtype=np.int64)), 1)
    t, p, n = c.sum(1), c.sum(0), c.sum()
    cov = np.trace(c) * n - t @ p
    denom = math.sqrt((n * n - p @ p) * (n * n - t @ t))
    return float(cov / denom) if denom else 0.0


def pearson(pred: np.ndarray, labels: np.ndarray) -> float:
    """Pearson correlation (STS-B's first metric); 0 when a side is constant."""
    x = np.asarray(pred, dtype=np.float64).reshape(-1)
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    x, y = x - x.mean(), y - y.mean()
    denom = math.sqrt(float(x @ x) * float(y @ y))
    return float(x @ y / denom) if denom else 0.0


def spearman(pred: np.ndarray, labels: np.ndarray) -> float:
    """Pearson correlation of the ranks (ties get their average rank); 0 when a side is constant."""
    return pearson(rankdata(pred), rankdata(labels))


def task_metrics(outputs: np.ndarray, labels: np.ndarray, num_labels: int) -> dict[str, float]:
    """Every metric that applies: Spearman for regression; accuracy, F1 and MCC for classification."""
    if num_labels == 1:
        return {"spearman": spearman(outputs.reshape(-1), labels)}
    pred = outputs.argmax(-1)
    return {"accuracy": accuracy(pred, labels), "f1": f1(pred, labels, num_labels),
            "mcc": mcc(pred, labels, num_labels)}


def nll(logits: np.ndarray, labels: np.ndarray, temperature: float = 1.0) -> float:
    """Mean negative log-likelihood of softmax(logits / T)."""
    logp = log_softmax(np.asarray(logits, dtype=np.float64) / temperature, axis=-1)
    return float(-np.mean(logp[np.arange(len(labels)), np.asarray(labels)]))


def ece(logits: np.ndarray, labels: np.ndarray, temperature: float = 1.0, bins: int = 15) -> float:
    """Expected calibration error: Σ_b |B_b|/N · |acc(B_b) − conf(B_b)| over equal-width confidence bins.

    Bins are (k/bins, (k+1)/bins] as in Guo et al. 2017 (the convention SoTeacher's tables use).
    """
    probs = np.exp(log_softmax(np.asarray(logits, dtype=np.float64) / temperature, axis=-1))
    conf, pred = probs.max(-1), probs.argmax(-1)
    correct = pred == np.asarray(labels)
    which = np.clip(np.ceil(conf * bins).astype(np.int64) - 1, 0, bins - 1)
    total = 0.0
    for b in range(bins):
        sel = which == b
        if sel.any():
            total += sel.mean() * abs(correct[sel].mean() - conf[sel].mean())
    return float(total)


def fit_temperature(logits: np.ndarray, labels: np.ndarray, lo: float = 1e-2, hi: float = 1e2,
                    iters: int = 100) -> float:
    """The T > 0 minimising NLL(softmax(logits / T)) on held-out data.

    NLL is convex in β = 1/T (β·z_y minus a log-sum-exp of β·z), so a golden-section search over
    β ∈ [1/hi, 1/lo] finds the global minimum; 100 iterations shrink the bracket by 0.618¹⁰⁰.
    """
    g = (math.sqrt(5) - 1) / 2
    a, b = 1 / hi, 1 / lo
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = nll(logits, labels, 1 / c), nll(logits, labels, 1 / d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = nll(logits, labels, 1 / c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = nll(logits, labels, 1 / d)
    return 2 / (a + b)


def calibration_report(logits: np.ndarray, labels: np.ndarray, fit_rows: np.ndarray) -> dict[str, float]:
    """ECE and NLL on the rows not in `fit_rows`, raw and after temperature scaling fitted on `fit_rows`."""
    held = np.ones(len(labels), dtype=bool)
    held[fit_rows] = False
    t = fit_temperature(logits[fit_rows], labels[fit_rows])
    ev_logits, ev_labels = logits[held], labels[held]
    return {"ece": ece(ev_logits, ev_labels), "nll": nll(ev_logits, ev_labels), "temperature": t,
            "ece_ts": ece(ev_logits, ev_labels, t), "nll_ts": nll(ev_logits, ev_labels, t)}


def agreement(a_logits: np.ndarray, b_logits: np.ndarray) -> float:
    """Share of examples on which two classifiers predict the same class (top-1 agreement)."""
    return float(np.mean(np.asarray(a_logits).argmax(-1) == np.asarray(b_logits).argmax(-1)))


def mean_std_record(values: list[float]) -> dict[str, float | list[float]]:
    """Mean and sample standard deviation (ddof=1; 0 for one seed) of per-seed values."""
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), "std": float(arr.std(ddof=1)) if len(arr) > 1 else 0.0,
            "values": [float(v) for v in arr]}
