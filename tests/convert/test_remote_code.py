"""T5-relative and Admin models export with remote code that loads via trust_remote_code and matches."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForMaskedLM, AutoModelForPreTraining, AutoModelForSequenceClassification

from megakd.cli import main
from megakd.convert import save_hf_model, to_hf
from megakd.models.admin import admin_initialize
from megakd.models.electra import Discriminator, MaskedLM
from megakd.models.encoder import EncoderConfig
from megakd.store import load_model
from megakd.store.checkpoint_models import load_checkpoint, resolve_checkpoint
from tests.helpers import TINY_VOCAB, mlm_logits, padded_inputs, tiny_overrides

CONFIG = Path(__file__).parents[2] / "configs" / "electra-tiny.yaml"


def test_original_electra_t5_relative_run_exports_remote_code(tiny_data, tmp_path):
    """Shared-embedding ElectraPair ("electra" unit) with T5 buckets: both halves load and match."""
    run = tmp_path / "run"
    overrides = {"train.max_steps": 2, "electra.decoupled": "false",
                 "model.generator.position_encoding": "t5_relative",
                 "model.discriminator.position_encoding": "t5_relative",
                 "model.generator.relative_buckets": 8, "model.discriminator.relative_buckets": 8,
                 "model.generator.relative_max_distance": 20, "model.discriminator.relative_max_distance": 20}
    assert main(["pretrain", "-c", str(CONFIG), *tiny_overrides(tiny_data, run, **overrides)]) == 0
    assert (resolve_checkpoint(run) / "electra.safetensors").is_file()
    out = tmp_path / "hf"
    assert to_hf(run, out) == {"discriminator": "MegakdForPreTraining", "generator": "MegakdForMaskedLM"}
    ckpt = load_checkpoint(resolve_checkpoint(run))
    x = padded_inputs()  # 40 tokens: beyond relative_max_distance=20, so the log buckets are exercised
    disc = AutoModelForPreTraining.from_pretrained(out / "discriminator", trust_remote_code=True,
                                                   local_files_only=True).eval()
    gen = AutoModelForMaskedLM.from_pretrained(out / "generator", trust_remote_code=True,
                                               local_files_only=True).eval()
    with torch.no_grad():
        d = (disc(**x).logits - ckpt.discriminator.rtd_logits(ckpt.discriminator(**x)))[x["attention_mask"].bool()]
        g = (gen(**x).logits - mlm_logits(ckpt.generator, **x))[x["attention_mask"].bool()]
    assert d.abs().max() <= 1e-5 and g.abs().max() <= 1e-5
    # the MLM output matrix stayed tied to the (trained, shared) word embeddings after loading
    assert gen.head.decoder_weight.data_ptr() == gen.encoder.embeddings.word_embeddings.weight.data_ptr()
    assert torch.equal(gen.encoder.embeddings.word_embeddings.weight,
                       ckpt.generator.encoder.embeddings.word_embeddings.weight)


def test_admin_model_exports_with_its_omegas(tmp_path):
    torch.manual_seed(0)
    cfg = EncoderConfig(vocab_size=TINY_VOCAB, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                        init="admin", dropout=0.0, attention_dropout=0.0, max_position_embeddings=64)
    disc = Discriminator(cfg).eval()
    admin_initialize(disc.encoder, padded_inputs()["input_ids"])
    with torch.no_grad():  # as after training: per-channel ω far from 1, so losing them would show
        for layer in disc.encoder.layers:
            layer.attention_omega.uniform_(0.5, 2.0)
            layer.ffn_omega.uniform_(0.5, 2.0)
    save_hf_model(disc, "electra_discriminator", tmp_path, tokenizer_dir=None)
    hf = AutoModelForPreTraining.from_pretrained(tmp_path, trust_remote_code=True, local_files_only=True).eval()
    x = padded_inputs()
    with torch.no_grad():
        diff = (hf(**x).logits - disc.rtd_logits(disc(**x)))[x["attention_mask"].bool()].abs().max()
    assert diff <= 1e-5
    clf = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=3, trust_remote_code=True,
                                                             local_files_only=True)
    assert clf(**x).logits.shape == (2, 3)
    assert torch.equal(clf.encoder.layers[1].ffn_omega, disc.encoder.layers[1].ffn_omega)


def test_remote_mlm_round_trip_through_model_dir_is_self_contained(tmp_path):
    """The written directory imports nothing from megakd: its vendored files carry the model."""
    torch.manual_seed(1)
    cfg = EncoderConfig(vocab_size=TINY_VOCAB, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                        embedding_size=16, position_encoding="t5_relative", dropout=0.0, attention_dropout=0.0)
    mlm = MaskedLM(cfg).eval()
    save_hf_model(mlm, "bert_mlm", tmp_path, tokenizer_dir=None)
    for py in tmp_path.glob("*.py"):
        imports = [line for line in py.read_text().splitlines() if line.startswith(("import", "from"))]
        assert not any("megakd." in line for line in imports), py
    hf = AutoModelForMaskedLM.from_pretrained(tmp_path, trust_remote_code=True, local_files_only=True).eval()
    x = padded_inputs()
    with torch.no_grad():
        assert (hf(**x).logits - mlm_logits(mlm, **x))[x["attention_mask"].bool()].abs().max() <= 1e-5


def test_megakd_export_reads_back_exactly_and_its_code_never_runs(tmp_path):
    """`load_model` (fine-tuning's model.path, DWT teachers, convert from-hf) reads megakd's remote-code
    exports itself: the same config and weights, the MLM tie restored, and the shipped Python files,
    replaced here by hostile ones, are never imported."""
    torch.manual_seed(2)
    cfg = EncoderConfig(vocab_size=TINY_VOCAB, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                        embedding_size=16, position_encoding="t5_relative", relative_init="local",
                        relative_buckets=8, relative_max_distance=20, dropout=0.0, attention_dropout=0.0)
    marker = tmp_path / "remote-code-ran"
    x = padded_inputs()
    for model, kind, flavour, architecture in (
            (MaskedLM(cfg).eval(), "masked_lm", "electra_generator", "MegakdForMaskedLM"),
            (Discriminator(cfg).eval(), "discriminator", "electra_discriminator", "MegakdForPreTraining")):
        export = tmp_path / kind
        export.mkdir()
        assert save_hf_model(model, flavour, export, tokenizer_dir=None) == architecture
        for py in export.glob("*.py"):
            py.write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit('remote code ran')\n")
        assert main(["convert", "from-hf", str(export), str(tmp_path / f"{kind}-model")]) == 0
        expected = model.state_dict()
        for source in (export, tmp_path / f"{kind}-model"):
            loaded = load_model(source).get(kind)
            assert loaded.config == cfg
            got = loaded.state_dict()
            assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
            with torch.no_grad():
                assert torch.equal(loaded(**x), model(**x))
    mlm = load_model(tmp_path / "masked_lm").get("masked_lm")
    assert mlm.head.tied_embedding.weight.data_ptr() == mlm.encoder.embeddings.word_embeddings.weight.data_ptr()
    assert not marker.exists()
