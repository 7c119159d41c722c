"""Warm start (`init.*`): a new run's models begin from stored weights instead of random init.

Sources are whatever `megakd.store.load_model` reads (a megakd run or checkpoint, a megakd model
dir, a local HF ELECTRA/BERT dir) plus the two-directory layout `megakd convert to-hf` writes for
an ELECTRA run (`generator/` and `discriminator/`, each an HF dir). Only the weights are taken:
the optimizer state, LR schedule, data position and step are fresh (step 0), because the source's
schedule ended, or was another run's. A resumed run never reads the init again (its checkpoint
holds everything), so `build_trainer` calls this only for a run that starts at step 0.

`init.discriminator` may also name a source holding no discriminator but an encoder (a masked LM, a
fine-tuned classifier, a bare encoder): the discriminator takes that encoder and a fresh RTD head,
which is how RTD pretraining continues from a trained masked LM.

The model sections of the config must describe the source's architecture: every weight is loaded
strictly, and a difference is one line naming the parameter, both shapes and the file.
"""

from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

from megakd.config import Config, ConfigError
from megakd.data.tokenizer import Tokenizer
from megakd.models.electra import Discriminator, MaskedLM
from megakd.store import StoredModels, StoreError, check_same_tokenizer, load_model
from megakd.store.checkpoint_models import load_state_checked

log = logging.getLogger(__name__)

# The stored kind each built model takes its weights from.
KIND_OF_MODEL = {"generator": "masked_lm", "discriminator": "discriminator"}
# Fields that change what a model computes without changing any weight's shape (t5_relative's only
# with that encoding), so a strict load alone would not notice them.
FUNCTION_FIELDS = ("num_heads", "layer_norm_eps", "position_encoding", "init")
RELATIVE_FIELDS = ("relative_buckets", "relative_max_distance")
# Weight files named in errors, in the order each kind of source holds them.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def warm_start(cfg: Config, tokenizer: Tokenizer, generator: MaskedLM, discriminator: Discriminator | None) -> dict:
    """Load `init.*` into the built models in place; returns {model name: source path} of what was loaded."""
    built = {"generator": generator, "discriminator": discriminator}
    sources: dict[tuple[str, str], StoredModels] = {}
    loaded: dict[str, str] = {}
    for name in cfg.model.built_models():
        path, key = cfg.init.source(name)
        if not path:
            continue
        if (path, key) not in sources:
            sources[(path, key)] = _load_source(path, key)
        stored = sources[(path, key)]
        kind = KIND_OF_MODEL[name]
        if kind in stored.models:
            source_model = stored.models[kind]
            state = source_model.state_dict()
        elif key == "init.from":  # `from` fills what it can; the other model starts from random init
            continue
        elif key == "init.discriminator":  # a masked LM, classifier or bare encoder: its encoder, a fresh head
            source_model = stored.encoder()
            state = _encoder_under_fresh_head(source_model, built[name])
            log.info("model.discriminator: %s holds no discriminator; "
                     "its encoder under an RTD head at random init", path)
        else:
            stored.get(kind)  # raises: names what the source holds and what was expected
        where = f"{key}={path}"
        check_same_tokenizer(tokenizer, stored.tokenizer_dir, where, source_model.config.vocab_size)
        _check_function(cfg, name, source_model, where)
        try:
            load_state_checked(built[name], state, _weights_file(stored, name), f"model.{name}")
        except StoreError as err:
            raise StoreError(f"{where}: {err}") from None
        loaded[name] = path
    if cfg.init.from_ and not loaded:
        held = ", ".join(sorted(next(iter(sources.values())).models)) if sources else "nothing"
        raise ConfigError(f"init.from={cfg.init.from_}: holds {held}, but model.objective={cfg.model.objective} "
                          f"builds {' and '.join(cfg.model.built_models())} (a masked LM initializes the generator, "
                          "a discriminator the discriminator)")
    for name in cfg.model.built_models():
        log.info("model.%s: %s", name, f"warm start from {loaded[name]}" if name in loaded else "random init")
    return loaded


def _encoder_under_fresh_head(encoder: nn.Module, discriminator: Discriminator) -> dict:
    """A discriminator state dict: `encoder`'s weights under the built model's (random-init) RTD head."""
    return {**{f"encoder.{k}": v for k, v in encoder.state_dict().items()},
            **{f"head.{k}": v for k, v in discriminator.head.state_dict().items()}}


def _load_source(path: str, key: str) -> StoredModels:
    """The models at `path`; an HF ELECTRA pair as `convert to-hf` writes it is read as one source."""
    root = Path(path)
    pair = {kind: root / sub for sub, kind in (("generator", "masked_lm"), ("discriminator", "discriminator"))}
    if not (root / "config.json").is_file() and all((d / "config.json").is_file() for d in pair.values()):
        parts = {kind: load_model(d, key) for kind, d in pair.items()}
        tokenizers = {kind: p.tokenizer_dir for kind, p in parts.items()}
        if tokenizers["discriminator"] is not None and tokenizers["masked_lm"] is not None:
            check_same_tokenizer(Tokenizer.load(tokenizers["discriminator"]), tokenizers["masked_lm"],
                                 f"{key}={pair['masked_lm']}")
        models = {kind: p.get(kind) for kind, p in parts.items()}
        return StoredModels(root, key, models, tokenizers["discriminator"] or tokenizers["masked_lm"])
    return load_model(path, key)


def _check_function(cfg: Config, name: str, source: nn.Module, where: str) -> None:
    """Refuse a config that computes another function with the same weight shapes (e.g. other num_heads)."""
    ours, theirs = getattr(cfg.model, name), source.config
    fields = FUNCTION_FIELDS + (RELATIVE_FIELDS if ours.position_encoding == "t5_relative" else ())
    for field in fields:
        if getattr(ours, field) != getattr(theirs, field):
            raise ConfigError(f"{where}: model.{name}.{field}={getattr(ours, field)!r} but the source has "
                              f"{getattr(theirs, field)!r}")


def _weights_file(stored: StoredModels, name: str) -> str:
    """The file the weights of `name` came from, for error messages (the source dir if none is known)."""
    root = stored.source / name if (stored.source / name / "config.json").is_file() else stored.source
    candidates = (*WEIGHT_FILES, f"{name}.safetensors", "electra.safetensors", name, "electra")
    for file in candidates:
        if (root / file).exists():
            return str(root / file)
    return str(root)
