"""HF BERT/ELECTRA directories → megakd model directories (and back), exact through the files on disk."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForMaskedLM, BertConfig, ElectraConfig, GPT2Config, GPT2LMHeadModel

from megakd.cli import main
from megakd.convert import ConversionError, from_hf, load_model_dir, read_model_dir_info, to_hf
from megakd.data.hf_tokenizer import write_hf_tokenizer
from megakd.data.tokenizer import Tokenizer
from tests.helpers import mlm_logits

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
              max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
# architecture → (config, megakd kind)
CASES = {
    "BertForMaskedLM": (lambda: BertConfig(**COMMON), "masked_lm"),
    "BertForPreTraining": (lambda: BertConfig(**COMMON), "masked_lm"),
    "BertModel": (lambda: BertConfig(**COMMON), "encoder"),
    "ElectraForPreTraining": (lambda: ElectraConfig(embedding_size=16, **COMMON), "discriminator"),
    "ElectraForMaskedLM": (lambda: ElectraConfig(embedding_size=16, **COMMON), "masked_lm"),
    "ElectraModel": (lambda: ElectraConfig(embedding_size=16, **COMMON), "encoder"),
}


def _hf_model(architecture: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(CASES[architecture][0]())
    with torch.no_grad():  # move LayerNorms and biases off their init so every tensor is tested
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(5, VOCAB, (3, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 12:] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": (torch.arange(20) >= 8).long().expand(3, 20)}


def _hf_output(hf: torch.nn.Module, architecture: str, x: dict) -> torch.Tensor:
    out = hf(**x)
    if architecture == "BertForPreTraining":
        return out.prediction_logits
    return out.last_hidden_state if architecture.endswith("Model") else out.logits


def _megakd_output(model: torch.nn.Module, kind: str, x: dict) -> torch.Tensor:
    if kind == "masked_lm":
        return mlm_logits(model, **x)
    if kind == "discriminator":
        return model.rtd_logits(model(**x))
    return model(**x)


@pytest.mark.parametrize("architecture", list(CASES))
def test_import_is_exact_through_files(architecture, tmp_path):
    hf = _hf_model(architecture)
    hf.save_pretrained(tmp_path / "src")
    kind, _ = from_hf(tmp_path / "src", tmp_path / "model")
    assert kind == CASES[architecture][1]
    loaded_kind, model = load_model_dir(tmp_path / "model")  # from disk, not the in-memory model
    assert loaded_kind == kind and not model.training
    x = _inputs()
    with torch.no_grad():
        diff = (_hf_output(hf, architecture, x) - _megakd_output(model, kind, x))[x["attention_mask"].bool()]
    assert diff.abs().max() <= 1e-5


def test_hf_reads_and_writes_draw_no_bar_into_a_log_file(tmp_path, capfd):
    """stderr here is no terminal (pytest's capture, as a log file): transformers' "Loading weights" and
    "Writing model shards" bars would leave carriage returns in it. Its setting is what it was after."""
    from transformers.utils import logging as hf_logging

    _hf_model("ElectraForPreTraining").save_pretrained(tmp_path / "src")
    capfd.readouterr()
    assert hf_logging.is_progress_bar_enabled()
    from_hf(tmp_path / "src", tmp_path / "model")
    to_hf(tmp_path / "model", tmp_path / "back")
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "Writing model shards" not in err and "\r" not in err
    assert hf_logging.is_progress_bar_enabled()


@pytest.mark.parametrize("architecture", ["BertForMaskedLM", "ElectraForMaskedLM", "ElectraForPreTraining"])
def test_round_trip_back_to_hf(architecture, tmp_path):
    hf = _hf_model(architecture, seed=1)
    hf.save_pretrained(tmp_path / "src")
    assert main(["convert", "from-hf", str(tmp_path / "src"), str(tmp_path / "model")]) == 0
    assert main(["convert", "to-hf", str(tmp_path / "model"), str(tmp_path / "back")]) == 0
    back = getattr(transformers, architecture).from_pretrained(tmp_path / "back", local_files_only=True).eval()
    x = _inputs()
    with torch.no_grad():
        assert torch.allclose(hf(**x).logits, back(**x).logits, atol=1e-6, rtol=0)


def test_sentencepiece_tokenizer_comes_back_as_megakd_tokenizer(tiny_data, tmp_path):
    tokenizer_dir, _ = tiny_data
    hf = _hf_model("BertForMaskedLM")
    hf.save_pretrained(tmp_path / "src")
    write_hf_tokenizer(tokenizer_dir / "spm.model", tmp_path / "src", 64)
    from_hf(tmp_path / "src", tmp_path / "model")
    info = read_model_dir_info(tmp_path / "model")
    assert info["tokenizer"] == tmp_path / "model" / "tokenizer" and info["hf_kind"] == "bert_mlm"
    # same vocabulary hash: DWT's teacher/student tokenizer check accepts it
    assert Tokenizer.load(info["tokenizer"]).vocab_hash == Tokenizer.load(tokenizer_dir).vocab_hash


def test_wordpiece_tokenizer_files_are_kept_for_reference(tmp_path):
    hf = _hf_model("BertModel")
    hf.save_pretrained(tmp_path / "src")
    (tmp_path / "src" / "vocab.txt").write_text("\n".join(f"tok{i}" for i in range(VOCAB)) + "\n")
    from_hf(tmp_path / "src", tmp_path / "model")
    info = read_model_dir_info(tmp_path / "model")
    assert info["tokenizer"] is None and (info["hf_tokenizer"] / "vocab.txt").is_file()


def test_unsupported_architecture_is_named(tmp_path, capsys):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).save_pretrained(tmp_path / "gpt")
    with pytest.raises(ConversionError, match=r"config\.json: unsupported architectures \['GPT2LMHeadModel'\] "
                                              r"\(model_type 'gpt2'\)"):
        from_hf(tmp_path / "gpt", tmp_path / "out")
    assert main(["convert", "from-hf", str(tmp_path / "gpt"), str(tmp_path / "out")]) == 2
    assert "GPT2LMHeadModel" in capsys.readouterr().err
    with pytest.raises(ConversionError, match=r"nothing/config\.json: missing"):
        from_hf(tmp_path / "nothing", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_non_gelu_or_relative_bert_is_refused(tmp_path):
    AutoModelForMaskedLM.from_config(BertConfig(hidden_act="relu", **COMMON)).save_pretrained(tmp_path / "relu")
    with pytest.raises(ConversionError, match=r"relu/config\.json: hidden_act: expected 'gelu'"):
        from_hf(tmp_path / "relu", tmp_path / "out")


def test_broken_model_dir_errors(tmp_path):
    _hf_model("ElectraForPreTraining").save_pretrained(tmp_path / "src")
    from_hf(tmp_path / "src", tmp_path / "model")
    info_file = tmp_path / "model" / "model.yaml"
    info_file.write_text(info_file.read_text().replace("hidden_size: 32", "hidden_size: 64"))
    # Checked on the stored shapes, before the model the YAML describes is built.
    with pytest.raises(ConversionError, match=r"model\.safetensors: '\S+' has shape \[\d+, \d+\] but \S+model\.yaml "
                                              r"expects \[\d+, \d+\]$"):
        load_model_dir(tmp_path / "model")
    with pytest.raises(ConversionError, match=r"model\.yaml: missing"):
        load_model_dir(tmp_path)
    from_hf(tmp_path / "src", tmp_path / "good")
    with pytest.raises(ConversionError, match=r"src: directory exists and is not empty \(use --force"):
        to_hf(tmp_path / "good", tmp_path / "src")
    with pytest.raises(ConversionError, match="not a megakd run directory"):  # an HF dir is not a to-hf source
        to_hf(tmp_path / "src", tmp_path / "elsewhere")
