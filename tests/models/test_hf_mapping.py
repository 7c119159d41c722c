"""megakd ↔ HF: logits of the mapped models agree to 1e-5 (fp32) in both directions."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from megakd.models.electra import Discriminator, MaskedLM
from megakd.models.encoder import EncoderConfig
from megakd.models.hf_mapping import (
    encoder_config_from_hf,
    from_hf_state_dict,
    hf_config,
    hf_model_class,
    to_hf_state_dict,
)
from tests.helpers import mlm_logits

CASES = [
    ("electra_discriminator", None),
    ("electra_discriminator", 24),
    ("electra_generator", None),
    ("electra_generator", 24),
    ("bert_mlm", None),
]


def make_config(embedding_size: int | None, fused_qkv: bool = True) -> EncoderConfig:
    return EncoderConfig(vocab_size=97, hidden_size=48, num_layers=2, num_heads=4, intermediate_size=96,
                         embedding_size=embedding_size, max_position_embeddings=40, fused_qkv=fused_qkv)


def make_megakd(config: EncoderConfig, kind: str) -> torch.nn.Module:
    return Discriminator(config) if kind == "electra_discriminator" else MaskedLM(config)


def batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab, (3, 17), generator=g)
    attention_mask = torch.ones(3, 17, dtype=torch.long)
    attention_mask[1, 11:] = 0
    attention_mask[2, 4:] = 0
    input_ids[attention_mask == 0] = 0
    token_type_ids = torch.randint(0, 2, (3, 17), generator=g)
    return input_ids, attention_mask, token_type_ids


def megakd_logits(model: torch.nn.Module, kind: str, *inputs: torch.Tensor) -> torch.Tensor:
    if kind == "electra_discriminator":
        return model.rtd_logits(model(*inputs))
    return mlm_logits(model, *inputs)


def perturb(model: torch.nn.Module) -> None:
    """Random LayerNorm/bias values too, so a swapped or dropped tensor cannot go unnoticed."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name.lower():
                p.add_(0.1 * torch.randn_like(p))


@pytest.mark.parametrize("fused_qkv", [True, False])  # one [H, 3H] matmul or three: the same HF weights
@pytest.mark.parametrize("kind,embedding_size", CASES)
def test_megakd_to_hf(kind: str, embedding_size: int | None, fused_qkv: bool) -> None:
    torch.manual_seed(0)
    config = make_config(embedding_size, fused_qkv)
    ours = make_megakd(config, kind).eval()
    perturb(ours)
    theirs = hf_model_class(kind)(hf_config(config, kind)).eval()
    theirs.load_state_dict(to_hf_state_dict(ours, kind), strict=True)
    inputs = batch(config.vocab_size)
    with torch.no_grad():
        expected = theirs(input_ids=inputs[0], attention_mask=inputs[1], token_type_ids=inputs[2]).logits
        got = megakd_logits(ours, kind, *inputs)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind,embedding_size", CASES)
def test_hf_to_megakd(kind: str, embedding_size: int | None) -> None:
    torch.manual_seed(0)
    config = make_config(embedding_size)
    theirs = hf_model_class(kind)(hf_config(config, kind)).eval()
    perturb(theirs)
    imported = encoder_config_from_hf(theirs.config)
    assert imported == config
    ours = make_megakd(imported, kind).eval()
    ours.load_state_dict(from_hf_state_dict(theirs.state_dict(), kind), strict=True)
    inputs = batch(config.vocab_size, seed=3)
    with torch.no_grad():
        expected = theirs(input_ids=inputs[0], attention_mask=inputs[1], token_type_ids=inputs[2]).logits
        got = megakd_logits(ours, kind, *inputs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    if kind != "electra_discriminator":
        assert ours.head.decoder_weight is ours.encoder.embeddings.word_embeddings.weight


def test_refuses_what_hf_cannot_hold() -> None:
    with pytest.raises(ValueError, match="model.embedding_size"):
        hf_config(make_config(24), "bert_mlm")
    with pytest.raises(ValueError, match="model.position_encoding"):
        hf_config(EncoderConfig(position_encoding="t5_relative"), "electra_discriminator")
    with pytest.raises(ValueError, match="kind"):
        hf_config(make_config(None), "roberta")
    admin = Discriminator(EncoderConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2,
                                        intermediate_size=32, init="admin"))
    with pytest.raises(ValueError, match="attention_omega"):
        to_hf_state_dict(admin, "electra_discriminator")


def test_untied_hf_checkpoint_is_refused() -> None:
    config = make_config(None)
    sd = to_hf_state_dict(MaskedLM(config), "bert_mlm")
    sd["cls.predictions.decoder.weight"] = sd["cls.predictions.decoder.weight"] + 1.0
    with pytest.raises(ValueError, match="not tied"):
        from_hf_state_dict(sd, "bert_mlm")
