"""Standalone-generator RTD evaluation: determinism, one corruption for every discriminator, counts, CLI."""

from __future__ import annotations

import json

import pytest
import torch

from megakd.cli import main as cli_main
from megakd.config import load_config
from megakd.convert import save_model_dir
from megakd.data.loader import PretrainingLoader
from megakd.data.tokenizer import Tokenizer
from megakd.engine.pretrain import run_pretraining
from megakd.eval.rtd import corrupted_batches, evaluate_rtd
from megakd.models.electra import Discriminator
from megakd.store import StoreError
from megakd.store.checkpoint_models import load_checkpoint, resolve_checkpoint
from tests.helpers import tiny_overrides


@pytest.fixture(scope="module")
def models(tiny_data, tmp_path_factory):
    """(ELECTRA run dir, a second discriminator as a megakd model dir): real trained + random weights."""
    root = tmp_path_factory.mktemp("rtd_eval")
    run = root / "electra"
    run_pretraining(load_config("configs/electra-tiny.yaml", tiny_overrides(
        tiny_data, run, **{"train.max_steps": 4, "run.export_hf": "false"})))
    cfg = load_checkpoint(resolve_checkpoint(run)).cfg
    torch.manual_seed(5)
    other = save_model_dir(Discriminator(cfg.model.discriminator), "discriminator", root / "disc2",
                           tokenizer_dir=tiny_data[0])
    return run, other


def _evaluate(tiny_data, generator, discriminators, **kw):
    return evaluate_rtd(generator, discriminators, tiny_data[1], tiny_data[0], num_batches=3, batch_size=4, **kw)


def test_same_result_twice_and_same_corruption_for_every_discriminator(tiny_data, models):
    run, other = models
    both = _evaluate(tiny_data, run, [run, other], seed=3)
    assert both == _evaluate(tiny_data, run, [run, other], seed=3)
    first, second = both["discriminators"]
    alone = [_evaluate(tiny_data, run, [d], seed=3)["discriminators"][0] for d in (run, other)]
    assert alone == [first, second]  # a discriminator's score does not depend on who else is scored
    assert first["masked"] == second["masked"] and first["replaced"] == second["replaced"] > 0
    assert first["tokens"] == second["tokens"]
    assert first != second  # the two discriminators really differ


def test_scores_match_counts_on_the_corrupted_batches(tiny_data, models):
    run, other = models
    ckpt = load_checkpoint(resolve_checkpoint(run))
    tok = Tokenizer.load(tiny_data[0])

    def batches(seed):
        loader = PretrainingLoader(tiny_data[1], tok, micro_batch_size=4, seed=seed)
        return list(corrupted_batches(ckpt.generator, loader, 3, seed=seed))

    first, again, other_seed = batches(3), batches(3), batches(4)
    for a, b in zip(first, again):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a["corrupted"], b["corrupted"]) for a, b in zip(first, other_seed))
    tp = fp = fn = tn = 0
    with torch.no_grad():
        for b in first:
            logits = ckpt.discriminator.rtd_logits(ckpt.discriminator(b["corrupted"], b["attention_mask"]))
            real = b["attention_mask"].bool()
            pred, gold = (logits > 0)[real], (b["corrupted"] != b["original"])[real]
            assert torch.equal(b["corrupted"][~b["mlm_mask"]], b["original"][~b["mlm_mask"]])
            tp += int((pred & gold).sum())
            fp += int((pred & ~gold).sum())
            fn += int((~pred & gold).sum())
            tn += int((~pred & ~gold).sum())
    got = _evaluate(tiny_data, run, [run], seed=3)["discriminators"][0]
    assert got["tokens"] == tp + fp + fn + tn and got["replaced"] == tp + fn
    assert got["accuracy"] == pytest.approx((tp + tn) / (tp + fp + fn + tn))
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn)
    assert got["precision"] == pytest.approx(precision) and got["recall"] == pytest.approx(recall)
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    assert got["f1"] == pytest.approx(f1)


def test_cli_writes_the_report_and_rejects_bad_models(tiny_data, models, tmp_path, capsys):
    run, other = models
    out = tmp_path / "rtd.json"
    args = ["eval-rtd", "--generator", str(run), "--discriminator", str(run), str(other), "--shards",
            str(tiny_data[1]), "--batches", "3", "--batch-size", "4", "--seed", "3"]
    assert cli_main([*args, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == report
    expected = json.loads(json.dumps(_evaluate(tiny_data, run, [run, other], seed=3)))
    assert report.pop("tokenizer").endswith("step_00000004/tokenizer")  # default: the generator's own copy
    expected.pop("tokenizer")
    assert report == expected
    # a discriminator where the generator belongs, and vice versa: one-line errors naming the flag
    assert cli_main(["eval-rtd", "--generator", str(other), "--discriminator", str(run),
                     "--shards", str(tiny_data[1])]) == 2
    assert "--generator" in capsys.readouterr().err
    ckpt = load_checkpoint(resolve_checkpoint(run))
    mlm = save_model_dir(ckpt.generator, "masked_lm", tmp_path / "mlm", tokenizer_dir=ckpt.tokenizer_dir)
    with pytest.raises(StoreError, match="--discriminator=.*expected an ELECTRA discriminator"):
        evaluate_rtd(run, [mlm], tiny_data[1])


def test_standalone_generator_recipes_are_4_layer_mlms_with_the_discriminators_width():
    for recipe, parent in (("rtd-generator-base", "electra-base"), ("rtd-generator-tiny", "electra-tiny")):
        cfg, base = load_config(f"configs/{recipe}.yaml"), load_config(f"configs/{parent}.yaml")
        g, d = cfg.model.generator, base.model.discriminator
        assert cfg.model.objective == "mlm" and g.num_layers == 4
        assert (g.hidden_size, g.num_heads, g.intermediate_size, g.vocab_size, g.position_encoding, g.init) == \
            (d.hidden_size, d.num_heads, d.intermediate_size, d.vocab_size, d.position_encoding, d.init)
        assert cfg.train.max_steps == base.train.max_steps and cfg.data == base.data


def test_a_standalone_generator_run_scores_discriminators(tiny_data, models, tmp_path, capsys):
    run, other = models
    generator = tmp_path / "rtd-generator"
    run_pretraining(load_config("configs/rtd-generator-tiny.yaml", tiny_overrides(
        tiny_data, generator, **{"train.max_steps": 2, "run.export_hf": "false", "model.generator.num_layers": 4})))
    assert load_checkpoint(resolve_checkpoint(generator)).generator.config.num_layers == 4
    assert cli_main(["eval-rtd", "--generator", str(generator), "--discriminator", str(run), str(other),
                     "--shards", str(tiny_data[1]), "--batches", "2", "--batch-size", "4"]) == 0
    scores = json.loads(capsys.readouterr().out)["discriminators"]
    assert [s["path"] for s in scores] == [str(run), str(other)] and all(0 <= s["f1"] <= 1 for s in scores)
    direct = evaluate_rtd(generator, [run, other], tiny_data[1], num_batches=2, batch_size=4)
    assert scores == json.loads(json.dumps(direct["discriminators"]))
