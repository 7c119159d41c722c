"""Task metrics and calibration against scipy / direct computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.optimize import minimize_scalar
from scipy.stats import spearmanr

from megakd.finetune.scores import (
    accuracy,
    agreement,
    calibration_report,
    ece,
    f1,
    fit_temperature,
    mcc,
    mean_std_record,
    nll,
    spearman,
)


def _mcc_reference(pred, labels, k):
    """sklearn's definition written out with explicit sums over the confusion matrix."""
    c = [[sum(1 for p, y in zip(pred, labels) if y == i and p == j) for j in range(k)] for i in range(k)]
    n = len(pred)
    correct = sum(c[i][i] for i in range(k))
    t = [sum(c[i]) for i in range(k)]
    p = [sum(c[i][j] for i in range(k)) for j in range(k)]
    num = correct * n - sum(t[i] * p[i] for i in range(k))
    den = math.sqrt((n * n - sum(x * x for x in p)) * (n * n - sum(x * x for x in t)))
    return num / den if den else 0.0


def test_classification_metrics():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 300)
    pred = np.where(rng.random(300) < 0.7, labels, 1 - labels)
    tp = np.sum((pred == 1) & (labels == 1))
    fp = np.sum((pred == 1) & (labels == 0))
    fn = np.sum((pred == 0) & (labels == 1))
    assert accuracy(pred, labels) == np.mean(pred == labels)
    assert f1(pred, labels) == pytest.approx(2 * tp / (2 * tp + fp + fn), abs=1e-15)
    assert mcc(pred, labels) == pytest.approx(np.corrcoef(pred, labels)[0, 1], abs=1e-12)  # binary: φ = Pearson
    labels3 = rng.integers(0, 3, 200)
    pred3 = np.where(rng.random(200) < 0.5, labels3, rng.integers(0, 3, 200))
    assert mcc(pred3, labels3, 3) == pytest.approx(_mcc_reference(pred3, labels3, 3), abs=1e-12)
    assert mcc(np.zeros(10, int), labels[:10]) == 0.0  # constant prediction: undefined → 0


def test_spearman_with_ties_matches_scipy():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 10, 500).astype(float)  # many ties
    y = x + rng.normal(0, 3, 500)
    assert spearman(x, y) == pytest.approx(spearmanr(x, y).statistic, abs=1e-12)
    assert spearman(np.ones(5), np.arange(5)) == 0.0


def _overconfident(n=20000, scale=3.0, seed=2):
    rng = np.random.default_rng(seed)
    true = rng.normal(0, 1.5, (n, 4))
    p = np.exp(true) / np.exp(true).sum(-1, keepdims=True)
    labels = np.array([rng.choice(4, p=row) for row in p])
    return true * scale, labels


def test_nll_and_ece_direct():
    logits, labels = _overconfident(2000)
    t = torch.from_numpy(logits)
    assert nll(logits, labels, 1.7) == pytest.approx(F.cross_entropy(t / 1.7, torch.from_numpy(labels)).item(),
                                                      abs=1e-12)
    probs = F.softmax(t, -1).numpy()
    conf, pred = probs.max(1), probs.argmax(1)
    total = 0.0
    for b in range(15):
        lo, hi = b / 15, (b + 1) / 15
        sel = (conf > lo) & (conf <= hi)
        if sel.any():
            total += sel.sum() / len(conf) * abs((pred[sel] == labels[sel]).mean() - conf[sel].mean())
    assert ece(logits, labels) == pytest.approx(total, abs=1e-12)


def test_temperature_scaling_recovers_the_overconfidence_factor():
    logits, labels = _overconfident()
    t = fit_temperature(logits, labels)
    ref = minimize_scalar(lambda x: nll(logits, labels, x), bounds=(0.01, 100), method="bounded",
                          options={"xatol": 1e-10}).x
    assert t == pytest.approx(ref, rel=1e-5)
    assert t == pytest.approx(3.0, rel=0.05)  # the logits were the calibrated ones × 3
    report = calibration_report(logits, labels, np.arange(0, len(labels), 2))
    assert report["nll_ts"] < report["nll"] and report["ece_ts"] < report["ece"]


def test_agreement_and_mean_std_record():
    a = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 1.0]])
    b = np.array([[0.0, 1.0], [0.0, 1.0], [3.0, 1.0]])
    assert agreement(a, b) == pytest.approx(2 / 3)
    s = mean_std_record([1.0, 2.0, 4.0])
    assert s["mean"] == pytest.approx(7 / 3) and s["std"] == pytest.approx(np.std([1, 2, 4], ddof=1))
    assert mean_std_record([5.0])["std"] == 0.0
