"""Build a classifier from whatever the user pretrained, and save/load fine-tuned classifiers.

A fine-tuned classifier directory ("megakd-classifier/1") is what KD teachers, self-KD copies and
TGT labelers are loaded from:

    classifier.yaml     format, encoder fields, num_labels, task, provenance
    model.safetensors   the SequenceClassifier state dict
    tokenizer/spm.model the megakd SentencePiece tokenizer the model reads
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_model, save_model
from torch import nn

from megakd.config import ConfigError
from megakd.convert import ConversionError, from_hf, load_model_dir, read_model_dir_info
from megakd.convert.checkpoints import load_checkpoint, resolve_checkpoint
from megakd.convert.common import atomic_output_dir
from megakd.data.tokenizer import Tokenizer
from megakd.finetune.config import ModelInitConfig
from megakd.models.electra import SequenceClassifier
from megakd.models.encoder import Encoder, EncoderConfig

CLASSIFIER_FORMAT = "megakd-classifier/1"
CLASSIFIER_FILE = "classifier.yaml"
WEIGHTS_FILE = "model.safetensors"


@dataclasses.dataclass
class Pretrained:
    """An encoder (or None for random init), its config and the tokenizer it was trained with."""

    config: EncoderConfig
    tokenizer: Tokenizer
    encoder: Encoder | None


def _tokenizer(path: Path | None, source: Path, override: str) -> Tokenizer:
    if override:
        return Tokenizer.load(override)
    if path is None or not (Path(path) / "spm.model").is_file():
        raise ConfigError(f"{source}: has no megakd SentencePiece tokenizer (spm.model); set model.tokenizer")
    return Tokenizer.load(path)


def load_pretrained(path: str | Path, work_dir: Path, tokenizer: str = "") -> Pretrained:
    """Encoder + tokenizer from an HF export, megakd model dir, pretraining run/checkpoint or classifier dir.

    HF directories are converted with `megakd.convert.from_hf` into `work_dir/imported` (kept: the
    tokenizer is read from there), so import follows exactly the mapping `megakd convert from-hf` uses.
    """
    src = Path(path)
    if not src.is_dir():
        raise ConfigError(f"model.path: {src}: no such directory")
    try:
        if (src / CLASSIFIER_FILE).is_file():
            model, tok = load_classifier(src)
            return Pretrained(model.config, Tokenizer.load(tokenizer) if tokenizer else tok, model.encoder)
        if (src / "config.json").is_file():
            out = Path(work_dir) / "imported"
            from_hf(src, out, force=True)
            return load_pretrained(out, work_dir, tokenizer)
        if (src / "model.yaml").is_file():
            info = read_model_dir_info(src)
            kind, model = load_model_dir(src)
            encoder = model if kind == "encoder" else model.encoder
            return Pretrained(encoder.config, _tokenizer(info.get("tokenizer"), src, tokenizer), encoder)
        ckpt = load_checkpoint(resolve_checkpoint(src))
    except ConversionError as err:
        raise ConfigError(f"model.path: {err}") from None
    model = ckpt.discriminator if ckpt.discriminator is not None else ckpt.generator
    return Pretrained(model.config, _tokenizer(ckpt.tokenizer_dir, src, tokenizer), model.encoder)


def build_classifier(init: ModelInitConfig, num_labels: int, dropout: float, seed: int,
                     work_dir: Path, pretrained: Pretrained | None = None
                     ) -> tuple[SequenceClassifier, Tokenizer]:
    """A SequenceClassifier initialised as `init` says, with hidden and classifier dropout `dropout`.

    The head (and, for `init: random`, everything) is drawn from torch's RNG seeded with `seed`, so
    every seed of a multi-seed run starts from its own reproducible initialisation.
    """
    if pretrained is None and init.path:
        pretrained = load_pretrained(init.path, work_dir, init.tokenizer)
    if pretrained is not None:
        config, tokenizer = pretrained.config, pretrained.tokenizer
    else:
        config, tokenizer = init.encoder, Tokenizer.load(init.tokenizer)
    config = dataclasses.replace(config, dropout=dropout, activation_checkpointing=False)
    if config.vocab_size != tokenizer.vocab_size:
        raise ConfigError(f"model: the encoder's vocab_size {config.vocab_size} differs from the tokenizer "
                          f"{tokenizer.path} ({tokenizer.vocab_size} pieces)")
    torch.manual_seed(seed)
    model = SequenceClassifier(config, num_labels, classifier_dropout=dropout)
    if init.init == "pretrained" and pretrained is not None:
        model.encoder.load_state_dict(pretrained.encoder.state_dict(), strict=True)
    return model.train(), tokenizer


def save_classifier(model: SequenceClassifier, tokenizer: Tokenizer, out: str | Path,
                    extra: dict[str, Any] | None = None) -> Path:
    """Write a fine-tuned classifier directory atomically (replacing an older one)."""
    with atomic_output_dir(out, force=True) as tmp:
        (tmp / "tokenizer").mkdir()
        shutil.copyfile(tokenizer.path / "spm.model", tmp / "tokenizer" / "spm.model")
        save_model(model, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        info = {"format": CLASSIFIER_FORMAT, "num_labels": model.num_labels,
                "encoder": dataclasses.asdict(model.config), **(extra or {})}
        (tmp / CLASSIFIER_FILE).write_text(yaml.safe_dump(info, sort_keys=False))
    return Path(out)


def load_classifier(path: str | Path) -> tuple[SequenceClassifier, Tokenizer]:
    """(model in eval mode, tokenizer) from a fine-tuned classifier directory."""
    path = Path(path)
    file = path / CLASSIFIER_FILE
    if not file.is_file():
        raise ConfigError(f"{file}: missing (expected a fine-tuned classifier directory from megakd finetune)")
    info = yaml.safe_load(file.read_text())
    if not isinstance(info, dict) or info.get("format") != CLASSIFIER_FORMAT:
        raise ConfigError(f"{file}: format: expected {CLASSIFIER_FORMAT!r}")
    try:
        config = EncoderConfig(**info["encoder"]).validate()
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{file}: encoder: {err}") from None
    model = SequenceClassifier(config, int(info["num_labels"]))
    load_model(model, str(path / WEIGHTS_FILE), strict=True)
    return model.eval(), Tokenizer.load(path / "tokenizer")


def freeze(model: nn.Module) -> nn.Module:
    """Eval mode, no trainable parameters: KD teachers, self-KD copies, TGT generators and labelers."""
    return model.eval().requires_grad_(False)


def check_same_tokenizer(a: Tokenizer, b: Tokenizer, what: str) -> None:
    if a.vocab_hash != b.vocab_hash:
        raise ConfigError(f"{what}: tokenizer {b.path} (vocab hash {b.vocab_hash}) differs from the student's "
                          f"{a.path} ({a.vocab_hash}); teacher and student must share the tokenizer")
