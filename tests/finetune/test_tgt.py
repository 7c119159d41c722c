"""TGT: random-mode generation, gradient-mode ascent, the objective of docs/methods.md § TGT, and a tiny CLI run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megakd.cli import main
from megakd.data.masking import num_to_mask
from megakd.data.tasks import EncodedTask, Example
from megakd.data.tokenizer import Tokenizer
from megakd.finetune.config import TGTConfig
from megakd.finetune.tgt import TeacherGenerator, TGTObjective
from megakd.models.electra import MaskedLM, SequenceClassifier
from megakd.models.encoder import EncoderConfig
from megakd.store.model_dir import save_classifier
from tests.helpers import TINY_VOCAB

ROOT = Path(__file__).parents[2]
SENTENCES = [("It is a truth universally acknowledged.", None), ("Emma Woodhouse, handsome, clever, and rich.", None),
             ("In the beginning God created the heaven.", "And the earth was without form."),
             ("She was the youngest of the two daughters.", "Her mother had died too long ago.")]


def _config(hidden: int, layers: int) -> EncoderConfig:
    return EncoderConfig(vocab_size=TINY_VOCAB, hidden_size=hidden, num_layers=layers, num_heads=2,
                         intermediate_size=2 * hidden, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)


@pytest.fixture(scope="module")
def parts(tiny_data):
    tok = Tokenizer.load(tiny_data[0])
    torch.manual_seed(0)
    mlm = MaskedLM(_config(24, 1)).double()
    student = SequenceClassifier(_config(16, 1), 3).double()
    labeler = SequenceClassifier(_config(32, 2), 3).double()
    for m in (student, labeler):  # larger head weights: disagreement with a clear gradient
        torch.nn.init.normal_(m.head.out_proj.weight, std=1.0)
    task = EncodedTask([Example(i, a, b, i % 3) for i, (a, b) in enumerate(SENTENCES)], tok, 64, regression=False)
    batch = {**task.batch(range(len(SENTENCES))), "row": torch.arange(len(SENTENCES))}
    return tok, mlm, student, labeler, batch


def test_random_mode_changes_only_masked_positions(parts):
    tok, mlm, _, _, batch = parts
    cfg = TGTConfig(mask_prob=0.3, noise_std=0.5)
    gen = TeacherGenerator(mlm, tok, cfg, seed=3)
    out, mask = gen.random(batch, epoch=1)
    ids = batch["input_ids"]
    assert out.shape == ids.shape and out.dtype == ids.dtype
    assert ((out >= 0) & (out < TINY_VOCAB)).all()
    assert torch.equal(out[~mask], ids[~mask])  # outside the mask: exactly the input
    maskable = batch["attention_mask"].bool() & ~torch.isin(ids, torch.tensor(sorted(tok.special_ids)))
    assert not (mask & ~maskable).any()  # specials and padding never resampled
    assert mask.sum(1).tolist() == num_to_mask(maskable.sum(1).numpy(), 0.3).tolist()
    assert (out[mask] != ids[mask]).float().mean() > 0.5  # a random MLM rarely redraws the original
    again, _ = TeacherGenerator(mlm, tok, cfg, seed=3).random(batch, epoch=1)
    assert torch.equal(out, again)
    other_epoch, other_mask = TeacherGenerator(mlm, tok, cfg, seed=3).random(batch, epoch=2)
    assert not torch.equal(mask, other_mask)


def test_normalized_ascent_step_increases_the_disagreement(parts):
    tok, mlm, student, labeler, batch = parts
    cfg = TGTConfig(mode="gradient", ascent="normalized", mask_prob=0.3, step_size=1e-2)
    gen = TeacherGenerator(mlm, tok, cfg, seed=0)
    mask = gen.mask(batch, 0)
    e0 = gen.start_embeddings(batch, mask)
    e1 = gen.ascend(e0, batch, mask, student, labeler)
    j0 = gen.disagreement(e0, batch, mask, student, labeler).item()
    j1 = gen.disagreement(e1, batch, mask, student, labeler).item()
    assert j1 > j0 > 0, (j0, j1)
    step = (e1 - e0).flatten(1).norm(dim=1)
    torch.testing.assert_close(step, torch.full_like(step, 1e-2))  # η per example
    assert all(p.grad is None for p in [*student.parameters(), *labeler.parameters(), *mlm.parameters()])
    student.train()
    out, mask = gen.gradient(batch, 0, student, labeler)
    assert torch.equal(out[~mask], batch["input_ids"][~mask]) and ((out >= 0) & (out < TINY_VOCAB)).all()
    assert student.training  # searched in eval mode, training mode restored


def test_paper_ascent_is_the_straight_through_gradient_of_the_soft_label_ce(parts):
    """Paper mode: forward on the discrete argmax decoding, e ← e + η·∇Σ H(h, f) with the straight-through
    gradient, checked against an independent float64 reference R(e) whose autograd gradient at e0 is that
    estimator: the decoded tokens' embedding rows plus (π(e) − π(e0))·W_emb."""
    tok, mlm, student, labeler, batch = parts
    eta = 1e-3
    gen = TeacherGenerator(mlm, tok, TGTConfig(mode="gradient", mask_prob=0.3, step_size=eta), seed=0)
    assert gen.cfg.ascent == "paper"  # the default
    mask = gen.mask(batch, 0)
    e0 = gen.start_embeddings(batch, mask).detach()
    am, tt, ids = batch["attention_mask"], batch["token_type_ids"], batch["input_ids"]

    def pi(e):  # the MLM head (transform, then the tied decoder) at the masked positions
        return F.softmax(mlm.head(mlm(attention_mask=am, token_type_ids=tt, inputs_embeds=e)[mask]), -1)

    pi0 = pi(e0).detach()
    decoded = ids.clone()
    decoded[mask] = pi0.argmax(-1)  # x̃ = argmax Dec(e0) at the masked positions

    def reference(e):
        def logits(model):
            rows = model.encoder.embeddings.word_embeddings(decoded)
            rows = rows + torch.zeros_like(rows).masked_scatter(
                mask[..., None], (pi(e) - pi0) @ model.encoder.embeddings.word_embeddings.weight)
            return model(attention_mask=am, token_type_ids=tt, inputs_embeds=rows)

        h = F.softmax(logits(labeler), -1)
        return -(h * F.log_softmax(logits(student), -1)).sum()

    # forward = the discrete tokens: J(e0) is Σ H(h(x̃), f(x̃)) of the models run on the token ids
    with torch.no_grad():
        discrete = -(F.softmax(labeler(decoded, am, tt), -1) * F.log_softmax(student(decoded, am, tt), -1)).sum()
    j0 = gen.disagreement(e0, batch, mask, student, labeler)
    assert j0.item() == pytest.approx(discrete.item(), rel=1e-12)

    e = e0.clone().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(reference(e), e)
    assert g_ref[~mask].abs().sum() > 0  # the gradient reaches unmasked positions through the MLM's attention
    e1 = gen.ascend(e0, batch, mask, student, labeler)
    torch.testing.assert_close(e1 - e0, eta * g_ref, rtol=1e-9, atol=1e-15)  # unnormalized: η·∇
    # the reference's gradient is right (central differences) and the step raises it to first order
    unit, eps = g_ref / g_ref.norm(), 1e-4
    with torch.no_grad():
        directional = (reference(e0 + eps * unit) - reference(e0 - eps * unit)) / (2 * eps)
        assert directional.item() == pytest.approx(g_ref.norm().item(), rel=1e-4)
        assert reference(e0 + 1e-2 * unit) > reference(e0)
    assert all(p.grad is None for p in [*student.parameters(), *labeler.parameters(), *mlm.parameters()])


def test_objective_is_ce_plus_soft_labels_on_real_and_generated(parts):
    tok, mlm, student, labeler, batch = parts
    cfg = TGTConfig(mask_prob=0.3)
    objective = TGTObjective(TeacherGenerator(mlm, tok, cfg, seed=7), labeler)
    loss, logits, logs = objective.loss(student, batch, epoch=0)
    generated, _ = TeacherGenerator(mlm, tok, cfg, seed=7).random(batch, epoch=0)
    am, tt = batch["attention_mask"], batch["token_type_ids"]

    def soft_ce(ids):
        h = F.softmax(labeler(ids, am, tt), -1)
        return -(h * F.log_softmax(student(ids, am, tt), -1)).sum(-1).mean()

    ref = F.cross_entropy(student(batch["input_ids"], am, tt), batch["labels"]) + soft_ce(batch["input_ids"]) + \
        soft_ce(generated)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    assert logs["kd_generated"] == pytest.approx(soft_ce(generated).item(), rel=1e-12)
    loss.backward()
    assert all(p.grad is None for p in labeler.parameters())


@pytest.mark.slow
def test_tiny_tgt_run_from_a_pretraining_run(tiny_data, tiny_electra_run, tmp_path):
    run = tiny_electra_run
    torch.manual_seed(0)
    labeler_dir = save_classifier(SequenceClassifier(_config(32, 1), 2), Tokenizer.load(tiny_data[0]),
                                  tmp_path / "labeler")
    for mode in ("random", "gradient"):
        out = tmp_path / mode
        assert main(["finetune", "-c", str(ROOT / "configs" / "tgt-rt.yaml"), f"run.dir={out}",
                     f"model.path={run / 'hf' / 'discriminator'}", f"tgt.generator={run}", f"tgt.labeler={labeler_dir}",
                     f"tgt.mode={mode}", "task.max_train_examples=16", "task.max_dev_examples=8",
                     "finetune.max_seq_len=32", "finetune.batch_size=8", "finetune.epochs=1", "finetune.seeds=[0]",
                     "finetune.log_every=1", "run.progress_bar=false"]) == 0
        steps = [json.loads(x) for x in (out / "seed_0" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in steps if "kd_generated" in r]
        assert len(steps) == 2 and all(np.isfinite(r["loss"]) and 0 < r["changed_frac"] <= 1 for r in steps)
