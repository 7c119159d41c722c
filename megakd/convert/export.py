"""megakd models → HuggingFace directories (config.json, model.safetensors, tokenizer files).

Absolute-position models with normal init become native `ElectraForPreTraining`,
`ElectraForMaskedLM` or `BertForMaskedLM` through `megakd.models.hf_mapping`. Models the native
classes cannot express (T5 relative position bias, Admin residual scales ω) are written with
megakd's own state-dict keys plus remote code: `configuration_megakd.py`, `modeling_megakd.py`
and copies of megakd/models/dropout.py, encoder.py and heads.py (imports made relative), loaded with
`AutoModel...from_pretrained(dir, trust_remote_code=True)`. Vendoring the source (rather than a
second implementation) keeps one definition of the encoder; tests check the loaded model's
logits against megakd's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import transformers
from safetensors.torch import save_file

from megakd.convert.common import ConversionError, atomic_output_dir
from megakd.data.tokenizer import Tokenizer
from megakd.models.electra import Discriminator, MaskedLM
from megakd.models.encoder import COMPUTE_FIELDS, EncoderConfig
from megakd.models.hf_mapping import TIED_EMBEDDING, hf_config, hf_model_class, to_hf_state_dict
from megakd.store import load_model
from megakd.store.model_dir import hf_bars_off_unless_terminal

log = logging.getLogger(__name__)

REMOTE_DIR = Path(__file__).parent / "remote"
REMOTE_AUTO_MAP = {
    "AutoConfig": "configuration_megakd.MegakdConfig",
    "AutoModel": "modeling_megakd.MegakdModel",
    "AutoModelForPreTraining": "modeling_megakd.MegakdForPreTraining",
    "AutoModelForMaskedLM": "modeling_megakd.MegakdForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_megakd.MegakdForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_megakd.MegakdForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_megakd.MegakdForQuestionAnswering",
}
VENDORED_MODULES = ("dropout", "encoder", "heads")  # megakd/models/<name>.py → megakd_<name>.py


def needs_remote_code(config: EncoderConfig) -> bool:
    """True when no native HF class computes the same function (T5 relative bias, Admin ω)."""
    return config.position_encoding != "absolute" or config.init != "normal"


def _vendored_sources() -> dict[str, str]:
    """megakd_<name>.py for each of VENDORED_MODULES: megakd's model source, made importable without megakd.

    Each module may import megakd only as `from megakd.models.<vendored name> import`, which becomes
    the relative `from .megakd_<name> import`; anything else would not exist beside the copies."""
    models_dir = Path(__file__).parents[1] / "models"
    sources = {}
    for name in VENDORED_MODULES:
        text = (models_dir / f"{name}.py").read_text()
        for other in VENDORED_MODULES:
            text = text.replace(f"from megakd.models.{other} import", f"from .megakd_{other} import")
        imports = [line for line in text.splitlines() if line.startswith(("import", "from"))]
        if any("megakd" in line and not line.startswith("from .megakd_") for line in imports):
            raise RuntimeError(f"megakd/models/{name}.py imports megakd beyond {VENDORED_MODULES}: "
                               "it can no longer be vendored as remote code")
        sources[f"megakd_{name}.py"] = text
    return sources


def _remote_config(config: EncoderConfig, architecture: str) -> dict:
    fields = dataclasses.asdict(config)
    for how_not_what in COMPUTE_FIELDS:
        fields.pop(how_not_what)
    return {**fields, "model_type": "megakd", "architectures": [architecture], "auto_map": REMOTE_AUTO_MAP,
            "dtype": "float32", "transformers_version": transformers.__version__}


def _save_remote(model: MaskedLM | Discriminator, out: Path) -> str:
    """Write the remote-code directory; returns its architecture."""
    architecture = "MegakdForMaskedLM" if isinstance(model, MaskedLM) else "MegakdForPreTraining"
    # On the host first, as HF's save_pretrained does for the native classes: the model may live on a GPU.
    sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k != TIED_EMBEDDING}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_remote_config(model.config, architecture), indent=2) + "\n")
    for name in ("configuration_megakd.py", "modeling_megakd.py"):
        shutil.copyfile(REMOTE_DIR / name, out / name)
    for name, text in _vendored_sources().items():
        (out / name).write_text(text)
    return architecture


def save_hf_model(model: MaskedLM | Discriminator, kind: str, out: str | Path,
                  tokenizer_dir: str | Path | None) -> str:
    """Write one complete HF directory into `out` (which must exist); returns the architecture written.

    `kind` is the native flavour ("electra_discriminator", "electra_generator", "bert_mlm"). A BERT-MLM
    with narrow embeddings (embedding_size < hidden) has no BERT equivalent but is exactly an ELECTRA
    generator, so it is written as `ElectraForMaskedLM`.
    """
    out = Path(out)
    config = model.config
    if tokenizer_dir is not None:
        tokenizer = Tokenizer.load(tokenizer_dir)
        if tokenizer.vocab_size != config.vocab_size:
            raise ConversionError(f"{tokenizer_dir}: tokenizer has {tokenizer.vocab_size} pieces but the model's "
                                  f"vocab_size is {config.vocab_size}")
        tokenizer.save_hf(out, config.max_position_embeddings)
    else:
        log.warning("%s: no tokenizer to export; the HF directory will hold the model only", out)
    if needs_remote_code(config):
        return _save_remote(model, out)
    if kind == "bert_mlm" and config.embed_dim != config.hidden_size:
        log.info("BERT-MLM with embedding_size %d != hidden %d: exporting as ElectraForMaskedLM",
                 config.embed_dim, config.hidden_size)
        kind = "electra_generator"
    hf_model = hf_model_class(kind)(hf_config(config, kind))
    missing, unexpected = hf_model.load_state_dict(to_hf_state_dict(model, kind), strict=False)
    missing = [k for k in missing if not k.endswith((".position_ids", ".token_type_ids"))]
    if missing or unexpected:  # the mapping is tested exhaustively; this guards against HF changing
        raise RuntimeError(f"HF {type(hf_model).__name__}: missing {missing}, unexpected {unexpected}")
    with hf_bars_off_unless_terminal():
        hf_model.save_pretrained(out)
    return type(hf_model).__name__


def _exports(src: Path) -> list[tuple[str, MaskedLM | Discriminator, str, Path | None]]:
    """(relative output dir, model, native HF flavour, tokenizer dir) for every model `src` holds."""
    if (src / "config.json").is_file():
        raise ConversionError(f"{src}: not a megakd run directory (no checkpoints/), checkpoint or model directory: "
                              "it is already a HuggingFace directory")
    stored = load_model(src)
    if set(stored.models) == {"discriminator", "masked_lm"}:  # an ELECTRA run or checkpoint
        return [(kind_dir, stored.models[kind], stored.hf_kinds[kind], stored.tokenizer_dir)
                for kind_dir, kind in (("discriminator", "discriminator"), ("generator", "masked_lm"))]
    (kind, model), = stored.models.items()
    if kind not in ("masked_lm", "discriminator"):
        raise ConversionError(f"{src}: holds {'a bare encoder' if kind == 'encoder' else 'a ' + kind}, which has "
                              "no HF pre-training head to export")
    default = "bert_mlm" if kind == "masked_lm" else "electra_discriminator"
    return [(".", model, stored.hf_kinds.get(kind) or default, stored.tokenizer_dir)]


def to_hf(src: str | Path, out: str | Path, force: bool = False) -> dict[str, str]:
    """`megakd convert to-hf`: a run, checkpoint or megakd model directory → HF directories under `out`.

    ELECTRA runs → `out/discriminator/` and `out/generator/`; BERT-MLM runs and model directories →
    `out/` itself. Returns {relative dir: architecture}. `out` appears complete or not at all.
    """
    src = Path(src)
    if Path(out).resolve() == src.resolve() or Path(out).resolve() in src.resolve().parents:
        raise ConversionError(f"{out}: the output must not be or contain the source {src}")
    exports = _exports(src)
    written: dict[str, str] = {}
    with atomic_output_dir(out, force) as tmp:
        for name, model, kind, tokenizer_dir in exports:
            (tmp / name).mkdir(exist_ok=True)
            written[name] = save_hf_model(model, kind, tmp / name, tokenizer_dir)
    log.info("exported %s to %s: %s", src, out, ", ".join(f"{k} ({v})" for k, v in written.items()))
    return written


def export_run(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Export a run's newest checkpoint to `out_dir` (default `run_dir/hf`), replacing an older export.

    Called by `megakd pretrain` / `megakd distill` on rank 0 after training; it reads only files, so
    it works the same after single, ddp and DeepSpeed training.
    """
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "hf"
    to_hf(run_dir, out, force=True)
    return out

