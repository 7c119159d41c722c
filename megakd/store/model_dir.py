"""Model directories: one trained, imported or fine-tuned model, loadable without its run or config tree.

Format ("megakd-model/1"), written by `save_model_dir` and `megakd convert from-hf`:

    model.yaml          format, kind, the EncoderConfig fields, tokenizer location, provenance
    model.safetensors   the megakd state dict (tied output matrix stored once)
    tokenizer/          the tokenizer the model reads, when the source had a usable one: megakd's
                        SentencePiece (spm.model) or an HF tokenizer (tokenizer.json / vocab.txt)
    hf_tokenizer/       otherwise the source's HF tokenizer files, for reference (e.g. no [MASK] token)

kind: "masked_lm" (`MaskedLM`: ELECTRA generator or BERT-MLM, e.g. a DWT teacher),
"discriminator" (`Discriminator`) or "encoder" (a bare `Encoder`, e.g. from `BertModel`).
`hf_kind` remembers the native HF flavour so `megakd convert to-hf` can write it back.

A fine-tuned classifier directory ("megakd-classifier/1", written by `megakd finetune`) is what KD
teachers, self-KD copies and TGT labelers are loaded from:

    classifier.yaml     format, encoder fields, num_labels, task, provenance
    model.safetensors   the SequenceClassifier state dict
    tokenizer/          the tokenizer the model reads (either kind, as above)

Local HuggingFace BERT/ELECTRA directories are read through the same mapping `convert from-hf`
uses (`read_hf_dir`), and so are megakd's own remote-code exports (`MegakdForPreTraining`,
`MegakdForMaskedLM`: T5 relative positions or Admin init), whose config.json holds the encoder
fields and whose weights keep megakd's keys; their shipped Python is never run. Everything here
is read with safetensors or transformers' weights-only loading; `megakd.store.load_model` is the
one entry point that chooses among them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file, load_model, save_model
from torch import Tensor, nn

from megakd.data.tokenizer import HF_TOKENIZER_FILES, HFTokenizer, Tokenizer, copy_tokenizer
from megakd.fsutil import atomic_output_dir
from megakd.models.electra import Discriminator, MaskedLM, SequenceClassifier
from megakd.models.encoder import COMPUTE_FIELDS, Encoder, EncoderConfig
from megakd.store.checkpoint_models import check_weight_count, check_weight_shapes, load_state_checked
from megakd.store.files import StoreError, first_line

log = logging.getLogger(__name__)

MODEL_FORMAT = "megakd-model/1"
MODEL_FILE = "model.yaml"
WEIGHTS_FILE = "model.safetensors"
MODEL_KINDS = {"masked_lm": MaskedLM, "discriminator": Discriminator, "encoder": Encoder}

# HF architecture → (megakd kind, hf_mapping kind used to rename the weights, HF prefix to add, keys to drop)
HF_ARCHITECTURES: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "ElectraForPreTraining": ("discriminator", "electra_discriminator", "", ()),
    "ElectraForMaskedLM": ("masked_lm", "electra_generator", "", ()),
    "ElectraModel": ("encoder", "electra_discriminator", "electra.", ()),
    "BertForMaskedLM": ("masked_lm", "bert_mlm", "", ()),
    "BertForPreTraining": ("masked_lm", "bert_mlm", "", ("cls.seq_relationship.", "bert.pooler.")),  # NSP dropped
    "BertModel": ("encoder", "bert_mlm", "bert.", ("bert.pooler.",)),
}
# megakd/convert/export.py's remote-code architectures → (megakd kind, native flavour to export back to)
MEGAKD_REMOTE_ARCHITECTURES = {"MegakdForPreTraining": ("discriminator", "electra_discriminator"),
                               "MegakdForMaskedLM": ("masked_lm", "electra_generator")}
_HF_TOKENIZER_FILES = (*HF_TOKENIZER_FILES, "spm.model")


def save_model_dir(model: nn.Module, kind: str, out: str | Path, *, tokenizer_dir: str | Path | None = None,
                   hf_tokenizer_dir: str | Path | None = None, hf_kind: str | None = None,
                   source: dict[str, Any] | None = None, force: bool = False) -> Path:
    """Write `model` as a megakd model directory (atomically; a non-empty `out` needs `force`)."""
    if kind not in MODEL_KINDS or not isinstance(model, MODEL_KINDS[kind]):
        raise StoreError(f"kind {kind!r}: expected one of {sorted(MODEL_KINDS)} matching the model "
                              f"({type(model).__name__})")
    with atomic_output_dir(out, force=force, error=StoreError, hint=" (use --force to replace it)") as tmp:
        info: dict[str, Any] = {"format": MODEL_FORMAT, "kind": kind, "hf_kind": hf_kind,
                                "encoder": dataclasses.asdict(model.config), "tokenizer": None,
                                "hf_tokenizer": None, "source": source or {}}
        if tokenizer_dir is not None:
            copy_tokenizer(tokenizer_dir, tmp / "tokenizer")
            info["tokenizer"] = "tokenizer"
        elif hf_tokenizer_dir is not None:
            files = [f for f in _HF_TOKENIZER_FILES if (Path(hf_tokenizer_dir) / f).is_file()]
            if files:
                (tmp / "hf_tokenizer").mkdir()
                for name in files:
                    shutil.copyfile(Path(hf_tokenizer_dir) / name, tmp / "hf_tokenizer" / name)
                info["hf_tokenizer"] = "hf_tokenizer"
        save_model(model, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / MODEL_FILE).write_text(yaml.safe_dump(info, sort_keys=False))
    return Path(out)


def _read_info_file(file: Path, fmt: str, missing: str) -> dict[str, Any]:
    """A directory's YAML description, checked to be a mapping of format `fmt` (one-line errors)."""
    if not file.is_file():
        raise StoreError(f"{file}: missing ({missing})")
    try:
        info = yaml.safe_load(file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise StoreError(f"{file}: not valid YAML ({first_line(err)})") from None
    if not isinstance(info, dict) or info.get("format") != fmt:
        raise StoreError(f"{file}: format: expected {fmt!r}")
    return info


def read_model_dir_info(path: str | Path) -> dict[str, Any]:
    """The parsed, checked `model.yaml` (kind, encoder fields, tokenizer paths made absolute)."""
    path = Path(path)
    file = path / MODEL_FILE
    info = _read_info_file(file, MODEL_FORMAT, "not a megakd model directory")
    if info.get("kind") not in MODEL_KINDS:
        raise StoreError(f"{file}: kind: expected one of {sorted(MODEL_KINDS)}, got {info.get('kind')!r}")
    known = {f.name for f in dataclasses.fields(EncoderConfig)}
    fields = info.get("encoder")
    if not isinstance(fields, dict):
        raise StoreError(f"{file}: encoder: expected a mapping of EncoderConfig fields")
    unknown = sorted(set(fields) - known)
    if unknown:
        raise StoreError(f"{file}: encoder.{unknown[0]}: unknown EncoderConfig field")
    try:
        info["encoder_config"] = EncoderConfig(**fields).validate()
    except ValueError as err:
        raise StoreError(f"{file}: {err}") from None
    for key in ("tokenizer", "hf_tokenizer"):
        if info.get(key):
            info[key] = path / info[key]
    return info


def load_model_dir(path: str | Path) -> tuple[str, nn.Module]:
    """(kind, model) from a megakd model directory; the model is in eval mode (call .train() to fine-tune)."""
    info = read_model_dir_info(path)
    kind = info["kind"]
    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        raise StoreError(f"{weights}: missing")
    check_weight_shapes(MODEL_KINDS[kind], [info["encoder_config"]], weights, str(Path(path) / MODEL_FILE))
    model = MODEL_KINDS[kind](info["encoder_config"])
    try:
        load_model(model, str(weights), strict=True)
    except Exception as err:  # mismatched keys, or not a safetensors file at all
        raise StoreError(f"{weights}: does not match {Path(path) / MODEL_FILE} "
                              f"({str(err).splitlines()[0]})") from None
    return kind, model.eval()


def _hf_architecture(src: Path) -> tuple[str, dict]:
    config_file = src / "config.json"
    if not config_file.is_file():
        raise StoreError(f"{config_file}: missing (expected a local HuggingFace model directory)")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise StoreError(f"{config_file}: not valid JSON ({err})") from None
    architectures = raw.get("architectures") or []
    for arch in architectures:
        if arch in HF_ARCHITECTURES or arch in MEGAKD_REMOTE_ARCHITECTURES:
            return arch, raw
    raise StoreError(f"{config_file}: unsupported architectures {architectures} (model_type "
                          f"{raw.get('model_type')!r}); expected one of "
                          f"{', '.join([*HF_ARCHITECTURES, *MEGAKD_REMOTE_ARCHITECTURES])}")


def _tokenizer_in(src: Path) -> Path | None:
    """`src` itself when it carries a tokenizer megakd can use (its SentencePiece model or an HF tokenizer)."""
    if not ((src / "spm.model").is_file() or HFTokenizer.found_in(src)):
        return None
    try:
        Tokenizer.load(src)
    except (ValueError, RuntimeError, OSError) as err:
        log.warning("%s: its tokenizer files are not usable by megakd (%s); keeping them for reference only",
                    src, first_line(err))
        return None
    return src


def import_hf_state_dict(sd: dict[str, Tensor], architecture: str) -> dict[str, Tensor]:
    """HF weights of a supported architecture → the megakd state dict of its kind."""
    from megakd.models.hf_mapping import from_hf_state_dict

    kind, mapping_kind, prefix, drop = HF_ARCHITECTURES[architecture]
    sd = {prefix + k: v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if not k.startswith(drop)} if drop else sd
    out = from_hf_state_dict(sd, mapping_kind)
    if kind == "encoder":
        out = {k[len("encoder."):]: v for k, v in out.items() if k.startswith("encoder.")}
    return out


HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")


@dataclasses.dataclass
class HFModel:
    """A local HF BERT/ELECTRA directory read as a megakd model (not yet written anywhere)."""

    kind: str
    model: nn.Module
    hf_kind: str | None  # the native flavour to export back to (None for a bare encoder)
    tokenizer_dir: Path | None  # the source itself when it carries a usable tokenizer (either kind)
    source: dict[str, Any]


@contextlib.contextmanager
def hf_bars_off_unless_terminal() -> Iterator[None]:
    """transformers' progress bars ("Loading weights", "Writing model shards") off while stderr is not a
    terminal (a log file, a Slurm `--output`), where each redraw would be one more carriage return in the
    file; its setting is put back."""
    from transformers.utils import logging as hf_logging

    if sys.stderr.isatty() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def read_hf_dir(src: str | Path) -> HFModel:
    """A local HF BERT/ELECTRA directory → the megakd model of its kind (eval mode)."""
    from megakd.models.hf_mapping import encoder_config_from_hf  # imports transformers: only when needed

    src = Path(src)
    architecture, raw = _hf_architecture(src)
    if architecture in MEGAKD_REMOTE_ARCHITECTURES:
        return _read_megakd_export(src, architecture, raw)
    kind, mapping_kind, _, _ = HF_ARCHITECTURES[architecture]
    hf_class = getattr(__import__("transformers", fromlist=[architecture]), architecture)
    try:
        hf_config = hf_class.config_class.from_pretrained(src, local_files_only=True)
        config = encoder_config_from_hf(hf_config)
    except (ValueError, OSError) as err:
        raise StoreError(f"{src / 'config.json'}: {first_line(err)}") from None
    if not any((src / name).is_file() for name in HF_WEIGHT_FILES):
        raise StoreError(f"{src}: no weights (expected one of {', '.join(HF_WEIGHT_FILES)} beside config.json)")
    if (safetensors := src / "model.safetensors").is_file():  # sized against the config before transformers builds
        check_weight_count(MODEL_KINDS[kind], [config], safetensors, str(src / "config.json"))
    try:
        with hf_bars_off_unless_terminal():
            hf_model, loading = hf_class.from_pretrained(src, local_files_only=True, output_loading_info=True,
                                                         dtype=torch.float32)
    except Exception as err:  # transformers loads weights-only; a payload or garbage ends here
        raise StoreError(f"{src}: cannot load the {architecture} weights ({first_line(err)[:200]})") from None
    missing = [k for k in loading["missing_keys"] if not k.endswith((".position_ids", ".token_type_ids"))]
    if missing:
        raise StoreError(f"{src}: the weights lack {missing[0]!r} ({len(missing)} missing) for {architecture}")
    try:
        sd = import_hf_state_dict(dict(hf_model.state_dict()), architecture)
    except ValueError as err:
        raise StoreError(f"{src}: {err}") from None
    model = MODEL_KINDS[kind](config)
    load_state_checked(model, sd, str(src), f"{src / 'config.json'}")
    source = {"path": str(src.resolve()), "architecture": architecture, "model_type": raw.get("model_type")}
    return HFModel(kind, model.eval(), None if kind == "encoder" else mapping_kind, _tokenizer_in(src),
                   source)


def _read_megakd_export(src: Path, architecture: str, raw: dict) -> HFModel:
    """A megakd remote-code HF export: encoder fields from config.json, megakd keys from safetensors."""
    config_file, weights = src / "config.json", src / "model.safetensors"
    kind, hf_kind = MEGAKD_REMOTE_ARCHITECTURES[architecture]
    names = [f.name for f in dataclasses.fields(EncoderConfig) if f.name not in COMPUTE_FIELDS]
    missing = [name for name in names if name not in raw]
    if missing:
        raise StoreError(f"{config_file}: {missing[0]}: missing (a {architecture} config.json lists every "
                         "encoder field megakd convert to-hf writes)")
    try:
        config = EncoderConfig(**{name: raw[name] for name in names}).validate()
    except (TypeError, ValueError) as err:
        raise StoreError(f"{config_file}: {first_line(err)}") from None
    if not weights.is_file():
        raise StoreError(f"{weights}: missing (a {architecture} directory keeps its weights there)")
    try:
        sd = load_file(str(weights))
    except Exception as err:  # not a safetensors file, truncated, or a corrupt header
        raise StoreError(f"{weights}: not a readable safetensors file ({first_line(err)[:200]})") from None
    check_weight_shapes(MODEL_KINDS[kind], [config], weights, str(config_file))
    model = MODEL_KINDS[kind](config)
    load_state_checked(model, sd, str(weights), str(config_file))
    source = {"path": str(src.resolve()), "architecture": architecture, "model_type": raw.get("model_type")}
    return HFModel(kind, model.eval(), hf_kind, _tokenizer_in(src), source)


# -- fine-tuned classifiers -----------------------------------------------------------------------

CLASSIFIER_FORMAT = "megakd-classifier/1"
CLASSIFIER_FILE = "classifier.yaml"


def save_classifier(model: SequenceClassifier, tokenizer: Tokenizer, out: str | Path,
                    extra: dict[str, Any] | None = None) -> Path:
    """Write a fine-tuned classifier directory atomically (replacing an older one)."""
    with atomic_output_dir(out, force=True, error=StoreError) as tmp:
        tokenizer.copy_to(tmp / "tokenizer")
        save_model(model, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        info = {"format": CLASSIFIER_FORMAT, "num_labels": model.num_labels,
                "encoder": dataclasses.asdict(model.config), **(extra or {})}
        (tmp / CLASSIFIER_FILE).write_text(yaml.safe_dump(info, sort_keys=False))
    return Path(out)


def load_classifier(path: str | Path) -> tuple[SequenceClassifier, Tokenizer]:
    """(model in eval mode, tokenizer) from a fine-tuned classifier directory."""
    path = Path(path)
    file = path / CLASSIFIER_FILE
    info = _read_info_file(file, CLASSIFIER_FORMAT, "expected a fine-tuned classifier directory from megakd finetune")
    try:
        config = EncoderConfig(**info["encoder"]).validate()
    except (TypeError, ValueError, KeyError) as err:
        raise StoreError(f"{file}: encoder: {err}") from None
    weights = path / WEIGHTS_FILE
    try:
        check_weight_shapes(lambda c: SequenceClassifier(c, int(info["num_labels"])), [config], weights, str(file))
    except StoreError as err:
        raise StoreError(f"{weights}: cannot load as this classifier's safetensors "
                         f"({str(err).removeprefix(f'{weights}: ')})") from None
    model = SequenceClassifier(config, int(info["num_labels"]))
    try:
        load_model(model, str(weights), strict=True)
    except Exception as err:
        raise StoreError(f"{weights}: cannot load as this classifier's safetensors ({first_line(err)[:200]})") from None
    return model.eval(), Tokenizer.load(path / "tokenizer")
