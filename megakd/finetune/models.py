"""Build a classifier from whatever the user pretrained (any source `megakd.store.load_model` reads).

Fine-tuned classifier directories are saved and loaded by `megakd.store.model_dir`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from megakd.config import ConfigError
from megakd.data.tokenizer import Tokenizer
from megakd.finetune.config import ModelInitConfig
from megakd.models.electra import SequenceClassifier
from megakd.models.encoder import Encoder, EncoderConfig
from megakd.store import load_model


@dataclasses.dataclass
class Pretrained:
    """An encoder (or None for random init), its config and the tokenizer it was trained with."""

    config: EncoderConfig
    tokenizer: Tokenizer
    encoder: Encoder | None


def load_pretrained(path: str | Path, tokenizer: str = "") -> Pretrained:
    """Encoder + tokenizer from an HF export, megakd model dir, pretraining run/checkpoint or classifier dir.

    `tokenizer` (model.tokenizer) overrides the source's own; a source without one needs it.
    """
    stored = load_model(path, "model.path")
    encoder = stored.encoder()
    return Pretrained(encoder.config, stored.tokenizer(tokenizer or None), encoder)


def build_classifier(init: ModelInitConfig, num_labels: int, dropout: float, seed: int,
                     pretrained: Pretrained | None = None
                     ) -> tuple[SequenceClassifier, Tokenizer]:
    """A SequenceClassifier initialised as `init` says, with hidden and classifier dropout `dropout`.

    The head (and, for `init: random`, everything) is drawn from torch's RNG seeded with `seed`, so
    every seed of a multi-seed run starts from its own reproducible initialisation.
    """
    if pretrained is None and init.path:
        pretrained = load_pretrained(init.path, init.tokenizer)
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
