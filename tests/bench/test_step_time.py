"""The computed GPU step (megakd/bench/step_time.py) against counts written out by hand."""

from __future__ import annotations

import pytest

from megakd.bench.hardware import GPUS, Hardware
from megakd.bench.roofline import head_backward_roofline
from megakd.bench.step_time import Assumptions, micro_batch_parts, predict_step
from megakd.config import load_config
from megakd.finish import finish_config

# A machine of round numbers at full efficiency: 1 TFLOP/s in every class, 1 GB/s.
ROUND = Hardware("round", {"fp32": 1.0, "bf16": 1.0}, 1.0, 1.0, hbm_gbps=1.0)
FAST = Hardware("fast memory", {"fp32": 1.0, "bf16": 1.0}, 1.0, 1.0, hbm_gbps=1e9)  # attention compute-bound
FULL = Assumptions(gemm_efficiency=1.0, attention_efficiency={}, bandwidth_efficiency=1.0,
                   default_attention_efficiency=1.0)


def _base(*overrides: str):
    return finish_config(load_config("configs/electra-base.yaml", list(overrides)))


@pytest.fixture(scope="module")
def base():
    return _base()


def test_the_encoder_parts_are_the_hand_counted_work():
    """electra-base on a flash-class SDPA path (absolute positions), one sequence of 512, bf16: every number
    below is counted by hand from the shapes."""
    base = _base("model.generator.position_encoding=absolute", "model.discriminator.position_encoding=absolute")
    parts = micro_batch_parts(base, ROUND, 1, "bf16", FULL)
    tokens, layers, models = 512, 12, 2
    projections = 8 * 768 * 768 + 4 * 768 * 3072  # Q, K, V, output; FFN in and out: 14,155,776 per token
    assert parts["encoder matmuls"] == pytest.approx(3 * projections * tokens * layers * models / 1e12)
    scores = 4 * 512 * 768  # QKᵀ and PV per token
    qkvo = 4 * tokens * 768 * 2 * layers * models  # q, k, v read and the output written, bf16
    assert parts["attention"] == pytest.approx(max(3.5 * scores * tokens * layers * models / 1e12, qkvo / 1e9))
    assert parts["elementwise"] == pytest.approx((90 * 2 + 4) * tokens * 768 * layers * models / 1e9)
    assert parts["vocabulary backward"] == head_backward_roofline(ROUND, 77, 768, 128_000)["chunked"]["seconds"][1]


def test_relative_positions_on_sdpa_pay_for_the_bias(base):
    """T5 relative positions through SDPA's float mask move the [heads, L, L] bias (5 passes per layer)."""
    sdpa = _base(*(f"model.{m}.attention_kernel=sdpa" for m in ("generator", "discriminator")))
    parts = micro_batch_parts(sdpa, ROUND, 2, "bf16", FULL)
    assert parts["relative bias"] == pytest.approx(5 * 2 * 12 * 512**2 * 2 * 12 * 2 / 1e9)
    absolute = _base("model.generator.position_encoding=absolute", "model.discriminator.position_encoding=absolute")
    assert "relative bias" not in micro_batch_parts(absolute, ROUND, 2, "bf16", FULL)
    # on CUDA electra-base's relative positions run megakd's Triton kernel (attention dropout on): no bias
    # moved, 7 backward matmuls instead of flash's 5 (its dK/dV and dQ kernels both recompute QKᵀ, dO·Vᵀ)
    triton, sdpa_fast = micro_batch_parts(base, FAST, 2, "bf16", FULL), micro_batch_parts(sdpa, FAST, 2, "bf16", FULL)
    assert "relative bias" not in triton
    assert triton["attention"] == pytest.approx(sdpa_fast["attention"] * 4.5 / 3.5)
    # without attention dropout a CUDA step runs flex_attention, which adds the bias inside its kernel
    flex = _base(*(f"model.{m}.attention_dropout=0" for m in ("generator", "discriminator")))
    assert "relative bias" not in micro_batch_parts(flex, ROUND, 2, "bf16", FULL)


def test_checkpointing_adds_one_forward_of_the_encoder(base):
    plain = micro_batch_parts(base, ROUND, 1, "bf16", FULL)
    ckpt = _base(*(f"model.{m}.activation_checkpointing=true" for m in ("generator", "discriminator")))
    again = micro_batch_parts(ckpt, ROUND, 1, "bf16", FULL)
    assert again["encoder matmuls"] == pytest.approx(plain["encoder matmuls"] * 4 / 3)
    ratio = micro_batch_parts(ckpt, FAST, 1, "bf16", FULL)["attention"] / micro_batch_parts(
        base, FAST, 1, "bf16", FULL)["attention"]
    assert ratio == pytest.approx(5.5 / 4.5)  # the Triton kernel's 4.5 forwards' worth, plus the recomputed one


def test_a_step_is_its_micro_batches_the_optimizer_and_exposed_communication(base):
    hw = GPUS["h100"]
    micro = micro_batch_parts(base, hw, 8, "bf16")
    step = predict_step(base, hw, 8, 4, params_local=1e8, comm_s=0.02, overlap=0.25)
    assert step.step_s == pytest.approx(4 * sum(micro.values()) + 1e8 * 30 / (3350e9 * 0.8) + 0.75 * 0.02)
    assert step.mfu == pytest.approx(step.model_flops / (step.step_s * 989e12))
    assert 0 < step.mfu < 1


def test_fp32_training_is_timed_at_tf32_unless_it_is_off():
    fp32 = _base("train.precision=fp32")
    assert predict_step(fp32, GPUS["a100"], 8, 1, 1e8).matmul == "tf32"
    ieee = predict_step(fp32, GPUS["a100"], 8, 1, 1e8, tf32=False)
    assert ieee.matmul == "fp32" and ieee.peak_tflops == 19.5
    assert predict_step(fp32, GPUS["v100"], 8, 1, 1e8).matmul == "fp32"  # no TF32 cores
