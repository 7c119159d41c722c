"""The Triton head's two backwards, chunked (default) and atomic, and how one is chosen.

Both against the float64 reference (CE and KL, with and without bias, ignored rows, fp64/fp32/bf16
inputs), the chunked one bitwise reproducible and unchanged by its chunk size, the selection API's
errors and scoping, and the roofline that picks the default.
"""

from __future__ import annotations

import pytest
import torch
from megakd.kernels import (
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
    fused_linear_kl,
    fused_linear_kl_reference,
)
from megakd.kernels.dispatch import HEAD_BACKWARDS, chosen_head_backward, head_backward

from megakd.bench.kernel_parity import rel_norm

from .helpers import TRITON, value_and_grads

VARIANTS = ["chunked", "atomic"]
N, H, V = 37, 21, 83  # ragged against the interpreter's 16 x 32 x 16 tiles
# Norm-wise relative error of a gradient: fp64 inputs to rounding; fp32 to a few fp32 roundings; bf16 inputs
# to the one final rounding of the gradient to bf16 (the interpreter multiplies in fp32).
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2.0**-6}


def _inputs(seed: int, dtype: torch.dtype, width: int = H):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, width, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, width, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    bias = torch.randn(V, generator=g, dtype=torch.float64).to(dtype)
    return hidden, weight, bias


def _assert_close(out, ref, dtype):
    assert abs(float(out[0]) - float(ref[0])) <= 1e-5 * abs(float(ref[0])) + 1e-12
    for i, (g, r) in enumerate(zip(out[1], ref[1])):
        if r is None:
            assert g is None
            continue
        assert g.dtype == dtype, i
        assert rel_norm(g, r) < TOLERANCE[dtype], (i, rel_norm(g, r))


@pytest.mark.parametrize("backend", [TRITON])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_cross_entropy_backward_matches_float64(backend, variant, dtype, with_bias):
    hidden, weight, bias = _inputs(1, dtype)
    bias = bias if with_bias else None
    target = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(2))
    target[::3] = -100
    ref = value_and_grads(lambda a, b, c: fused_linear_cross_entropy_reference(a, b, c, target),
                          *(None if t is None else t.double() for t in (hidden, weight, bias)))
    with head_backward(variant):
        out = value_and_grads(lambda a, b, c: fused_linear_cross_entropy(a, b, c, target, backend=backend),
                              hidden, weight, bias)
    _assert_close(out, ref, dtype)


@pytest.mark.parametrize("backend", [TRITON])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_kl_backward_matches_float64(backend, variant, dtype, with_bias):
    hs, ws, bs = _inputs(3, dtype)
    bs = bs if with_bias else None
    th, tw, tb = _inputs(4, dtype, width=H + 3)
    ref = value_and_grads(lambda a, b, c: fused_linear_kl_reference(a, b, th.double(), tw.double(), 1.7, c,
                                                                    tb.double()),
                          *(None if t is None else t.double() for t in (hs, ws, bs)))
    with head_backward(variant):
        out = value_and_grads(lambda a, b, c: fused_linear_kl(a, b, th, tw, 1.7, c, tb, backend=backend), hs, ws, bs)
    _assert_close(out, ref, dtype)


@pytest.mark.parametrize("backend", [TRITON])
def test_chunked_backward_is_bitwise_reproducible_and_chunk_size_free(backend, monkeypatch):
    """Two runs give the same bits; chunks of 5 rows (8 chunks, the last ragged) give the one-chunk result
    to rounding, and the float64 reference's."""
    from megakd.kernels import linear_head_triton

    hidden, weight, bias = _inputs(5, torch.float32)
    target = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(6))
    target[1::4] = -100

    def run():
        with head_backward("chunked"):
            return value_and_grads(lambda a, b, c: fused_linear_cross_entropy(a, b, c, target, backend=backend),
                                   hidden, weight, bias)

    first, second = run(), run()
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(a, b) for a, b in zip(first[1], second[1]))
    monkeypatch.setattr(linear_head_triton, "_BACKWARD_CHUNK_ELEMS", 5 * V)
    chunked = run()
    ref = value_and_grads(lambda a, b, c: fused_linear_cross_entropy_reference(a, b, c, target),
                          hidden.double(), weight.double(), bias.double())
    _assert_close(chunked, ref, torch.float32)
    for a, b in zip(chunked[1], first[1]):
        assert rel_norm(a, b.double()) < 1e-6


@pytest.mark.parametrize("backend", [TRITON])
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_choice_is_read_when_the_forward_runs(backend, variant):
    """A loss made inside ``head_backward(name)`` backpropagates with that backward even outside it
    (autograd may run backward on another thread, where the context is not set)."""
    from megakd.kernels import linear_head_triton

    hidden, weight, _ = _inputs(7, torch.float64)
    target = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(8))
    launched = []
    for name in ("_backward_kernel", "_grad_logits_kernel"):
        kernel = getattr(linear_head_triton, name)
        original = kernel.run

        def spy(*args, _name=name, _original=original, **kwargs):
            launched.append(_name)
            return _original(*args, **kwargs)

        kernel.run = spy
    try:
        hidden.requires_grad_(True)
        with head_backward(variant):
            loss = fused_linear_cross_entropy(hidden, weight, None, target, backend=backend)
        loss.backward()
    finally:
        for name in ("_backward_kernel", "_grad_logits_kernel"):
            del getattr(linear_head_triton, name).run
    assert set(launched) == {"_backward_kernel" if variant == "atomic" else "_grad_logits_kernel"}


def test_selection_api():
    assert HEAD_BACKWARDS == ("auto", "chunked", "atomic")
    assert chosen_head_backward() == "chunked"
    with head_backward("atomic"):
        assert chosen_head_backward() == "atomic"
        with head_backward("auto"):
            assert chosen_head_backward() == "chunked"
        assert chosen_head_backward() == "atomic"
    assert chosen_head_backward() == "chunked"
    with pytest.raises(ValueError, match=r"^head_backward: expected one of .*'auto'.*, got 'fast'$"):
        with head_backward("fast"):
            pass


def test_config_key_takes_the_dispatch_names():
    from megakd.config import KernelsConfig
    from megakd.configio import ConfigError, check_literals

    assert KernelsConfig().head_backward == "auto"
    with pytest.raises(ConfigError, match="head_backward: expected one of auto, chunked, atomic, got 'fast'"):
        check_literals(KernelsConfig(head_backward="fast"))


def test_default_is_the_rooflines_choice_at_the_production_shape():
    """At electra-base's shape the model predicts the chunked backward faster on both GPUs even with the
    atomics at the L2's full bandwidth, and its read-modify-writes are the 46 GB docs/performance.md
    reports from the compile tool's tile count."""
    from megakd.kernels.dispatch import DEFAULT_HEAD_BACKWARD

    from megakd.bench.hardware import GPUS
    from megakd.bench.roofline import head_backward_roofline

    assert DEFAULT_HEAD_BACKWARD == "chunked"  # atomic only if the loop below found it faster on both GPUs
    for gpu in ("h100", "a100"):
        model = head_backward_roofline(GPUS[gpu])
        assert model["atomic"]["flops"] == model["chunked"]["flops"] == 3 * 2 * 2458 * 128_000 * 768
        assert 45e9 < model["atomic"]["atomic_bytes"] < 47e9
        best, worst = model["atomic"]["seconds"]
        assert model["chunked"]["seconds"][0] < best < worst
