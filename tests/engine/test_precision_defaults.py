"""What `precision: auto` and the TF32 switch mean per device: bf16 / TF32 on CUDA, the CPU untouched.

No CUDA here: the resolution is a function of the device, and the CUDA settings are process flags
that a CPU-only torch reads and writes like any other (tests/engine/test_device_placement.py shows
a backend on the simulated GPU setting them and putting them back).
"""

from __future__ import annotations

import pytest
import torch

from megakd.config import ConfigError, load_config
from megakd.configio import config_to_dict
from megakd.engine.backends import cuda_tf32
from megakd.finetune import runtime
from megakd.finetune.config import FinetuneConfig
from megakd.finish import resolve_precision
from megakd.launch import Launch
from tests.finetune.test_distributed import REPO

CPU, CUDA = "cpu", "cuda"


def _tf32_switches() -> tuple:
    """Every reading of the switches `cuda_tf32` sets, and what torch derives from them."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    return (matmul.allow_tf32, matmul.fp32_precision, torch.get_float32_matmul_precision(), cudnn.allow_tf32,
            cudnn.conv.fp32_precision, torch.backends.fp32_precision)


@pytest.mark.parametrize("precision, device, bf16_allowed, bf16_supported, expected", [
    ("auto", CPU, True, None, "fp32"),  # the CPU never asks CUDA: runs there are what they were
    ("auto", CUDA, True, True, "bf16"),  # Ampere and later
    ("auto", CUDA, True, False, "fp32"),  # no native bf16 (V100): fp32, TF32 where the GPU has it
    ("auto", CUDA, False, True, "fp32"),  # fine-tuning on DeepSpeed, which refuses bf16
    ("fp32", CUDA, True, True, "fp32"),  # an explicit value is never changed
    ("bf16", CPU, True, None, "bf16"),
])
def test_auto_precision_per_device(precision, device, bf16_allowed, bf16_supported, expected):
    assert resolve_precision(precision, device, bf16_allowed, bf16_supported) == expected


def _finetune_config(*extra: str) -> FinetuneConfig:
    return load_config(REPO / "configs" / "finetune-rt.yaml", ["model.path=", "model.init=random",
                                                               "model.tokenizer=unused", *extra], cls=FinetuneConfig)


def test_finetune_defaults_to_auto_and_records_fp32_on_the_cpu():
    cfg = _finetune_config()
    assert (cfg.finetune.precision, cfg.finetune.tf32) == ("auto", True)
    assert cfg.finish(Launch()) is cfg and cfg.finetune.precision == "fp32"  # finished before anything is built
    finished = config_to_dict(cfg)
    before = _tf32_switches()
    backend = runtime.build_backend(cfg, Launch())
    try:
        assert (backend.precision, backend.device, backend.tf32) == ("fp32", torch.device(CPU), True)
        assert config_to_dict(cfg) == finished  # building reads the finished config, never writes it
        backend.use_device_settings()  # what `prepare` does: nothing on the CPU
        assert _tf32_switches() == before
    finally:
        backend.close()
    # DeepSpeed fine-tuning refuses bf16 only when it is asked for; auto is fp32 there
    assert _finetune_config("backend.name=deepspeed").finetune.precision == "auto"
    with pytest.raises(ConfigError, match="finetune.precision=bf16 with backend.name=deepspeed"):
        _finetune_config("backend.name=deepspeed", "finetune.precision=bf16")


@pytest.mark.parametrize("key", ["finetune.tf32", "finetune.precision"])
def test_bad_values_are_one_line_errors(key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as error:
        _finetune_config(f"{key}=maybe")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("enabled", [True, False])
def test_tf32_switches_are_put_back_exactly(enabled):
    before = _tf32_switches()
    put_back = cuda_tf32(enabled)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (enabled, enabled)
    assert torch.get_float32_matmul_precision() == ("high" if enabled else "highest")
    put_back()
    assert _tf32_switches() == before  # fp32_precision back to "none", not the "ieee" allow_tf32=False leaves

