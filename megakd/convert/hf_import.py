"""`megakd convert from-hf`: a local HF BERT/ELECTRA directory → a megakd model directory."""

from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

from megakd.store.model_dir import read_hf_dir, save_model_dir

log = logging.getLogger(__name__)


def from_hf(src: str | Path, out: str | Path, force: bool = False) -> tuple[str, nn.Module]:
    """Import `src` through the store's HF reader and write it as a model directory at `out`."""
    hf = read_hf_dir(src)
    save_model_dir(hf.model, hf.kind, out, tokenizer_dir=hf.tokenizer_dir,
                   hf_tokenizer_dir=None if hf.tokenizer_dir else Path(src), hf_kind=hf.hf_kind,
                   source=hf.source, force=force)
    log.info("imported %s (%s) as a megakd %s model in %s", src, hf.source["architecture"], hf.kind, out)
    return hf.kind, hf.model
