"""Finishing a loaded config: every value that is `auto` until the tokenizer, the launch and the device
are known, resolved in one step per tree before anything is built; nothing changes the config after it.

A pretraining recipe leaves the models' `vocab_size` at `auto` (the tokenizer's size), their
`pad_token_id` at its default (the tokenizer's pad id) and `backend.name` at `auto` (single, or ddp
when a launcher started several ranks): `finish_config` fills them in, for `megakd pretrain`/`distill`
(with the tokenizer the run loaded), `--print-config`, `megakd plan` and the findings' planner. A
fine-tuning or GLUE config has `backend.name` and `finetune.precision: auto` (bf16 on a CUDA device
that supports it): `FinetuneConfig.finish` and `GlueConfig.finish` fill them in with `finish_backend`
and `resolve_precision` from here. `data.vocab_size: auto` and `data.valid_shards: auto` stay as written:
they say how to find or build the data (the bundled corpus's size, `<data.shards>/valid` if it
exists), and the run's config.yaml keeps them so.

It reads the tokenizer through `megakd.data`, the launch from the `megakd.launch.Launch` it is given,
and asks torch whether there is a CUDA device; nothing of the engine, so the commands that only print
or plan a config never import it.
"""

from __future__ import annotations

import torch

from megakd.config import BUNDLED_VOCAB_SIZE, BackendConfig, Config, ConfigError
from megakd.data.tokenizer import Tokenizer
from megakd.launch import Launch
from megakd.models.encoder import EncoderConfig


def finish_config(cfg: Config, tokenizer: Tokenizer | None = None, *, launch: Launch | None = None) -> Config:
    """`cfg` as the run will use it, finished in place: every model's `vocab_size: auto` replaced by the
    tokenizer's size and its pad id by the tokenizer's, `backend.name: auto` by the backend `launch`
    gets. An explicit size or pad id the tokenizer contradicts is refused.

    `tokenizer` is the one the run loaded; without it, `data.tokenizer` is read, or (no tokenizer
    configured) the bundled corpus's tokenizer is assumed, of `bundled_vocab_size` pieces padding
    with id 0, without building any data. `launch` is the one the command read at its entry; None
    reads this process's (`Launch.from_environ`), for the commands that only print or plan a config.
    """
    resolve_vocab_sizes(cfg, *tokenizer_vocab(cfg, tokenizer))
    finish_backend(cfg.backend, launch or Launch.from_environ())
    return cfg


def tokenizer_vocab(cfg: Config, tokenizer: Tokenizer | None = None) -> tuple[int, str, int]:
    """(size, where from, pad id) of the tokenizer this config trains with, without building any data."""
    if tokenizer is None and cfg.data.tokenizer:
        tokenizer = Tokenizer.load(cfg.data.tokenizer)
    if tokenizer is not None:
        return tokenizer.vocab_size, str(tokenizer.path), tokenizer.pad_id
    return bundled_vocab_size(cfg), "the bundled corpus", 0


def bundled_vocab_size(cfg: Config) -> int:
    """Size of the bundled-corpus tokenizer: data.vocab_size, or under "auto" the one the models ask for."""
    if cfg.data.vocab_size != "auto":
        return cfg.data.vocab_size
    explicit = {getattr(cfg.model, name).vocab_size for name in cfg.model.built_models()} - {"auto"}
    if len(explicit) > 1:
        raise ConfigError(f"model.generator.vocab_size and model.discriminator.vocab_size differ "
                          f"({sorted(explicit)}): one tokenizer serves both models")
    return explicit.pop() if explicit else BUNDLED_VOCAB_SIZE


def resolve_vocab_sizes(cfg: Config, tokenizer_size: int, tokenizer_name: str, pad_id: int = 0) -> None:
    """Put the tokenizer's size into every `vocab_size: auto`; refuse an explicit size that differs.

    `pad_token_id` (the embedding row that never trains) follows the tokenizer's pad id too: left
    at its default 0 it takes the tokenizer's (e.g. 1 for a RoBERTa-style BPE); another explicit
    value that differs is refused.
    """
    default_pad = EncoderConfig().pad_token_id
    for name in cfg.model.built_models():
        model = getattr(cfg.model, name)
        if model.vocab_size == "auto":
            model.vocab_size = tokenizer_size
        elif model.vocab_size != tokenizer_size:
            raise ConfigError(f"model.{name}.vocab_size={model.vocab_size} but the tokenizer at "
                              f"{tokenizer_name} has {tokenizer_size} pieces (leave it at auto to take the "
                              f"tokenizer's size)")
        if model.pad_token_id != pad_id:
            if model.pad_token_id != default_pad:
                raise ConfigError(f"model.{name}.pad_token_id={model.pad_token_id} but the tokenizer at "
                                  f"{tokenizer_name} pads with id {pad_id}")
            model.pad_token_id = pad_id
    if cfg.model.objective == "mlm" and cfg.model.discriminator.vocab_size == "auto":
        cfg.model.discriminator.vocab_size = tokenizer_size  # unused by MLM; keeps the saved config numeric


def finish_backend(backend: BackendConfig, launch: Launch) -> str:
    """`backend.name: auto` made concrete in place (ddp when a launcher started several ranks, else single),
    for pretraining's and fine-tuning's `backend` sections alike; returns the name."""
    if backend.name == "auto":
        backend.name = "ddp" if launch.world_size > 1 else "single"
    return backend.name


def device_type(setting: str) -> str:
    """What a device setting (`finetune.device`: auto, cpu or cuda) trains on: cuda or cpu."""
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        raise ConfigError("finetune.device=cuda: no CUDA device is visible to this process")
    return "cuda"


def resolve_precision(precision: str, device: str, bf16_allowed: bool = True, bf16_supported: bool | None = None
                      ) -> str:
    """What precision `auto` (fine-tuning's default) means on a `device` (`device_type`) of this machine; any
    other value stays as it is.

    bf16 autocast on a CUDA device that computes in bf16 natively (Ampere on: IEEE fp32 matmuls run at
    a fraction of its bf16 rate) and a backend that allows it (`bf16_allowed`); otherwise fp32, whose
    matmuls on CUDA run in TF32 (`megakd.engine.backends.cuda_tf32`). On the CPU `auto` is fp32, so CPU
    runs are what they were. `bf16_supported` None asks torch about the current CUDA device (every rank
    of a node has the same kind).
    """
    if precision != "auto":
        return precision
    if device != "cuda" or not bf16_allowed:
        return "fp32"
    if bf16_supported is None:
        bf16_supported = torch.cuda.is_bf16_supported(including_emulation=False)
    return "bf16" if bf16_supported else "fp32"
