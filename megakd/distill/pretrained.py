"""Load a trained MLM or discriminator from wherever users keep one, together with its tokenizer.

DWT teachers and the RTD evaluation's generator/discriminators come from a megakd run or
checkpoint, a megakd model directory (`megakd convert from-hf` / `save_model_dir`) or a local
HuggingFace BERT/ELECTRA directory. Every model is returned frozen (eval mode, no gradients),
and its tokenizer is checked against the data's by vocabulary hash, because a token-level KL or
an RTD label between models with different vocabularies is silently meaningless.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from megakd.config import ConfigError
from megakd.convert import ConversionError, from_hf, load_model_dir, read_model_dir_info
from megakd.convert.checkpoints import load_checkpoint, resolve_checkpoint
from megakd.data.tokenizer import Tokenizer

_DESCRIBE = {"masked_lm": "a masked LM (BERT-MLM or ELECTRA generator)", "discriminator": "an ELECTRA discriminator"}


@dataclass
class Pretrained:
    model: nn.Module
    tokenizer_dir: Path | None  # a megakd SentencePiece tokenizer dir, None if the source has none
    source: Path


def load_pretrained(src: str | Path, kind: str, role: str) -> Pretrained:
    """The `kind` model ("masked_lm" | "discriminator") stored at `src`, frozen.

    `role` names the setting in errors (e.g. "distill.teacher"). A run or checkpoint gives its
    generator (BERT-MLM or ELECTRA generator) or its discriminator; a model directory or HF
    directory must hold that kind.
    """
    src = Path(src)
    if not src.is_dir():
        raise ConfigError(f"{role}={src}: no such directory (expected a megakd run, checkpoint, model "
                          "directory or HF BERT/ELECTRA directory)")
    try:
        if (src / "model.yaml").is_file():
            found, model = load_model_dir(src)
            tokenizer_dir = read_model_dir_info(src)["tokenizer"]
        elif (src / "config.json").is_file():
            with tempfile.TemporaryDirectory(prefix="megakd-import-") as tmp:
                found, model = from_hf(src, Path(tmp) / "model")
                has_spm = read_model_dir_info(Path(tmp) / "model")["tokenizer"] is not None
            tokenizer_dir = src if has_spm else None
        else:
            ckpt = load_checkpoint(resolve_checkpoint(src))
            model = ckpt.generator if kind == "masked_lm" else ckpt.discriminator
            found = kind if model is not None else "masked_lm"
            tokenizer_dir = ckpt.tokenizer_dir
    except ConversionError as err:
        raise ConfigError(f"{role}={src}: {err}") from None
    if found != kind:
        raise ConfigError(f"{role}={src}: holds a megakd {found!r} model; expected {_DESCRIBE[kind]}")
    model.eval().requires_grad_(False)
    return Pretrained(model, tokenizer_dir, src)


def check_tokenizer(pretrained: Pretrained, expected: Tokenizer, role: str) -> None:
    """Refuse a model whose tokenizer is not `expected` (same vocabulary hash and size)."""
    if pretrained.tokenizer_dir is None:
        raise ConfigError(
            f"{role}={pretrained.source}: carries no megakd tokenizer (tokenizer/ or spm.model), so it cannot be "
            f"checked against {expected.path} (vocab hash {expected.vocab_hash}); the models must share a tokenizer"
        )
    own = Tokenizer.load(pretrained.tokenizer_dir)
    if own.vocab_hash != expected.vocab_hash:
        raise ConfigError(
            f"{role}={pretrained.source}: tokenizer {own.path} has vocab hash {own.vocab_hash}, but {expected.path} "
            f"has {expected.vocab_hash}; the models must share a tokenizer"
        )
    size = pretrained.model.config.vocab_size
    if size != expected.vocab_size:
        raise ConfigError(f"{role}={pretrained.source}: model vocab_size {size} != {expected.vocab_size} pieces "
                          f"of {expected.path}")
