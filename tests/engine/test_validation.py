"""Validation while training: held-out split, metrics against a float64 reference, no effect on training."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from megakd.cli import main
from megakd.config import ConfigError, load_config
from megakd.data.loader import PretrainingLoader
from megakd.data.shards import in_valid_split, read_manifest
from megakd.data.sources import iter_documents
from megakd.data.tokenizer import Tokenizer
from megakd.engine.pretrain import open_trainer
from megakd.engine.validation import VALID_SEED
from megakd.objectives.electra import corrupt, roc_auc, rtd_labels, sample_replacements
from megakd.store import load_model
from megakd.store.checkpoint import latest_checkpoint
from megakd.store.checkpoint_models import load_checkpoint
from tests.distributed.harness import assert_resume_exact
from tests.helpers import mlm_logits, tiny_overrides, trained

VAL_KEYS = ("val_gen_loss", "val_gen_acc", "val_disc_loss", "val_disc_acc", "val_rtd_f1", "val_rtd_auc")


def _pairwise_auc(scores: list[float], labels: list[int]) -> float:
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_roc_auc_equals_the_pairwise_definition_with_ties():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 12, (300,), generator=g).float() / 4  # many ties
    labels = (torch.rand(300, generator=g) < 0.3).long()
    assert roc_auc(scores, labels) == pytest.approx(_pairwise_auc(scores.tolist(), labels.tolist()), abs=1e-12)
    assert roc_auc(scores, torch.zeros(300)) is None
    assert roc_auc(torch.tensor([0.1, 0.9]), torch.tensor([0, 1])) == 1.0


def test_valid_fraction_holds_out_documents_by_hash(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    docs = [f"Document number {i}. " + "Some words that repeat to fill the sample. " * (3 + i % 5) for i in range(60)]
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok, out = tmp_path / "tok", tmp_path / "shards"
    assert main(["data", "tokenizer", "--input", str(corpus), "--vocab-size", "300", "--out", str(tok)]) == 0
    assert main(["data", "shards", "--input", str(corpus), "--tokenizer", str(tok), "--seq-len", "32",
                 "--out", str(out), "--valid-fraction", "0.25"]) == 0
    held_out = sum(in_valid_split(d, 0.25) for d in iter_documents(corpus, "text"))
    assert 0 < held_out < len(docs)
    assert read_manifest(out / "valid")["sources"][0]["documents"] == held_out
    assert read_manifest(out)["sources"][0]["documents"] == len(docs) - held_out
    assert main(["data", "shards", "--input", str(corpus), "--tokenizer", str(tok), "--seq-len", "32",
                 "--out", str(tmp_path / "x"), "--valid-fraction", "1.5"]) == 2


def _cfg(tiny_data, run_dir, **extra):
    return load_config("configs/electra-tiny.yaml", tiny_overrides(tiny_data, run_dir, **{
        "train.max_steps": 4, "run.save_every": 2, "run.export_hf": "false", "run.keep_last": 0,
        "data.valid_shards": str(tiny_data[1]), "train.eval_samples": 12, **extra}))


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _reference_validation(tiny_data, step_dir, micro_batch: int, batches: int,
                          temperature: float = 1.0) -> dict[str, float]:
    """The validation numbers recomputed from a checkpoint with dense float64 logits.

    Only the generator's replacement draws are shared with the implementation (the same kernel and
    seed, at `temperature`); losses, accuracies, F1 and AUC are computed here from scratch.
    `auc_one_pair` is what one (replaced, original) pair adds to the AUC: a pair whose logits differ
    in float64 but tie in float32 counts ½ there, so the two AUCs may differ by that much.
    """
    models = load_checkpoint(step_dir)
    gen, disc = models.generator.eval().double(), models.discriminator.eval().double()
    loader = PretrainingLoader(tiny_data[1], Tokenizer.load(tiny_data[0]), micro_batch_size=micro_batch,
                               seed=VALID_SEED)
    rng = torch.Generator().manual_seed(VALID_SEED)
    ce, correct, masked, bce, tokens, tp, fp, fn = [0.0] * 8
    scores, labels = [], []
    with torch.no_grad():
        for _, batch in zip(range(batches), loader):
            mask = batch["mlm_mask"]
            hidden = gen.masked_hidden(gen(batch["masked_input_ids"], batch["attention_mask"]), mask)
            logits = F.linear(hidden, gen.head.decoder_weight, gen.head.bias)
            targets = batch["input_ids"][mask]
            ce += float(F.cross_entropy(logits, targets, reduction="sum"))
            correct += float((logits.argmax(-1) == targets).sum())
            masked += targets.numel()
            samples, _ = sample_replacements(hidden.float(), gen.head.decoder_weight.float(),
                                             gen.head.bias.float(), rng, temperature, "torch")
            corrupted = corrupt(batch["input_ids"], mask, samples)
            valid = batch["attention_mask"].bool()
            d = disc.rtd_logits(disc(corrupted, batch["attention_mask"]))[valid]
            y = rtd_labels(corrupted, batch["input_ids"])[valid]
            bce += float(F.binary_cross_entropy_with_logits(d, y.double(), reduction="sum"))
            tokens += y.numel()
            tp += float(((d > 0) & (y == 1)).sum())
            fp += float(((d > 0) & (y == 0)).sum())
            fn += float(((d <= 0) & (y == 1)).sum())
            scores += d.tolist()
            labels += y.tolist()
    return {"val_gen_loss": ce / masked, "val_gen_acc": correct / masked, "val_disc_loss": bce / tokens,
            "val_disc_acc": (tokens - fp - fn) / tokens, "val_rtd_f1": 2 * tp / (2 * tp + fp + fn),
            "val_rtd_auc": _pairwise_auc(scores, labels),
            "auc_one_pair": 1 / (sum(labels) * (len(labels) - sum(labels)))}


# Annealed 3 -> 1 over 8 steps, the validation after step 4 draws at temperature 2.
ANNEALED = {"electra.sampling_temperature": 3.0, "electra.sampling_temperature_end": 1.0,
            "electra.sampling_anneal_steps": 8}


@pytest.mark.parametrize("extra,temperature", [({}, 1.0), (ANNEALED, 2.0)], ids=["constant", "annealed"])
def test_validation_numbers_match_a_float64_reference(tiny_data, tmp_path, extra, temperature):
    run = tmp_path / "run"
    trained(_cfg(tiny_data, run, **{"train.eval_every": 2, "kernels.backend": "torch", **extra}))
    rows = {r["step"]: r for r in _metrics(run)}
    assert all(k in rows[2] and k in rows[4] for k in VAL_KEYS) and "val_gen_loss" not in rows[3]
    want = _reference_validation(tiny_data, latest_checkpoint(run), micro_batch=4, batches=3,  # 12 samples / 4
                                 temperature=temperature)
    for key in VAL_KEYS:
        abs_tol = want["auc_one_pair"] if key == "val_rtd_auc" else 1e-7
        assert math.isclose(rows[4][key], want[key], rel_tol=1e-5, abs_tol=abs_tol), (key, rows[4][key], want[key])


@pytest.mark.slow
def test_validation_leaves_training_and_exact_resume_untouched(tiny_data, tmp_path):
    with_eval, without = tmp_path / "eval", tmp_path / "plain"
    trained(_cfg(tiny_data, with_eval, **{"train.eval_every": 2}))
    trained(_cfg(tiny_data, without))
    training_keys = [k for k in _metrics(without)[0] if k != "tokens_per_s"]
    for a, b in zip(_metrics(with_eval), _metrics(without), strict=True):
        assert {k: a[k] for k in training_keys} == {k: b[k] for k in training_keys}
    resumed = tmp_path / "resumed"
    trained(_cfg(tiny_data, resumed, **{"train.eval_every": 2}), str(with_eval / "checkpoints" / "step_00000002"))
    assert_resume_exact(with_eval, resumed, [3, 4], ("generator", "discriminator"))
    assert "val_rtd_auc" in _metrics(resumed)[-1]


def test_eval_every_without_validation_shards_is_one_line(tiny_data, tmp_path):
    cfg = load_config("configs/electra-tiny.yaml", tiny_overrides(tiny_data, tmp_path / "run", **{
        "train.eval_every": 5}))
    with pytest.raises(ConfigError, match="train.eval_every=5 needs validation shards"):
        open_trainer(cfg)


def test_mlm_student_with_a_teacher_logs_teacher_agreement(tiny_data, tiny_electra_run, tmp_path):
    """BERT-MLM under DWT: val_gen_* and val_teacher_agreement against dense float64 argmaxes."""
    run = tmp_path / "student"
    cfg = load_config("configs/dwt-tiny.yaml", tiny_overrides(tiny_data, run, **{
        "train.max_steps": 2, "run.export_hf": "false", "data.valid_shards": str(tiny_data[1]),
        "train.eval_every": 2, "train.eval_samples": 8, "distill.teacher": str(tiny_electra_run),
        "model.generator.dropout": 0.0}))
    trained(cfg)
    row = _metrics(run)[-1]
    assert set(row) >= {"val_gen_loss", "val_gen_acc", "val_teacher_agreement"} and "val_rtd_f1" not in row
    student = load_checkpoint(latest_checkpoint(run)).generator.eval().double()
    teacher = load_model(tiny_electra_run, "distill.teacher").get("masked_lm").eval().double()
    loader = PretrainingLoader(tiny_data[1], Tokenizer.load(tiny_data[0]), micro_batch_size=4, seed=VALID_SEED)
    ce = agree = correct = masked = 0.0
    with torch.no_grad():
        for _, batch in zip(range(2), loader):
            mask, ids = batch["mlm_mask"], batch["masked_input_ids"]
            s_logits = mlm_logits(student, ids, batch["attention_mask"])[mask]
            t_logits = mlm_logits(teacher, ids, batch["attention_mask"])[mask]
            targets = batch["input_ids"][mask]
            ce += float(F.cross_entropy(s_logits, targets, reduction="sum"))
            correct += float((s_logits.argmax(-1) == targets).sum())
            agree += float((s_logits.argmax(-1) == t_logits.argmax(-1)).sum())
            masked += targets.numel()
    assert math.isclose(row["val_gen_loss"], ce / masked, rel_tol=1e-5)
    assert row["val_gen_acc"] == pytest.approx(correct / masked, abs=1e-12)
    assert row["val_teacher_agreement"] == pytest.approx(agree / masked, abs=1e-12)
