"""The downstream probe while pretraining: logged at the right steps, equal to a reference, harmless to training."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from megakd.config import load_config
from megakd.engine.pretrain import build_trainer
from megakd.engine.runlog import plot_metrics
from megakd.models.logreg import fit_logistic_regression, predict_logistic_regression
from tests.helpers import tiny_overrides, trained

PROBE = {"train.probe_fit_examples": 120, "train.probe_eval_examples": 60, "train.probe_max_seq_len": 48}


def _train(tiny_data, run_dir, **extra):
    return trained(load_config("configs/electra-tiny.yaml", tiny_overrides(tiny_data, run_dir, **extra)))


def _scipy_logreg(x: np.ndarray, y: np.ndarray, classes: int, l2: float) -> tuple[np.ndarray, np.ndarray]:
    """The same objective (mean CE + l2/2·‖W‖², bias free) minimised by scipy, as an independent reference."""
    n, d = x.shape
    onehot = np.eye(classes)[y]

    def objective(theta):
        w, b = theta[: d * classes].reshape(d, classes), theta[d * classes:]
        z = x @ w + b
        z = z - z.max(1, keepdims=True)
        p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
        loss = -np.mean(np.log(p[np.arange(n), y])) + 0.5 * l2 * (w ** 2).sum()
        grad_z = (p - onehot) / n
        return loss, np.concatenate([(x.T @ grad_z + l2 * w).ravel(), grad_z.sum(0)])

    res = minimize(objective, np.zeros(d * classes + classes), jac=True, method="L-BFGS-B",
                   options={"gtol": 1e-12, "ftol": 1e-15, "maxiter": 5000})
    return res.x[: d * classes].reshape(d, classes), res.x[d * classes:]


def test_logistic_regression_matches_scipy_dense_and_sparse():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 12))
    y = (x[:, :3] @ rng.normal(size=(3, 3)) + rng.normal(size=(300, 3))).argmax(1)
    w_ref, b_ref = _scipy_logreg(x, y, 3, 1e-2)
    w, b = fit_logistic_regression(torch.from_numpy(x), torch.from_numpy(y), 3, l2=1e-2)
    # The bias is determined only up to a constant shift across classes: compare centred biases.
    assert np.allclose(w.numpy(), w_ref, atol=1e-5)
    assert np.allclose(b.numpy() - b.numpy().mean(), b_ref - b_ref.mean(), atol=1e-5)
    ws, bs = fit_logistic_regression(torch.from_numpy(x).to_sparse(), torch.from_numpy(y), 3, l2=1e-2)
    assert np.allclose(ws.numpy(), w.numpy(), atol=1e-7) and np.allclose(bs.numpy(), b.numpy(), atol=1e-7)
    assert torch.equal(predict_logistic_regression(torch.from_numpy(x), w, b),
                       torch.from_numpy((x @ w_ref + b_ref).argmax(1)))


def test_probe_logs_at_its_steps_and_matches_a_reference(tiny_data, tmp_path, monkeypatch):
    run = tmp_path / "run"
    plotted = []  # probe.png's chance line: 1 / the probe task's labels
    monkeypatch.setattr("megakd.engine.trainer.plot_metrics",
                        lambda *a, **kw: plotted.append(kw) or plot_metrics(*a, **kw))
    trainer = _train(tiny_data, run, **{"train.max_steps": 4, "train.probe_every": 2, "run.plots": "true",
                                        "run.tensorboard": "true", **PROBE})
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    probes = [r for r in rows if "probe_acc" in r]
    assert [r["step"] for r in probes] == [2, 4]
    assert (run / "plots" / "probe.png").is_file() and plotted == [{"probe_chance": 0.5}]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tb")).Reload()
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("probe_acc")] == \
        [(r["step"], r["probe_acc"]) for r in probes]
    # Reference at step 4 (the final weights): every example encoded alone (no padding), float64
    # mean of all its states and its [CLS] state, standardised, scipy's logistic regression.
    probe, encoder = trainer._probe, trainer.probe_encoder().eval()

    def reference_features(data):
        rows = []
        with torch.no_grad():
            for i in range(len(data)):
                ids = torch.tensor([data.encoded[i][0]])
                hidden = encoder(ids, torch.ones_like(ids), torch.zeros_like(ids))[0].double()
                rows.append(torch.cat([hidden.mean(0), hidden[0]]).numpy())
        return np.stack(rows)

    fit_x, held_x = reference_features(probe.fit), reference_features(probe.held)
    assert np.allclose(probe.features(encoder, probe.fit).numpy(), fit_x, atol=1e-5)
    mean, std = fit_x.mean(0), np.maximum(fit_x.std(0, ddof=1), 1e-8)
    from megakd.engine.probe import PROBE_L2

    w, b = _scipy_logreg((fit_x - mean) / std, probe.fit.labels.numpy(), 2, PROBE_L2)
    reference_acc = float((((held_x - mean) / std @ w + b).argmax(1) == probe.held.labels.numpy()).mean())
    assert probes[-1]["probe_acc"] == pytest.approx(reference_acc, abs=1 / 60 + 1e-9)
    assert 0 < probes[-1]["probe_seconds"]
    # The probe's rows are disjoint slices of the training split.
    fit_texts = {e.text_a for e in probe.fit.examples}
    assert not fit_texts & {e.text_a for e in probe.held.examples}


def test_probe_leaves_the_training_trajectory_unchanged(tiny_data, tmp_path):
    with_probe = _train(tiny_data, tmp_path / "a", **{"train.max_steps": 4, "train.probe_every": 1, **PROBE})
    without = _train(tiny_data, tmp_path / "b", **{"train.max_steps": 4, "train.probe_every": 0})

    def training_rows(run):
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows if "probe_acc" not in r]

    assert training_rows(tmp_path / "a") == training_rows(tmp_path / "b")
    for name, unit in with_probe.units.items():
        other = without.units[name].model.state_dict()
        assert all(torch.equal(v, other[k]) for k, v in unit.model.state_dict().items())


def test_probe_reads_the_bert_mlm_model_and_the_original_electra_discriminator(tiny_data, tmp_path):
    for extra, expected in (({"model.objective": "mlm"}, ("generator", lambda m: m.encoder)),
                            ({"electra.decoupled": "false"}, ("electra", lambda m: m.discriminator.encoder))):
        cfg = load_config("configs/electra-tiny.yaml", tiny_overrides(tiny_data, tmp_path / expected[0], **extra))
        trainer = build_trainer(cfg)
        unit, encoder_of = expected
        assert trainer.probe_encoder() is encoder_of(trainer.units[unit].model)
