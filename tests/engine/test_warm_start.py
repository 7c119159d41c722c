"""Warm start (`init.*`): new runs begin from stored weights, exactly, with fresh optimizer state.

Sources are built locally: HF ELECTRA/BERT models from configs with the WordPiece tokenizer of
`wordpiece_data`, and a 2-step megakd run on the same data (its run dir, checkpoint, HF export and
a model dir converted from it). No hub.
"""

from __future__ import annotations

import copy
import json
import pickle
import shutil

import pytest
import torch

from megakd.cli import main
from megakd.config import ConfigError, load_config
from megakd.convert import from_hf
from megakd.engine.pretrain import build_trainer, run_distill, run_pretraining
from megakd.models.electra import Discriminator, MaskedLM
from megakd.store import StoreError, load_model
from tests.helpers import auto_vocab_overrides, mlm_logits, save_tiny_hf_model, tiny_overrides

CONFIG = "configs/electra-tiny.yaml"


def _cfg(data, run_dir, **extra):
    return load_config(CONFIG, auto_vocab_overrides(data, run_dir, **{"run.export_hf": "false", **extra}))


def _batch(trainer):
    return next(iter(trainer.loader))


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_hf_discriminator_gives_hf_logits_before_any_step(wordpiece_data, tmp_path):
    hf = save_tiny_hf_model("ElectraForPreTraining", tmp_path / "hf", wordpiece_data[0])
    cfg = _cfg(wordpiece_data, tmp_path / "run", **{"init.from": tmp_path / "hf"})
    trainer = build_trainer(cfg)
    disc, gen = trainer.units["discriminator"].model, trainer.units["generator"].model
    assert trainer.step == 0 and all(not u.optimizer.state for u in trainer.units.values())
    batch = _batch(trainer)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    ours = copy.deepcopy(disc).double().eval()
    with torch.no_grad():
        expected = hf.double()(input_ids=ids, attention_mask=mask.long()).logits
        got = ours.rtd_logits(ours(ids, mask))
    assert (got - expected)[mask].abs().max() <= 1e-12
    # the generator, absent from the source, is the ordinary random init of train.seed
    torch.manual_seed(cfg.train.seed)
    fresh = MaskedLM(cfg.model.generator)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in gen.state_dict().items())


def test_hf_bert_mlm_gives_hf_logits(wordpiece_data, tmp_path):
    hf = save_tiny_hf_model("BertForMaskedLM", tmp_path / "bert", wordpiece_data[0])
    trainer = build_trainer(_cfg(wordpiece_data, tmp_path / "run", **{"model.objective": "mlm",
                                                                      "init.from": tmp_path / "bert"}))
    batch = _batch(trainer)
    ids, mask = batch["masked_input_ids"], batch["attention_mask"]
    ours = copy.deepcopy(trainer.units["generator"].model).double().eval()
    with torch.no_grad():
        expected = hf.double()(input_ids=ids, attention_mask=mask.long()).logits
        got = mlm_logits(ours, ids, mask)
    assert (got - expected)[mask].abs().max() <= 1e-12


def test_discriminator_from_a_masked_lm_takes_its_encoder_under_a_fresh_rtd_head(wordpiece_data, tmp_path):
    """RTD continued from a trained masked LM: `init.discriminator` naming a source with no discriminator."""
    hf = save_tiny_hf_model("ElectraForMaskedLM", tmp_path / "mlm", wordpiece_data[0], model="discriminator")
    cfg = _cfg(wordpiece_data, tmp_path / "run", **{"init.discriminator": tmp_path / "mlm"})
    trainer = build_trainer(cfg)
    disc = trainer.units["discriminator"].model
    batch = _batch(trainer)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        expected = hf.double().electra(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        got = copy.deepcopy(disc).double().eval()(ids, mask)
    assert (got - expected)[mask].abs().max() <= 1e-12
    # the head is what a run without any init draws at train.seed (the generator is built first)
    torch.manual_seed(cfg.train.seed)
    MaskedLM(cfg.model.generator)
    fresh_head = Discriminator(cfg.model.discriminator).head.state_dict()
    assert all(torch.equal(v, fresh_head[k]) for k, v in disc.head.state_dict().items())
    # an encoder that does not fit the configured discriminator is named like any other mismatch
    with pytest.raises(StoreError, match=r"init.discriminator=.*'encoder\.embeddings.*expects"):
        build_trainer(_cfg(wordpiece_data, tmp_path / "narrow", **{"init.discriminator": tmp_path / "mlm",
                                                                  "model.discriminator.hidden_size": 64}))


@pytest.mark.parametrize("source", ["run", "checkpoint", "hf_pair", "model_dir"])
def test_step0_weights_equal_the_source(wordpiece_data, wordpiece_electra_run, tmp_path, source):
    run = wordpiece_electra_run
    expected = load_model(run).models  # the trained run's own models
    step = sorted((run / "checkpoints").iterdir())[-1]
    init = {"run": {"init.from": run}, "checkpoint": {"init.from": step}, "hf_pair": {"init.from": run / "hf"},
            "model_dir": {"init.discriminator": tmp_path / "model"}}[source]
    if source == "model_dir":
        from_hf(run / "hf" / "discriminator", tmp_path / "model")
    trainer = build_trainer(_cfg(wordpiece_data, tmp_path / "run", **init))
    for name, kind in (("generator", "masked_lm"), ("discriminator", "discriminator")):
        built = trainer.units[name].model.state_dict()
        same = all(torch.equal(v, expected[kind].state_dict()[k]) for k, v in built.items())
        assert same == (source != "model_dir" or name == "discriminator"), name
    assert (trainer.units["generator"].model.head.decoder_weight.data_ptr()
            == trainer.units["generator"].model.encoder.embeddings.word_embeddings.weight.data_ptr())  # still tied


def _metrics(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]


def test_resume_after_warm_start_is_bit_exact_and_never_reads_the_init(wordpiece_data, wordpiece_electra_run,
                                                                        tmp_path):
    source = shutil.copytree(wordpiece_electra_run / "hf", tmp_path / "source")
    steps = {"run.save_every": 2, "init.from": source}
    run_pretraining(_cfg(wordpiece_data, tmp_path / "whole", **steps, **{"train.max_steps": 4}))
    run_pretraining(_cfg(wordpiece_data, tmp_path / "split", **steps, **{"train.max_steps": 2}))
    shutil.rmtree(source)  # the resumed run continues from its checkpoint alone
    run_pretraining(_cfg(wordpiece_data, tmp_path / "split", **steps, **{"train.max_steps": 4}), resume="auto")
    whole, split = (load_model(tmp_path / name).models for name in ("whole", "split"))
    for kind in ("masked_lm", "discriminator"):
        a, b = whole[kind].state_dict(), split[kind].state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), kind
    assert _metrics(tmp_path / "whole") == _metrics(tmp_path / "split")
    saved = load_config(tmp_path / "split" / "config.yaml")  # init.from is recorded in the run dir
    assert saved.init.from_ == str(source)


def test_dwt_student_warm_started_from_its_hf_teacher_starts_at_zero_kl(wordpiece_data, tmp_path):
    teacher = tmp_path / "teacher"
    save_tiny_hf_model("BertForMaskedLM", teacher, wordpiece_data[0], dropout=0.0)
    cfg = _cfg(wordpiece_data, tmp_path / "run", **{
        "model.objective": "mlm", "model.generator.dropout": 0.0, "distill.teacher": teacher,
        "init.from": teacher, "train.max_steps": 1})
    run_distill(cfg)
    first = _metrics(tmp_path / "run")[0]
    assert first["kd_loss"] <= 1e-6 and first["alpha_soft"] == pytest.approx(4.0)  # student == teacher at step 0
    # the same student from random init is far from its teacher
    run_distill(_cfg(wordpiece_data, tmp_path / "cold", **{
        "model.objective": "mlm", "model.generator.dropout": 0.0, "distill.teacher": teacher, "train.max_steps": 1}))
    assert _metrics(tmp_path / "cold")[0]["kd_loss"] > 1e-3  # 0.019 here: tiny random models are near uniform


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _cli_error(argv, capsys) -> str:
    """The command's one error line (progress bars of the libraries it calls may precede it)."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("megakd: error:")]
    assert len(lines) == 1 and err.strip().endswith(lines[0]) and "Traceback" not in err, err
    return lines[0]


def test_bad_init_sources_are_one_line_and_write_nothing(wordpiece_data, tiny_data, tiny_electra_run, tmp_path,
                                                          capsys):
    good = tmp_path / "good"
    save_tiny_hf_model("ElectraForPreTraining", good, wordpiece_data[0])
    hostile = shutil.copytree(good, tmp_path / "hostile")
    (hostile / "model.safetensors").unlink()
    marker = tmp_path / "payload-ran"
    (hostile / "pytorch_model.bin").write_bytes(pickle.dumps({"electra.embeddings.word_embeddings.weight":
                                                              _Payload(marker)}))
    truncated = shutil.copytree(good, tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    run = tmp_path / "run"
    base = ["pretrain", "-c", CONFIG, *auto_vocab_overrides(wordpiece_data, run)]
    cases = [
        ([f"init.from={good}", "model.discriminator.hidden_size=64"],
         [f"init.from={good}", f"{good / 'model.safetensors'}", "'encoder.embeddings.embeddings_project.weight'",
          "shape [48, 32]", "expects [64, 32]"]),
        ([f"init.from={good}", "model.discriminator.num_heads=4"], ["model.discriminator.num_heads=4", "has 2"]),
        ([f"init.from={hostile}"], ["init.from", str(hostile), "cannot load the ElectraForPreTraining weights"]),
        ([f"init.from={truncated}"], ["init.from", str(truncated), "cannot read as safetensors"]),
        ([f"init.from={tmp_path / 'missing'}"], ["init.from=", "no such directory"]),
        ([f"init.from={good}", "model.objective=mlm"], ["init.from=", "holds discriminator", "objective=mlm"]),
        ([f"init.generator={good}"], ["init.generator=", "holds an ELECTRA discriminator; expected a masked LM"]),
        ([f"init.from={tiny_electra_run}"], ["init.from=", "sentencepiece tokenizer", "hf tokenizer",
                                             str(wordpiece_data[0])]),
        ([f"init.from={good}", "model.objective=mlm", f"distill.teacher={good}", "distill.init=remap"],
         ["distill.init=remap both initialize the student"]),
    ]
    for extra, expected in cases:
        message = _cli_error([*base, *extra], capsys)
        assert all(part in message for part in expected), (extra, message)
        assert not run.exists() or not any(run.iterdir()), extra
    assert not marker.exists()


def test_init_keys_are_validated_and_spelled_from(tiny_data, tmp_path):
    cfg = load_config(CONFIG, tiny_overrides(tiny_data, tmp_path, **{"init.from": "somewhere"}))
    assert cfg.init.from_ == "somewhere" and cfg.init.source("discriminator") == ("somewhere", "init.from")
    with pytest.raises(ConfigError, match="unknown config key 'init.from_'; did you mean 'init.from'"):
        load_config(CONFIG, ["init.from_=x"])
    with pytest.raises(ConfigError, match="init.discriminator=x: model.objective=mlm builds no discriminator"):
        load_config(CONFIG, ["model.objective=mlm", "init.discriminator=x"])


def test_tokenizer_mismatch_between_source_halves_is_named(wordpiece_data, wordpiece_electra_run, tiny_data,
                                                            tiny_electra_run, tmp_path):
    pair = tmp_path / "pair"
    shutil.copytree(wordpiece_electra_run / "hf" / "discriminator", pair / "discriminator")
    shutil.copytree(tiny_electra_run / "hf" / "generator", pair / "generator")
    with pytest.raises(StoreError, match="init.from=.*generator: its sentencepiece tokenizer .* is not the hf"):
        build_trainer(_cfg(wordpiece_data, tmp_path / "run", **{"init.from": pair}))
