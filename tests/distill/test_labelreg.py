"""Label regularisation targets against float64 references, and the equivalences of docs/methods.md § The KD family."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megakd.objectives.labelreg import labelreg_loss, smoothed_targets

K = 5


def _inputs(seed: int = 0, batch: int = 7):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, K, generator=g, dtype=torch.float64) * 2
    teacher = torch.randn(batch, K, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, K, (batch,), generator=g)
    return logits, teacher, labels


def _np_log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _reference(logits, labels, target, alpha=0.0, a=0.95, tau=1.0, tau_sq=False, teacher=None) -> float:
    """Direct per-example float64 formulas from the papers, one example at a time."""
    z, y = logits.numpy(), labels.numpy()
    total = 0.0
    for i in range(len(y)):
        logp = _np_log_softmax(z[i])
        q = np.zeros(K)
        q[y[i]] = 1.0
        if target == "onehot":
            total += -logp[y[i]]
        elif target == "ls":
            total += -sum(((1 - alpha) * q[k] + alpha / K) * logp[k] for k in range(K))
        elif target == "tfreg":
            pd = [a if k == y[i] else (1 - a) / (K - 1) for k in range(K)]
            total += -sum(((1 - alpha) * q[k] + alpha * pd[k]) * logp[k] for k in range(K))
        else:
            pt = np.exp(_np_log_softmax(teacher.numpy()[i] / tau))
            ps_log = _np_log_softmax(z[i] / tau)
            kl = sum(pt[k] * (np.log(pt[k]) - ps_log[k]) for k in range(K))
            total += (1 - alpha) * -logp[y[i]] + alpha * (tau**2 if tau_sq else 1.0) * kl
    return total / len(y)


@pytest.mark.parametrize("target,kwargs", [
    ("onehot", {}),
    ("ls", {"alpha": 0.1}),
    ("tfreg", {"alpha": 0.5, "a": 0.95}),
    ("kd", {"alpha": 0.5, "temperature": 1.0}),
    ("kd", {"alpha": 0.9, "temperature": 4.0, "tau_squared": True}),
    ("kd", {"alpha": 0.3, "temperature": 2.0, "tau_squared": False}),
    ("selfkd", {"alpha": 0.5}),
])
def test_loss_matches_float64_reference(target, kwargs):
    logits, teacher, labels = _inputs()
    ours = labelreg_loss(logits, labels, target, teacher_logits=teacher, **kwargs)
    ref = _reference(logits, labels, target, kwargs.get("alpha", 0.0), kwargs.get("a", 0.95),
                     kwargs.get("temperature", 1.0), kwargs.get("tau_squared", False), teacher)
    assert ours.item() == pytest.approx(ref, rel=1e-12, abs=1e-12)


def _grad(fn, logits):
    x = logits.clone().requires_grad_(True)
    fn(x).backward()
    return x.grad


def test_kd_at_tau_one_is_ce_against_mixed_targets():
    """[D3]: with τ = 1, KD = CE against (1−α)q + αp^t, up to the teacher's entropy (same gradient)."""
    logits, teacher, labels = _inputs(1)
    alpha = 0.7
    pt = F.softmax(teacher, -1)
    mixed = (1 - alpha) * F.one_hot(labels, K).double() + alpha * pt

    def soft_ce(x):
        return -(mixed * F.log_softmax(x, -1)).sum(-1).mean()

    def kd(x):
        return labelreg_loss(x, labels, "kd", alpha=alpha, teacher_logits=teacher)

    entropy = -(pt * pt.log()).sum(-1).mean()
    assert kd(logits).item() == pytest.approx((soft_ce(logits) - alpha * entropy).item(), abs=1e-12)
    torch.testing.assert_close(_grad(kd, logits), _grad(soft_ce, logits), rtol=0, atol=1e-12)


def test_tfreg_is_ls_with_reparameterised_alpha():
    """TF-reg(α, a) = LS(α') with α' = αK(1−a)/(K−1)."""
    logits, _, labels = _inputs(2)
    alpha, a = 0.5, 0.9
    tf = labelreg_loss(logits, labels, "tfreg", alpha=alpha, a=a)
    ls = labelreg_loss(logits, labels, "ls", alpha=alpha * K * (1 - a) / (K - 1))
    assert tf.item() == pytest.approx(ls.item(), abs=1e-12)
    torch.testing.assert_close(smoothed_targets(labels, K, "tfreg", alpha, a, torch.float64),
                               smoothed_targets(labels, K, "ls", alpha * K * (1 - a) / (K - 1), dtype=torch.float64),
                               rtol=0, atol=1e-15)


def test_targets_are_distributions_and_alpha_zero_is_onehot():
    _, teacher, labels = _inputs(3)
    for target in ("ls", "tfreg"):
        q = smoothed_targets(labels, K, target, 0.3, 0.8)
        torch.testing.assert_close(q.sum(-1), torch.ones(len(labels)))
        assert (q > 0).all()
        assert torch.equal(smoothed_targets(labels, K, target, 0.0), smoothed_targets(labels, K, "onehot"))
    logits = _inputs(3)[0]
    assert labelreg_loss(logits, labels, "kd", alpha=0.0, teacher_logits=teacher).item() == \
        pytest.approx(F.cross_entropy(logits, labels).item(), abs=1e-12)


def test_teacher_gets_no_gradient_and_missing_teacher_is_an_error():
    logits, teacher, labels = _inputs(4)
    teacher = teacher.clone().requires_grad_(True)
    labelreg_loss(logits.requires_grad_(True), labels, "kd", alpha=0.5, teacher_logits=teacher).backward()
    assert teacher.grad is None
    with pytest.raises(ValueError, match="needs teacher logits"):
        labelreg_loss(logits, labels, "kd", alpha=0.5)
    with pytest.raises(ValueError, match="labelreg.target"):
        labelreg_loss(logits, labels, "mixup")


def test_annealing_kd_schedule_and_loss_match_float64_reference():
    """Table 11's setting (τ_max 10, 20 phase-I epochs, 30 in all): T falls 10 → 1 over phase I, Φ(T) =
    1 − (T − 1)/τ_max scales the teacher's logits, phase II is CE on the labels."""
    from megakd.finetune.config import LabelregConfig
    from megakd.finetune.objectives import LabelregObjective
    from megakd.objectives.labelreg import akd_temperature, annealing_kd_loss

    temperatures = [akd_temperature(e, 20, 10.0) for e in range(30)]
    assert temperatures[0] == 10.0 and temperatures[19] == 1.0 and temperatures[20:] == [None] * 10
    assert temperatures[:20] == pytest.approx([10.0 - 9.0 * e / 19 for e in range(20)], rel=0, abs=1e-15)
    assert akd_temperature(0, 1, 10.0) == 1.0  # one phase-I epoch: straight to the teacher's logits

    logits, teacher, labels = _inputs(3)
    cfg = LabelregConfig(target="akd", temperature=10.0, akd_phase1_epochs=20, teacher="t")
    objective = LabelregObjective(cfg, K, teacher)
    batch = {"labels": labels, "row": torch.arange(len(labels))}
    z, zt = logits.numpy(), teacher.numpy()
    for epoch in (0, 7, 19):
        t = 10.0 - 9.0 * epoch / 19
        phi = 1 - (t - 1) / 10
        ref = sum(sum((z[i, k] - phi * zt[i, k]) ** 2 for k in range(K)) for i in range(len(z))) / len(z)
        assert annealing_kd_loss(logits, teacher, t, 10.0).item() == pytest.approx(ref, rel=1e-13)
        assert objective.loss_from_logits(logits, batch, epoch).item() == pytest.approx(ref, rel=1e-13)
    assert objective.loss_from_logits(logits, batch, 19).item() == pytest.approx(
        ((z - zt) ** 2).sum(-1).mean(), rel=1e-13)  # T = 1: regress onto the teacher's own logits
    assert objective.loss_from_logits(logits, batch, 25).item() == pytest.approx(
        _reference(logits, labels, "onehot"), rel=1e-13)  # phase II
    with pytest.raises(ValueError, match="akd"):
        labelreg_loss(logits, labels, "akd", teacher_logits=teacher)


@pytest.mark.parametrize("overrides,match", [
    (["labelreg.akd_phase1_epochs=0"], "akd_phase1_epochs"),
    (["labelreg.akd_phase1_epochs=4"], "akd_phase1_epochs"),  # more than finetune.epochs=3
    (["labelreg.akd_phase1_epochs=2", "labelreg.temperature=0.5"], "temperature"),
])
def test_annealing_kd_config_is_checked(overrides, match):
    from megakd.config import ConfigError, load_config
    from megakd.finetune.config import FinetuneConfig

    base = ["model.path=x", "labelreg.target=akd", "labelreg.teacher=t", "finetune.epochs=3"]
    with pytest.raises(ConfigError, match=match):
        load_config(None, [*base, *overrides], cls=FinetuneConfig)
    load_config(None, [*base, "labelreg.akd_phase1_epochs=2", "labelreg.temperature=10"], cls=FinetuneConfig)


def _classifier(layers: int, hidden: int, seed: int = 0):
    from megakd.models.electra import SequenceClassifier
    from megakd.models.encoder import EncoderConfig
    from tests.helpers import TINY_VOCAB

    torch.manual_seed(seed)
    return SequenceClassifier(EncoderConfig(vocab_size=TINY_VOCAB, hidden_size=hidden, num_layers=layers, num_heads=2,
                                            intermediate_size=2 * hidden, max_position_embeddings=32), 2)


def test_selfkd_teacher_must_have_the_students_architecture(tiny_data, tmp_path):
    from megakd.config import ConfigError
    from megakd.data.tokenizer import Tokenizer
    from megakd.finetune.trainer import check_same_architecture
    from megakd.store.model_dir import save_classifier

    tokenizer = Tokenizer.load(tiny_data[0])
    student = _classifier(2, 16)
    same = save_classifier(_classifier(2, 16, seed=1), tokenizer, tmp_path / "same")
    other = save_classifier(_classifier(1, 24), tokenizer, tmp_path / "other")
    check_same_architecture(student, str(same))  # a fine-tuned copy: accepted
    with pytest.raises(ConfigError) as err:
        check_same_architecture(student, str(other))
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"labelreg.teacher: {other} is 1 layers x 24 hidden")
    assert "the student 2 layers x 16 hidden" in message and "use kd" in message


@pytest.mark.slow
def test_annealing_kd_and_selfkd_refusal_through_the_cli(tiny_electra_run, tiny_data, tmp_path):
    from megakd.cli import main
    from megakd.data.tokenizer import Tokenizer
    from megakd.store.model_dir import save_classifier

    student_path = tiny_electra_run / "hf" / "discriminator"
    teacher = save_classifier(_classifier(1, 24), Tokenizer.load(tiny_data[0]), tmp_path / "teacher")
    common = ["finetune", "-c", "configs/finetune-rt.yaml", f"model.path={student_path}", "run.progress_bar=false",
              "task.max_train_examples=16", "task.max_dev_examples=8", "finetune.max_seq_len=32",
              "finetune.batch_size=8", "finetune.epochs=3", "finetune.seeds=[0]", "finetune.log_every=1",
              f"labelreg.teacher={teacher}"]
    run = tmp_path / "akd"
    assert main([*common, f"run.dir={run}", "labelreg.target=akd", "labelreg.temperature=10",
                 "labelreg.akd_phase1_epochs=2"]) == 0
    losses = json.loads((run / "seed_0" / "result.json").read_text())["train_loss"]
    assert len(losses) == 3 and np.isfinite(losses).all()
    bad = tmp_path / "selfkd"
    assert main([*common, f"run.dir={bad}", "labelreg.target=selfkd", "labelreg.alpha=0.5"]) == 2
    assert not (bad / "seed_0" / "result.json").exists()
