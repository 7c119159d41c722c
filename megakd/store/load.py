"""`load_model(src)`: every trained model megakd reads, from wherever users keep one.

A source is a megakd run directory (its newest intact checkpoint), a checkpoint directory, a
megakd model directory, a fine-tuned classifier directory or a local HuggingFace BERT/ELECTRA
directory. DWT teachers, `eval-rtd`, fine-tuning's `model.path`, TGT generators and labelers and
`convert to-hf` all come through here, so every one of them reads only safetensors or
weights-only files and reports a bad source in one line naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from megakd.config import Config, ConfigError, load_config
from megakd.data.tokenizer import Tokenizer
from megakd.store.checkpoint_models import load_checkpoint, resolve_checkpoint
from megakd.store.files import StoreError
from megakd.store.model_dir import (
    CLASSIFIER_FILE,
    MODEL_FILE,
    load_classifier,
    load_model_dir,
    read_hf_dir,
    read_model_dir_info,
)

RECIPES = Path(__file__).resolve().parents[2] / "configs"  # the source tree's recipes (none in a wheel install)
KIND_NAMES = {"masked_lm": "a masked LM (BERT-MLM or ELECTRA generator)", "discriminator": "an ELECTRA discriminator",
              "encoder": "an encoder", "classifier": "a fine-tuned classifier"}


@dataclass
class StoredModels:
    """The models one source holds, by kind, in eval mode, with the tokenizer they read."""

    source: Path
    role: str  # the setting or option that named the source, for error messages
    models: dict[str, nn.Module]  # kind → model ("masked_lm", "discriminator", "encoder", "classifier")
    tokenizer_dir: Path | None  # the tokenizer the models read (megakd SentencePiece or HF); None if none
    hf_kinds: dict[str, str] = field(default_factory=dict)  # kind → native HF flavour to export it as

    def get(self, kind: str) -> nn.Module:
        """The model of `kind`; a source holding another kind is refused in one line."""
        if kind not in self.models:
            held = ", ".join(KIND_NAMES[k] for k in self.models)
            raise StoreError(f"{self._name()}: holds {held}; expected {KIND_NAMES[kind]}")
        return self.models[kind]

    def encoder(self) -> nn.Module:
        """The encoder to fine-tune: a classifier's, else the discriminator's, else the MLM's, else the bare one."""
        for kind in ("classifier", "discriminator", "masked_lm"):
            if kind in self.models:
                return self.models[kind].encoder
        return self.models["encoder"]

    def tokenizer(self, override: str | Path | None = None) -> Tokenizer:
        if override:
            return Tokenizer.load(override)
        if self.tokenizer_dir is None:
            raise StoreError(f"{self._name()}: carries no tokenizer (megakd's tokenizer/ or HF tokenizer files); "
                             "name one explicitly")
        return Tokenizer.load(self.tokenizer_dir)

    def _name(self) -> str:
        return f"{self.role}={self.source}" if self.role else str(self.source)


def writer_of(path: Path) -> str:
    """The command that writes `path`: a recipe in configs/ whose run.dir holds it, or `megakd finetune` for
    a `<run.dir>/seed_<s>/model`; "" if neither. A missing encoder is usually a run not made yet, so the
    error names how to make it."""
    target, found = path.resolve(), []
    for recipe in sorted(RECIPES.glob("*.yaml")):
        try:
            cfg = load_config(recipe, cls=Config)
        except ConfigError:  # a fine-tuning recipe
            continue
        run_dir = Path(cfg.run.dir).resolve()
        if run_dir == target or run_dir in target.parents:
            shown = recipe.relative_to(Path.cwd()) if recipe.is_relative_to(Path.cwd()) else recipe
            found.append((len(run_dir.parts), f"megakd {'distill' if cfg.distill.teacher else 'pretrain'} -c {shown}"))
    if found:
        return max(found)[1]
    if path.name == "model" and path.parent.name.startswith("seed_"):
        return f"megakd finetune -c CONFIG run.dir={path.parent.parent}"
    return ""


def check_source(src: str | Path, role: str = "") -> Path:
    """`src` as a Path if it is a directory; otherwise a one-line error naming `role`, `src` and what writes it."""
    src = Path(src)
    if not src.is_dir():
        command = writer_of(src)
        raise StoreError(f"{role + '=' if role else ''}{src}: no such directory (expected a megakd run, checkpoint, "
                         "model directory, fine-tuned classifier or HF BERT/ELECTRA directory)"
                         + (f"; `{command}` writes it" if command else ""))
    return src


def load_model(src: str | Path, role: str = "") -> StoredModels:
    """Every model stored at `src` (see the module docstring); `role` prefixes errors (e.g. "distill.teacher")."""
    src = check_source(src, role)
    try:
        if (src / CLASSIFIER_FILE).is_file():
            model, tokenizer = load_classifier(src)
            return StoredModels(src, role, {"classifier": model}, tokenizer.path)
        if (src / MODEL_FILE).is_file():
            info = read_model_dir_info(src)
            kind, model = load_model_dir(src)
            hf_kinds = {kind: info["hf_kind"]} if info.get("hf_kind") else {}
            return StoredModels(src, role, {kind: model}, info["tokenizer"], hf_kinds)
        if (src / "config.json").is_file():
            hf = read_hf_dir(src)
            return StoredModels(src, role, {hf.kind: hf.model}, hf.tokenizer_dir,
                                {hf.kind: hf.hf_kind} if hf.hf_kind else {})
        ckpt = load_checkpoint(resolve_checkpoint(src))
    except StoreError as err:
        raise StoreError(f"{role}: {err}" if role else str(err)) from None
    if ckpt.discriminator is None:
        return StoredModels(ckpt.path, role, {"masked_lm": ckpt.generator}, ckpt.tokenizer_dir,
                            {"masked_lm": "bert_mlm"})
    return StoredModels(ckpt.path, role, {"discriminator": ckpt.discriminator, "masked_lm": ckpt.generator},
                        ckpt.tokenizer_dir,
                        {"discriminator": "electra_discriminator", "masked_lm": "electra_generator"})


def freeze(model: nn.Module) -> nn.Module:
    """Eval mode, no trainable parameters: DWT teachers, KD teachers, self-KD copies, TGT models."""
    return model.eval().requires_grad_(False)


def check_same_tokenizer(expected: Tokenizer, other: Tokenizer | Path | None, what: str,
                         vocab_size: int | None = None) -> None:
    """Refuse a model whose tokenizer (or model vocabulary) is not `expected`'s.

    A token-level KL, an RTD label or a soft label between models with different vocabularies is
    silently meaningless, so every pairing of models checks this (by vocabulary hash, which for an
    HF tokenizer also covers its normalizer and special-token roles).
    """
    if other is None:
        raise StoreError(f"{what}: carries no tokenizer (megakd's tokenizer/ or HF tokenizer files), so it cannot be "
                         f"checked against the {expected.describe()}; the models must share a tokenizer")
    own = other if isinstance(other, Tokenizer) else Tokenizer.load(other)
    if own.vocab_hash != expected.vocab_hash:
        raise StoreError(f"{what}: its {own.describe()} is not the {expected.describe()}; "
                         "the models must share a tokenizer")
    if vocab_size is not None and vocab_size != expected.vocab_size:
        raise StoreError(f"{what}: model vocab_size {vocab_size} != {expected.vocab_size} pieces of {expected.path}")
