"""The DeepSpeed config of each engine, derived from megakd's config: what the backend builds engines from
and what the planner (megakd/bench/planner.py) reads bucket sizes and the communication dtype from.

Pure config work (no torch, no DeepSpeed), so `megakd plan` loads no engine. A user's
`backend.deepspeed_config` file is merged in by the "auto" convention: a key megakd derives must be
"auto" or equal megakd's value (`DERIVED_FROM`); the sections megakd builds itself are refused
(`MEGAKD_OWNED`); everything else passes through, replacing megakd's default where it sets one.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

from megakd.config import BackendConfig, ConfigError

log = logging.getLogger(__name__)

# DeepSpeed keys megakd derives from its own config, with the keys they come from: a user value
# must be "auto" or equal megakd's. Other derived keys (steps_per_print, ...) are defaults the
# user may override.
DERIVED_FROM = {
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size / (train.micro_batch_size x world size)",
    "train_batch_size": "train.global_batch_size",
    "gradient_clipping": "optim.<model>.clip_norm (x electra.loss_weight for the discriminator)",
    "zero_optimization.stage": "backend.zero_stage",
    "bf16.enabled": "train.precision",
    "fp16.enabled": "train.precision",
    "communication_data_type": "backend.grad_comm_dtype",
}
# Sections megakd builds itself, one per model: two DeepSpeed optimizers or schedules would fight them.
MEGAKD_OWNED = {"optimizer": "optim.<model>.*", "scheduler": "optim.schedule.*"}


def read_user_config(path: str) -> dict:
    """The user's DeepSpeed JSON; a missing or malformed file is a one-line error naming it."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"backend.deepspeed_config: no file at {file}")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"backend.deepspeed_config: {file} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"backend.deepspeed_config: {file}: expected a JSON object at the top level")
    return data


def merge_user_config(derived: dict, user: dict, source: str, prefix: str = "") -> dict:
    """`derived` with the user's settings merged in by the "auto" convention (module docstring)."""
    out = copy.deepcopy(derived)
    for key, value in user.items():
        path = f"{prefix}{key}"
        if path in MEGAKD_OWNED:
            raise ConfigError(f"{source}: '{path}' is built by megakd from {MEGAKD_OWNED[path]}; remove it "
                              f"(ZeRO-Offload needs only zero_optimization.offload_optimizer)")
        if isinstance(value, dict):
            base = derived.get(key, {})
            out[key] = merge_user_config(base if isinstance(base, dict) else {}, value, source, f"{path}.")
        elif value == "auto":
            if key not in derived:
                raise ConfigError(f"{source}: '{path}' is \"auto\" but megakd derives no value for it")
        elif path in DERIVED_FROM and derived.get(key) != value:
            raise ConfigError(f"{source}: '{path}'={value!r} contradicts {DERIVED_FROM[path]} "
                              f"(megakd derives {derived.get(key)!r}; use \"auto\")")
        else:
            out[key] = value
    return out


class EngineConfigs:
    """DeepSpeed engine configs from the `backend` section, precision and micro-batch size, merged with
    backend.deepspeed_config (pretraining and fine-tuning build it from their own settings)."""

    def __init__(self, backend: BackendConfig, precision: str, micro_batch_size: int):
        self.backend, self.precision, self.micro_batch_size = backend, precision, micro_batch_size
        if backend.grad_comm_dtype not in ("auto", "fp32", precision):
            raise ConfigError(f"backend.grad_comm_dtype={backend.grad_comm_dtype}: expected auto, fp32 or the model's "
                              f"own 16-bit dtype, and this run trains in {precision}")
        self.user_config = read_user_config(backend.deepspeed_config) if backend.deepspeed_config else {}
        self.warned = False  # the low-precision accumulation warning, once per run, not per engine

    def for_engine(self, gradient_clipping: float, accumulation_steps: int, data_world_size: int,
                   parameters: int | None = None) -> dict:
        """The config of one engine: what megakd derives, merged with the user's file. `parameters`: the
        number of elements the engine's optimizer updates (None for the pipeline engine, at ZeRO-0)."""
        derived = self.derived(gradient_clipping, accumulation_steps, data_world_size, parameters)
        merged = merge_user_config(derived, self.user_config,
                                   f"backend.deepspeed_config={self.backend.deepspeed_config}")
        accum_dtype = merged.get("data_types", {}).get("grad_accum_dtype")
        precision = self.precision
        if self.backend.zero_stage == 0 and accum_dtype not in (None, precision):
            raise ConfigError(f"backend.deepspeed_config: data_types.grad_accum_dtype={accum_dtype!r} needs "
                              f"backend.zero_stage >= 1 (DeepSpeed 0.19 accumulates in the model's dtype without ZeRO)")
        if precision != "fp32" and accumulation_steps > 1 and accum_dtype != "fp32" and not self.warned:
            self.warned = True
            log.warning("DeepSpeed sums the %d micro-batches' gradients in %s (data_types.grad_accum_dtype=%s); "
                        "fp32 needs backend.zero_stage >= 1 without a user grad_accum_dtype",
                        accumulation_steps, precision, accum_dtype)
        return merged

    def derived(self, gradient_clipping: float, accumulation_steps: int, data_world_size: int,
                parameters: int | None = None) -> dict:
        """Batch layout, ZeRO stage, precision, gradient communication and explicit clipping, from megakd's config."""
        micro_batch_size, precision = self.micro_batch_size, self.precision
        config = {
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_accumulation_steps": accumulation_steps,
            "train_batch_size": micro_batch_size * accumulation_steps * data_world_size,
            "gradient_clipping": gradient_clipping,  # DeepSpeed: 0.0 = off (max_grad_norm's inf)
            "zero_optimization": {"stage": self.backend.zero_stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**31 - 1,  # the trainer logs; keep DeepSpeed's progress lines out
        }
        # Both precision sections are always present, so a user file that enables the other one
        # is caught as a contradiction of train.precision.
        config["bf16"] = {"enabled": precision == "bf16"}
        config["fp16"] = {"enabled": precision == "fp16"}
        if precision == "fp16":
            config["fp16"]["loss_scale"] = 0  # 0 = dynamic loss scaling
        if precision != "fp32" and self.backend.zero_stage > 0:
            # DeepSpeed sums the micro-batches' gradients in the model's dtype unless told otherwise
            # (grad_accum_dtype None): under bf16 each add keeps 8 significant bits. fp32 turns ZeRO-1 +
            # bf16 into DeepSpeed's BF16_Optimizer (fp32 gradient buffers) and gives ZeRO-2/3 fp32
            # partitions; ZeRO-0 (and so the pipeline engine) refuses any dtype but the model's.
            config["data_types"] = {"grad_accum_dtype": "fp32"}
        config["communication_data_type"] = self.communication_dtype()
        if self.backend.zero_stage == 2 and parameters:
            config["zero_optimization"].update(overlapped_reduction(parameters))
        return config

    def communication_dtype(self) -> str:
        """The dtype DeepSpeed sums gradients across ranks in, always explicit (so a user file's value is checked).

        DeepSpeed's default is the model's dtype: BF16_Optimizer (ZeRO-1 + bf16) casts its fp32 gradient
        buffers to bf16 for the all-reduce (`DeepSpeedEngine.allreduce_bucket`), ZeRO-2 all-reduces its bf16
        gradient buckets and ZeRO-3 reduce-scatters them, so every add across ranks rounds to 8 significant
        bits, after the micro-batches
        were summed in fp32. fp32 keeps the cross-rank sum as exact as the accumulation, at twice the bytes.
        Without ZeRO the gradients accumulate in the model's dtype anyway, and so are sent in it.
        """
        chosen = self.backend.grad_comm_dtype
        if chosen != "auto":
            return chosen
        return "fp32" if self.backend.zero_stage > 0 else self.precision


# Gradient buckets per backward pass under ZeRO-2's overlapped reduction (`overlapped_reduction`).
REDUCE_BUCKETS = 8


def overlapped_reduction(parameters: int) -> dict:
    """ZeRO-2 settings that reduce gradients in buckets while backward still runs, for an engine of `parameters`.

    DeepSpeed's defaults (overlap_comm off below ZeRO-3, a 5e8-element bucket) reduce a model of a few
    hundred million parameters in one bucket after its whole backward, on the compute stream, and allocate
    that bucket in full (1 GB in bf16 per engine). With `overlap_comm`, a bucket's reduction runs on
    DeepSpeed's reduction stream as soon as the bucket fills, while backward computes the next one; only the
    last one is exposed. REDUCE_BUCKETS = 8 leaves 1/8 of the bytes exposed while keeping the collectives
    few and large (23M elements each for a 184M-parameter model, where bandwidth, not latency, dominates;
    each costs a device synchronize in DeepSpeed's `allreduce_and_copy`), and the two contiguous staging
    buffers overlap needs cost 2 x parameters / 8 elements instead of 5e8. `allgather_bucket_size` is left
    alone: DeepSpeed uses it only where torch lacks `all_gather_into_tensor` (`all_gather_dp_groups`).
    """
    return {"overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": -(-parameters // REDUCE_BUCKETS)}
