"""Exact two-way mapping between megakd and HF state dicts for absolute-position models.

kinds: "electra_discriminator" ↔ ElectraForPreTraining, "electra_generator" ↔ ElectraForMaskedLM,
"bert_mlm" ↔ BertForMaskedLM. The mapping is a pure rename (no tensor is changed), one entry per
module in `_module_pairs`; `{i}` stands for the layer index. Tied HF keys (lm head weight = word
embeddings, BERT decoder bias = predictions bias) are written on export and checked on import.
Admin ω and T5 relative bias have no HF counterpart, so such models are refused here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import Tensor, nn
from transformers import BertConfig, BertForMaskedLM, ElectraConfig, ElectraForMaskedLM, ElectraForPreTraining

from megakd.models.encoder import EncoderConfig

KINDS = ("electra_discriminator", "electra_generator", "bert_mlm")
TIED_EMBEDDING = "head.tied_embedding.weight"
WORD_EMBEDDINGS = "encoder.embeddings.word_embeddings.weight"


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")


def _module_pairs(kind: str) -> list[tuple[str, str]]:
    """(megakd module path, HF module path) for every module that carries parameters."""
    base = "bert" if kind == "bert_mlm" else "electra"
    pairs = [
        ("encoder.embeddings.word_embeddings", f"{base}.embeddings.word_embeddings"),
        ("encoder.embeddings.position_embeddings", f"{base}.embeddings.position_embeddings"),
        ("encoder.embeddings.token_type_embeddings", f"{base}.embeddings.token_type_embeddings"),
        ("encoder.embeddings.layer_norm", f"{base}.embeddings.LayerNorm"),
        ("encoder.layers.{i}.attention.query", f"{base}.encoder.layer.{{i}}.attention.self.query"),
        ("encoder.layers.{i}.attention.key", f"{base}.encoder.layer.{{i}}.attention.self.key"),
        ("encoder.layers.{i}.attention.value", f"{base}.encoder.layer.{{i}}.attention.self.value"),
        ("encoder.layers.{i}.attention.output", f"{base}.encoder.layer.{{i}}.attention.output.dense"),
        ("encoder.layers.{i}.attention_norm", f"{base}.encoder.layer.{{i}}.attention.output.LayerNorm"),
        ("encoder.layers.{i}.ffn.fc_in", f"{base}.encoder.layer.{{i}}.intermediate.dense"),
        ("encoder.layers.{i}.ffn.fc_out", f"{base}.encoder.layer.{{i}}.output.dense"),
        ("encoder.layers.{i}.ffn_norm", f"{base}.encoder.layer.{{i}}.output.LayerNorm"),
    ]
    if kind == "electra_discriminator":
        pairs += [
            ("encoder.embeddings.embeddings_project", "electra.embeddings_project"),
            ("head.dense", "discriminator_predictions.dense"),
            ("head.prediction", "discriminator_predictions.dense_prediction"),
        ]
    elif kind == "electra_generator":
        pairs += [
            ("encoder.embeddings.embeddings_project", "electra.embeddings_project"),
            ("head.dense", "generator_predictions.dense"),
            ("head.layer_norm", "generator_predictions.LayerNorm"),
            ("head.bias", "generator_lm_head.bias"),
        ]
    else:
        pairs += [
            ("head.dense", "cls.predictions.transform.dense"),
            ("head.layer_norm", "cls.predictions.transform.LayerNorm"),
            ("head.bias", "cls.predictions.bias"),
        ]
    return pairs


def _tied_hf_keys(kind: str) -> dict[str, str]:
    """HF keys that duplicate another tensor → the megakd key holding it."""
    if kind == "electra_generator":
        return {"generator_lm_head.weight": WORD_EMBEDDINGS}
    if kind == "bert_mlm":
        return {"cls.predictions.decoder.weight": WORD_EMBEDDINGS, "cls.predictions.decoder.bias": "head.bias"}
    return {}


def _pattern(template: str) -> re.Pattern[str]:
    body = re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)")
    return re.compile(rf"^{body}(?P<leaf>(?:\.weight|\.bias)?)$")


def _rename(sd: Mapping[str, Tensor], pairs: list[tuple[str, str]], direction: str) -> dict[str, Tensor]:
    compiled = [(_pattern(src), dst) for src, dst in pairs]
    out: dict[str, Tensor] = {}
    for key, tensor in sd.items():
        for pattern, dst in compiled:
            match = pattern.match(key)
            if match:
                index = match.groupdict().get("i")
                out[(dst.format(i=index) if index is not None else dst) + match["leaf"]] = tensor
                break
        else:
            raise ValueError(f"{direction}: state dict key {key!r} has no counterpart "
                             "(Admin ω and T5 relative bias cannot be exported to native HF classes)")
    return out


def to_hf_state_dict(model: nn.Module | Mapping[str, Tensor], kind: str) -> dict[str, Tensor]:
    """megakd `MaskedLM`/`Discriminator` (or its state dict) → state dict of the HF class for `kind`."""
    _check_kind(kind)
    sd = dict(model.state_dict() if isinstance(model, nn.Module) else model)
    sd.pop(TIED_EMBEDDING, None)
    if kind == "bert_mlm" and any(k.startswith("encoder.embeddings.embeddings_project.") for k in sd):
        raise ValueError("kind='bert_mlm': BERT has no embeddings_project; expected model.embedding_size "
                         "equal to hidden_size")
    out = _rename(sd, _module_pairs(kind), "to_hf_state_dict")
    for hf_key, megakd_key in _tied_hf_keys(kind).items():
        out[hf_key] = sd[megakd_key]
    return out


def from_hf_state_dict(sd: Mapping[str, Tensor], kind: str) -> dict[str, Tensor]:
    """HF state dict for `kind` → megakd state dict (load with `strict=True`)."""
    _check_kind(kind)
    sd = {k: v for k, v in sd.items() if not k.endswith((".position_ids", ".token_type_ids"))}
    tied = {k: sd.pop(k) for k in _tied_hf_keys(kind) if k in sd}
    out = _rename(sd, [(hf, mk) for mk, hf in _module_pairs(kind)], "from_hf_state_dict")
    for hf_key, tensor in tied.items():
        megakd_key = _tied_hf_keys(kind)[hf_key]
        if not tensor.equal(out[megakd_key]):
            raise ValueError(f"from_hf_state_dict: {hf_key!r} is not tied to {megakd_key!r}; "
                             "megakd MLM heads always tie the output matrix to the word embeddings")
    if kind != "electra_discriminator":
        out[TIED_EMBEDDING] = out[WORD_EMBEDDINGS]
    return out


def hf_model_class(kind: str) -> type[nn.Module]:
    _check_kind(kind)
    return {"electra_discriminator": ElectraForPreTraining, "electra_generator": ElectraForMaskedLM,
            "bert_mlm": BertForMaskedLM}[kind]


def hf_config(config: EncoderConfig, kind: str) -> ElectraConfig | BertConfig:
    """The HF config whose model has exactly the megakd model's parameters and function."""
    _check_kind(kind)
    config.validate()
    if config.position_encoding != "absolute":
        raise ValueError(f"model.position_encoding: native HF classes need 'absolute', "
                         f"got {config.position_encoding!r}")
    if config.init != "normal":
        raise ValueError(f"model.init: native HF classes have no Admin residual scales, got {config.init!r}")
    common = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        intermediate_size=config.intermediate_size,
        hidden_act="gelu",
        hidden_dropout_prob=config.dropout,
        attention_probs_dropout_prob=config.attention_dropout,
        max_position_embeddings=config.max_position_embeddings,
        type_vocab_size=config.type_vocab_size,
        initializer_range=config.initializer_range,
        layer_norm_eps=config.layer_norm_eps,
        pad_token_id=config.pad_token_id,
        tie_word_embeddings=True,
    )
    if kind == "bert_mlm":
        if config.embed_dim != config.hidden_size:
            raise ValueError(f"model.embedding_size: BERT needs it equal to hidden_size={config.hidden_size}, "
                             f"got {config.embedding_size}")
        return BertConfig(**common)
    return ElectraConfig(embedding_size=config.embed_dim, **common)


def encoder_config_from_hf(hf: ElectraConfig | BertConfig) -> EncoderConfig:
    """EncoderConfig of an HF ELECTRA/BERT config (e.g. to import a DWT teacher)."""
    if hf.hidden_act != "gelu":
        raise ValueError(f"hidden_act: expected 'gelu' (exact erf GELU), got {hf.hidden_act!r}")
    position = getattr(hf, "position_embedding_type", "absolute")
    if position != "absolute":
        raise ValueError(f"position_embedding_type: expected 'absolute', got {position!r}")
    embedding_size = getattr(hf, "embedding_size", hf.hidden_size)
    return EncoderConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        intermediate_size=hf.intermediate_size,
        embedding_size=None if embedding_size == hf.hidden_size else embedding_size,
        max_position_embeddings=hf.max_position_embeddings,
        type_vocab_size=hf.type_vocab_size,
        dropout=hf.hidden_dropout_prob,
        attention_dropout=hf.attention_probs_dropout_prob,
        layer_norm_eps=hf.layer_norm_eps,
        initializer_range=hf.initializer_range,
        pad_token_id=hf.pad_token_id if hf.pad_token_id is not None else 0,
    ).validate()
