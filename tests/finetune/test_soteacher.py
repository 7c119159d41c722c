"""SoTeacher: Lipschitz penalty, CR weight schedules, consistency store, objective and a tiny full run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megakd.cli import main
from megakd.config import ConfigError
from megakd.finetune.config import SoTeacherConfig
from megakd.finetune.soteacher import ConsistencyStore, SoTeacherObjective
from megakd.models.electra import SequenceClassifier
from megakd.models.encoder import EncoderConfig
from megakd.objectives.soteacher import consistency_loss, cr_weight, cr_weight_for_epoch, lipschitz_penalty
from megakd.store.model_dir import load_classifier

ROOT = Path(__file__).parents[2]


def _tiny_classifier(dtype=torch.float64, embedding_size=None) -> SequenceClassifier:
    torch.manual_seed(0)
    cfg = EncoderConfig(vocab_size=50, hidden_size=12, num_layers=2, num_heads=2, intermediate_size=20,
                        max_position_embeddings=16, embedding_size=embedding_size, dropout=0.0, attention_dropout=0.0)
    model = SequenceClassifier(cfg, 3).to(dtype)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(-2, 2)  # make max|γ| differ between layers
    return model


def test_lipschitz_penalty_and_gradient_match_float64_reference():
    model = _tiny_classifier(embedding_size=8)  # embeddings_project is a Linear too
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(linears) == 2 * 6 + 1 + 2 and len(norms) == 2 * 2 + 1
    ours = lipschitz_penalty(model, backend="torch")
    ours.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ref = sum(max(sum(abs(float(m.weight.detach()[i, j])) for i in range(m.weight.shape[0]))
                  for j in range(m.weight.shape[1])) for m in linears)
    ref += sum(max(abs(float(v)) for v in m.weight.detach()) for m in norms)
    assert ours.item() == pytest.approx(ref, rel=1e-12)
    auto = sum(m.weight.abs().sum(0).max() for m in linears) + sum(m.weight.abs().max() for m in norms)
    auto.backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    assert not any("embeddings.word" in n or "bias" in n for n in got)  # embeddings and biases contribute 0
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0)


@pytest.mark.parametrize("schedule,t,total,expected", [
    ("linear", 0, 4, 0.0), ("linear", 1, 4, 0.25), ("linear", 3, 4, 0.75), ("linear", 4, 4, 1.0),
    ("cosine", 2, 4, math.cos(math.pi / 4)), ("cosine", 3, 4, math.cos(math.pi / 8)), ("cosine", 4, 4, 1.0),
    ("cyclic", 1, 4, math.sqrt(1 - 0.75**2)), ("cyclic", 2, 4, math.sqrt(0.75)), ("cyclic", 0, 4, 0.0),
    ("piecewise", 1, 3, 0.0), ("piecewise", 1.01, 3, 0.5), ("piecewise", 2, 3, 0.5), ("piecewise", 2.5, 3, 1.0),
])
def test_cr_weight_schedules(schedule, t, total, expected):
    assert cr_weight(schedule, t, total, 2.0) == pytest.approx(2.0 * expected, abs=1e-15)


@pytest.mark.parametrize("schedule", ["linear", "cosine", "cyclic", "piecewise"])
@pytest.mark.parametrize("num_epochs", [1, 2, 3, 5, 20])
def test_last_training_epoch_reaches_lambda_max(schedule, num_epochs):
    """Training epochs are 0-based; the papers' t is the 1-based epoch number, so epoch T−1 has λ_max."""
    weights = [cr_weight_for_epoch(schedule, e, num_epochs, 2.0) for e in range(num_epochs)]
    assert weights[-1] == 2.0
    assert all(0.0 <= w <= 2.0 for w in weights) and weights == sorted(weights)
    if schedule == "linear":  # (t/T)·λ_max at t = epoch + 1, in float64
        assert weights == pytest.approx([(e + 1) / num_epochs * 2.0 for e in range(num_epochs)], rel=0, abs=1e-15)
    if schedule == "piecewise" and num_epochs == 5:  # t = 1 | 2, 3 | 4, 5 in (0, 5/3], (5/3, 10/3], (10/3, 5]
        assert weights == [0.0, 1.0, 1.0, 2.0, 2.0]


def test_cr_weight_rejects_unknown_schedule():
    with pytest.raises(ValueError, match="soteacher.cr_schedule"):
        cr_weight("gaussian", 1, 4, 1.0)


def test_consistency_loss_against_direct_sum():
    g = torch.Generator().manual_seed(0)
    p = F.softmax(torch.randn(6, 4, generator=g, dtype=torch.float64), -1)
    q = F.softmax(torch.randn(6, 4, generator=g, dtype=torch.float64), -1)
    has = torch.tensor([True, True, False, True, False, True])
    ref = sum(float(((p[i] - q[i]) ** 2).sum()) for i in range(6) if has[i]) / 6
    assert consistency_loss(p, q, has).item() == pytest.approx(ref, rel=1e-14)


def test_store_running_mean_is_exact_across_epochs_and_reopening(tmp_path):
    rng = np.random.default_rng(0)
    n, k = 11, 3
    recorded: dict[int, list[np.ndarray]] = {i: [] for i in range(n)}
    store = ConsistencyStore(tmp_path / "cr", n, k)
    seen = [i for i in range(n) if i != 4]  # example 4 is never in the train split
    for epoch in range(5):
        if epoch == 3:  # reopen the memory-mapped files, as a resumed or later process would
            store.flush()
            del store
            store = ConsistencyStore(tmp_path / "cr", n, k, create=False)
        order = rng.permutation(seen)
        for batch in np.array_split(order, 3):
            probs = rng.dirichlet(np.ones(k), len(batch))
            store.update(torch.from_numpy(batch), torch.from_numpy(probs))
            for i, p in zip(batch, probs):
                recorded[int(i)].append(p)
    means, has = store.targets(torch.arange(n))
    for i in range(n):
        if not recorded[i]:
            assert not has[i] and means[i].eq(0).all()
            continue
        running = np.zeros(k)
        for c, p in enumerate(recorded[i]):  # the python reference of the same update rule
            running = running + (p - running) / (c + 1)
        assert np.array_equal(means[i].numpy(), running)
        np.testing.assert_allclose(means[i].numpy(), np.mean(recorded[i], axis=0), rtol=0, atol=1e-15)
    assert store.count.tolist() == [0 if i == 4 else 5 for i in range(n)]
    with pytest.raises(ConfigError, match="shape"):
        ConsistencyStore(tmp_path / "cr", n + 1, k, create=False)


def test_objective_records_its_predictions_and_skips_cr_in_epoch_zero(tmp_path):
    model = _tiny_classifier(torch.float32)
    store = ConsistencyStore(tmp_path / "cr", 20, 3)
    objective = SoTeacherObjective(SoTeacherConfig(lambda_lr=1e-3, lambda_cr=1.0), store, num_epochs=3)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(5, 50, (4, 10), generator=g), "attention_mask": torch.ones(4, 10),
             "token_type_ids": torch.zeros(4, 10, dtype=torch.long), "labels": torch.tensor([0, 1, 2, 1]),
             "index": torch.tensor([3, 17, 0, 9])}
    probs = []
    for epoch in range(3):
        loss, logits, logs = objective.loss(model, batch, epoch)
        p = F.softmax(logits.detach().double(), -1)
        ce = F.cross_entropy(logits, batch["labels"]).item()
        lip = lipschitz_penalty(model).item()
        if epoch == 0:
            assert "cr" not in logs and loss.item() == pytest.approx(ce + 1e-3 * lip, rel=1e-6)
        else:
            prev = torch.stack(probs).mean(0)
            cr = ((p - prev) ** 2).sum(-1).mean().item()
            assert logs["lambda_cr"] == pytest.approx((epoch + 1) / 3)  # 1-based epoch number: λ_max at the end
            assert loss.item() == pytest.approx(ce + 1e-3 * lip + (epoch + 1) / 3 * cr, rel=1e-5)
        probs.append(p)
        loss.backward()
        with torch.no_grad():  # move the model so the predictions differ between epochs
            for param in model.parameters():
                if param.grad is not None:
                    param -= 0.5 * param.grad
                    param.grad = None
    means, has = store.targets(batch["index"])
    assert has.all()
    torch.testing.assert_close(means, torch.stack(probs).mean(0), rtol=0, atol=1e-7)


@pytest.mark.slow
def test_tiny_soteacher_run(tiny_electra_run, tmp_path):
    run = tiny_electra_run
    hf = run / "hf" / "discriminator"
    common = ["finetune", "-c", str(ROOT / "configs" / "soteacher-rt.yaml"), f"model.path={hf}",
              f"soteacher.student.path={hf}", "task.max_train_examples=24", "task.max_dev_examples=16",
              "finetune.max_seq_len=32", "finetune.batch_size=8", "finetune.epochs=3", "finetune.lr=3e-3",
              "finetune.seeds=[0]", "run.progress_bar=false"]
    assert main([*common, f"run.dir={tmp_path / 'sot'}", "soteacher.lambda_lr=1e-2"]) == 0
    assert main([*common, f"run.dir={tmp_path / 'std'}", "soteacher.lambda_lr=0", "soteacher.lambda_cr=0",
                 "soteacher.distill_student=false"]) == 0
    summary = json.loads((tmp_path / "sot" / "summary.json").read_text())
    for key in ("accuracy", "ece", "nll", "ece_ts", "nll_ts", "temperature"):
        assert np.isfinite(summary["teacher"]["metrics"][key]["mean"]), key
    assert 0.0 <= summary["student"]["metrics"]["agreement"]["mean"] <= 1.0
    count = np.load(tmp_path / "sot" / "teacher" / "seed_0" / "cr_store" / "count.npy")
    assert sorted(set(count.tolist())) == [0, 3]  # every train example recorded once per epoch, keyed by index
    assert (count > 0).sum() == 24
    lips = {name: lipschitz_penalty(load_classifier(tmp_path / name / "teacher" / "seed_0" / "model")[0]).item()
            for name in ("sot", "std")}
    # The LR penalty shrank the teacher's Lipschitz sum (22.65 vs 24.40 measured; same seed and data).
    assert lips["sot"] < lips["std"] - 1.0, lips
