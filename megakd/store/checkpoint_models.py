"""Read trained models out of megakd checkpoints, whichever backend wrote them.

A checkpoint `step_NNNNNNNN/` holds `config.yaml`, `tokenizer/`, `manifest.json` and one state per
optimizer unit: `<unit>.safetensors` (single/ddp backends and pipeline runs: the model weights; the
optimizer state is beside it in `<unit>.optim.pt`) or `<unit>/` (the DeepSpeed backend:
`engine.save_checkpoint(step_dir / unit, tag="ds")` around a loss module whose
`model` attribute is the unit's model, so consolidated keys start with "model."). A unit holds
one model under that model's name ("generator", "discriminator"), or both as one ElectraPair with
shared embeddings ("electra", original ELECTRA). Which units a run trains is its training
layout's business (megakd/engine/layouts.py); reading needs only these stored forms.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from megakd.config import Config, ConfigError, load_config
from megakd.models.electra import Discriminator, ElectraPair, MaskedLM
from megakd.models.encoder import EncoderConfig
from megakd.store.checkpoint import DEEPSPEED_TAG, MANIFEST, list_checkpoints, newest_intact, verify
from megakd.store.files import (
    StoreError,
    deepspeed_safe_loading,
    first_line,
    load_state,
    load_weights,
    weight_shapes,
)

log = logging.getLogger(__name__)

DEEPSPEED_PREFIX = "model."
WEIGHTS_SUFFIX = ".safetensors"  # `<unit>.safetensors`: a unit's model weights (single/ddp/pipeline)
OPTIM_SUFFIX = ".optim.pt"  # `<unit>.optim.pt`: its optimizer, schedule and scaler state (weights-only)
JOINT_UNIT = "electra"  # the unit holding generator and discriminator as one ElectraPair (shared embeddings)


@dataclass
class CheckpointModels:
    """The trained models of one checkpoint, in eval mode, with the tokenizer they were trained with."""

    path: Path
    cfg: Config
    generator: MaskedLM
    discriminator: Discriminator | None
    tokenizer_dir: Path | None


def resolve_checkpoint(src: str | Path) -> Path:
    """A run directory means its newest checkpoint; a checkpoint directory means itself."""
    src = Path(src)
    if not src.is_dir():
        raise StoreError(f"{src}: no such directory (expected a megakd run or checkpoint directory)")
    if (src / "checkpoints").is_dir():
        found = newest_intact(src)
        if found is None:
            what = "no intact" if list_checkpoints(src) else "no complete"
            raise StoreError(f"{src}/checkpoints: {what} checkpoint (expected step_NNNNNNNN/ with {MANIFEST})")
        return found
    if not (src / "config.yaml").is_file():
        raise StoreError(f"{src}: not a megakd run directory (no checkpoints/) or checkpoint directory "
                         "(no config.yaml)")
    verify(src)
    return src


def _read_deepspeed_unit(directory: Path) -> dict[str, Tensor]:
    """fp32 weights of a DeepSpeed checkpoint directory (ZeRO 0-3), consolidated on CPU."""
    tag_dir = directory / DEEPSPEED_TAG
    if not tag_dir.is_dir():
        raise StoreError(f"{directory}: no DeepSpeed tag directory '{DEEPSPEED_TAG}/'")
    # Without ZeRO the model-states file holds the whole weights; with ZeRO 1-3 the fp32 master
    # weights live in the optimizer shards and must be consolidated (also under bf16/fp16).
    plain = tag_dir / "mp_rank_00_model_states.pt"
    with deepspeed_safe_loading(tag_dir):
        state = load_state(plain) if plain.is_file() else {}
    bf16_shards = sorted(tag_dir.glob("bf16_zero_pp_rank_*_optim_states.pt"))
    if state and not (state.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0):
        sd = dict(state["module"])
    elif state and bf16_shards:
        sd = _consolidate_bf16_optimizer(state, bf16_shards, tag_dir)
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        chatter = io.StringIO()  # zero_to_fp32 prints its progress; keep it at debug level
        try:
            with contextlib.redirect_stdout(chatter), deepspeed_safe_loading(tag_dir):
                sd = dict(get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=DEEPSPEED_TAG))
        except Exception as err:
            message = first_line(err)
            raise StoreError(f"{directory}: cannot consolidate the DeepSpeed ZeRO checkpoint ({message})") from None
        finally:
            log.debug("zero_to_fp32: %s", chatter.getvalue())
    if not all(k.startswith(DEEPSPEED_PREFIX) for k in sd):
        raise StoreError(f"{directory}: expected DeepSpeed module keys prefixed {DEEPSPEED_PREFIX!r} "
                              f"(the task's model), got e.g. {next(iter(sd), None)!r}")
    return {k[len(DEEPSPEED_PREFIX):]: v.float() for k, v in sd.items()}


def _consolidate_bf16_optimizer(state: dict, shards: list[Path], tag_dir: Path) -> dict[str, Tensor]:
    """fp32 master weights from DeepSpeed's BF16_Optimizer shards (ZeRO-1 + bf16 + fp32 accumulation).

    Its state has no `zero_stage`, so zero_to_fp32 refuses it. Each rank's file holds one flat fp32
    partition per parameter group and where each parameter's fragment sits in it; the fragments of
    a parameter, in rank order, are the parameter.
    """
    import torch

    shards = sorted(shards, key=lambda f: int(f.name.split("_")[4]))  # bf16_zero_pp_rank_<r>_...
    with deepspeed_safe_loading(tag_dir):
        parts = [load_state(f)["optimizer_state_dict"] for f in shards]
    if len(parts) != parts[0]["partition_count"][0]:
        raise StoreError(f"{tag_dir}: {len(parts)} BF16 optimizer shards, expected {parts[0]['partition_count'][0]}")
    sd: dict[str, Tensor] = {}
    for group, shapes in enumerate(state["param_shapes"]):
        for name, shape in shapes.items():
            fragments = []
            for part in parts:
                address = part["param_slice_mappings"][group].get(name)
                if address is not None:
                    flat = part["single_partition_of_fp32_groups"][group].detach()
                    fragments.append(flat.narrow(0, address.start, address.numel))
            sd[name] = torch.cat(fragments).view(shape)
    sd.update(state.get("frozen_param_fragments") or {})
    for alias, source in (state.get("shared_params") or {}).items():
        sd[alias] = sd[source]
    return sd


def has_unit_state(step_dir: Path, unit: str) -> bool:
    return (step_dir / f"{unit}{WEIGHTS_SUFFIX}").is_file() or (step_dir / unit).is_dir()


def read_unit_state(step_dir: Path, unit: str) -> dict[str, Tensor]:
    """The model state dict of one unit: `<unit>.safetensors` or a DeepSpeed directory `<unit>/`."""
    path, directory = step_dir / f"{unit}{WEIGHTS_SUFFIX}", step_dir / unit
    if path.is_file():
        return load_weights(path)
    if directory.is_dir():
        return _read_deepspeed_unit(directory)
    raise StoreError(f"{step_dir}: no state for unit '{unit}' (expected {unit}{WEIGHTS_SUFFIX} or a DeepSpeed "
                     f"directory {unit}/)")


def load_state_checked(model: nn.Module, sd: Mapping[str, Tensor], source: str, config_key: str) -> None:
    """`load_state_dict(strict=True)` with one-line errors naming the key, its shape and the config.

    Keys the model lists twice (tied MLM output matrix, embeddings shared in an ElectraPair) may
    appear once in `sd`: the tie is restored from whichever alias is present.
    """
    sd = dict(sd)
    expected = model.state_dict()
    by_storage: dict[int, list[str]] = {}
    for key, tensor in expected.items():
        by_storage.setdefault(tensor.data_ptr(), []).append(key)
    for aliases in by_storage.values():
        present = [k for k in aliases if k in sd]
        for key in aliases:
            if key not in sd and present:
                sd[key] = sd[present[0]]
    for key, tensor in expected.items():
        if key not in sd:
            raise StoreError(f"{source}: no weights for {key!r} (expected by {config_key})")
        if tuple(sd[key].shape) != tuple(tensor.shape):
            raise StoreError(f"{source}: {key!r} has shape {list(sd[key].shape)} but {config_key} "
                                  f"expects {list(tensor.shape)}")
    extra = sorted(set(sd) - set(expected))
    if extra:
        raise StoreError(f"{source}: unexpected weights {extra[0]!r} ({len(extra)} in all) for the model "
                              f"{config_key} describes")
    model.load_state_dict(sd, strict=True)


def check_weight_shapes(build: Callable[..., nn.Module], encoders: list[EncoderConfig], weights: Path,
                        config_key: str) -> None:
    """Refuse a weights file whose header disagrees with the model `build(*encoders)` makes, before it is made.

    First by size, building nothing deep: the model's parameter count for the configs' depths is
    extrapolated from one- and two-layer copies built on the meta device, and a file holding far
    fewer numbers is refused (a config.json saying 10**6 layers would otherwise take minutes and
    gigabytes to build even there). Then the model itself is built on the meta device (no memory)
    and every shape compared. Tied parameters (one object under several keys) need only one of their
    keys in the file, as in `load_state_checked`.
    """
    stored = check_weight_count(build, encoders, weights, config_key)
    with torch.device("meta"):
        expected = build(*encoders).state_dict(keep_vars=True)
    tied: dict[int, list[str]] = {}
    for key, tensor in expected.items():
        tied.setdefault(id(tensor), []).append(key)
    for keys in tied.values():
        present = [k for k in keys if k in stored]
        if not present:
            raise StoreError(f"{weights}: no weights for {keys[0]!r} (expected by {config_key})")
        for key in present:
            if stored[key] != tuple(expected[key].shape):
                raise StoreError(f"{weights}: {key!r} has shape {list(stored[key])} but {config_key} "
                                 f"expects {list(expected[key].shape)}")


def check_weight_count(build: Callable[..., nn.Module], encoders: list[EncoderConfig], weights: Path,
                       config_key: str) -> dict[str, tuple[int, ...]]:
    """Refuse a safetensors file holding far fewer numbers than `build(*encoders)` has parameters,
    building nothing deeper than two layers (see `check_weight_shapes`); the file's shapes by key."""
    stored = weight_shapes(weights)
    implied = _implied_parameters(build, encoders)
    held = sum(math.prod(shape) for shape in stored.values())
    if implied > 2 * held + (1 << 20):
        raise StoreError(f"{weights}: holds {held:,} numbers but {config_key} describes a model of {implied:,} "
                         f"parameters ({', '.join(f'{e.num_layers} layers x {e.hidden_size}' for e in encoders)})")
    return stored


def _implied_parameters(build: Callable[..., nn.Module], encoders: list[EncoderConfig]) -> int:
    """The parameter count of `build(*encoders)`, from one- and two-layer copies on the meta device:
    a model's parameters grow linearly in each encoder's depth."""
    def count(*layers: int) -> int:
        with torch.device("meta"):
            model = build(*(dataclasses.replace(e, num_layers=n) for e, n in zip(encoders, layers)))
        return sum(p.numel() for p in model.parameters())

    shallow = [1] * len(encoders)
    base = count(*shallow)
    return base + sum((e.num_layers - 1) * (count(*shallow[:i], 2, *shallow[i + 1:]) - base)
                      for i, e in enumerate(encoders))


def load_checkpoint(step_dir: str | Path) -> CheckpointModels:
    """Rebuild the models described by `config.yaml` and load the unit weights into them."""
    step_dir = Path(step_dir)
    config_file = step_dir / "config.yaml"
    if not config_file.is_file():
        raise StoreError(f"{config_file}: missing (not a megakd checkpoint directory)")
    try:
        cfg = load_config(config_file)
    except ConfigError as err:
        raise StoreError(str(err)) from None
    builders: dict[str, tuple[Callable[[EncoderConfig], nn.Module], EncoderConfig]] = {
        "generator": (MaskedLM, cfg.model.generator)}
    if "discriminator" in cfg.model.built_models():
        builders["discriminator"] = (Discriminator, cfg.model.discriminator)
    if len(builders) == 2 and has_unit_state(step_dir, JOINT_UNIT):
        units = {JOINT_UNIT: (lambda g, d: ElectraPair(MaskedLM(g), Discriminator(d), share_embeddings=True),
                              [cfg.model.generator, cfg.model.discriminator],
                              f"{config_file} (model.generator / model.discriminator)")}
    else:
        units = {name: (build, [encoder], f"{config_file} (model.{name})")
                 for name, (build, encoder) in builders.items()}
    for unit, (build, encoders, config_key) in units.items():
        if (weights := step_dir / f"{unit}{WEIGHTS_SUFFIX}").is_file():
            check_weight_shapes(build, encoders, weights, config_key)
    models = {name: build(encoder) for name, (build, encoder) in builders.items()}
    if JOINT_UNIT in units:
        pair = ElectraPair(models["generator"], models["discriminator"], share_embeddings=True)
        _load_unit(step_dir, JOINT_UNIT, pair, units[JOINT_UNIT][1])
    else:
        for name, model in models.items():
            _load_unit(step_dir, name, model, units[name][1])
    generator, discriminator = models["generator"], models.get("discriminator")
    tokenizer_dir = step_dir / "tokenizer"
    for model in (generator, discriminator):
        if model is not None:
            model.eval()
    return CheckpointModels(step_dir, cfg, generator, discriminator,
                            tokenizer_dir if tokenizer_dir.is_dir() else None)


def _load_unit(step_dir: Path, unit: str, model: nn.Module, config_key: str) -> None:
    sd = read_unit_state(step_dir, unit)
    weights = step_dir / f"{unit}{WEIGHTS_SUFFIX}"
    load_state_checked(model, sd, str(weights) if weights.is_file() else f"{step_dir / unit}/", config_key)
