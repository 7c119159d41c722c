"""Every kernel takes every dtype a GPU run feeds it, and is checked against float64 on the same rounded inputs.

A GPU run feeds the kernels fp32 (the default), bf16 or fp16 everywhere (DeepSpeed casts the weights),
or bf16 activations with fp32 weights (autocast). Inputs are drawn in float64, rounded to the run's
dtypes, and the reference sees exactly those rounded values in float64, so the only errors left are
the kernel's own: its arithmetic, its matmul dtype and the rounding of each gradient to its input's
dtype. The loss must come back in fp32 whatever went in.

Under the interpreter the Triton kernels compute their matmuls in fp32 (it cannot do 16-bit
arithmetic; docs/decisions.md "Kernel dtypes"), so their only 16-bit error is the gradients'
final rounding: loss to fp32 precision, gradients to one 16-bit rounding. The torch path multiplies
in the activations' dtype (as autocast would), so its logits carry one 16-bit rounding too.
Tolerances below are a few times those roundings: a wrong scale, a lost temperature or bits read as
the wrong type are off by orders of magnitude more.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from megakd.kernels import (
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
    fused_linear_kl,
    fused_linear_kl_reference,
    fused_linear_sample,
    fused_rtd_loss,
    fused_rtd_loss_reference,
    lipschitz_1norm,
    lipschitz_1norm_reference,
)
from scipy.stats import chi2

from megakd.bench.kernel_parity import DTYPES, rel_norm

from .helpers import BACKENDS, TRITON, value_and_grads

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# DTYPES (megakd.bench.kernel_parity): name -> (activation, weight) dtypes, what fp32, DeepSpeed bf16/fp16 and
# autocast bf16 runs feed a head; the GPU check runs the same ones at a GPU's tolerances, these are the interpreter's.
EPS = {F32: 2.0**-24, BF16: 2.0**-8, F16: 2.0**-11}  # unit roundoff


def _tolerances(backend: str, act: torch.dtype, weight: torch.dtype, terms: int = 0) -> tuple[float, float]:
    """(loss relative error, gradient norm-wise relative error) allowed for this backend and combo. `terms`:
    the longest fp32 sum behind a gradient (the vocabulary, for the hidden state's), whose round-off grows
    as sqrt(terms) and depends on the CPU's summation order (one AMD machine: 5.6e-6 at 128,000 terms)."""
    # each gradient is rounded once to its input's dtype, after an fp32 sum of `terms` products
    grad = 8 * max(EPS[act], EPS[weight]) + 1e-6 + 2 * math.sqrt(terms) * EPS[F32]
    if backend == "torch" and act != F32:
        return 30 * EPS[act], 30 * EPS[act]  # logits (and products) rounded to the activation dtype
    return 1e-5, grad


def _rounded(g: torch.Generator, *shape, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _check(out, ref, inputs, backend, act, weight, terms=0):
    loss_tol, grad_tol = _tolerances(backend, act, weight, terms)
    assert out[0].dtype == (torch.float32), f"loss dtype {out[0].dtype}"
    assert math.isfinite(float(out[0]))
    err = abs(float(out[0]) - float(ref[0])) / max(abs(float(ref[0])), 1e-30)
    assert err < loss_tol, f"loss {float(out[0])!r} vs float64 {float(ref[0])!r}: rel {err:.2e} > {loss_tol:.0e}"
    for i, (g, r, x) in enumerate(zip(out[1], ref[1], inputs)):
        if r is None:
            continue
        assert g.dtype == x.dtype, f"grad {i}: dtype {g.dtype}, input {x.dtype}"
        e = rel_norm(g, r)
        assert e < grad_tol, f"grad {i}: rel {e:.2e} > {grad_tol:.0e}"


def _shipped_tiles() -> list[tuple[tuple[str, int], ...]]:
    """Every distinct tiling the head's launch tables ship to a GPU (num_warps and stages are not the interpreter's)."""
    from megakd.kernels.linear_head_triton import HEAD_CONFIGS

    return sorted({config.blocks for config in HEAD_CONFIGS.values()})


def _tiles_id(blocks: tuple[tuple[str, int], ...]) -> str:
    return "gpu-" + "x".join(str(size) for _, size in blocks)


@pytest.fixture(params=["interpreter-blocks", *_shipped_tiles()],
                ids=lambda p: p if isinstance(p, str) else _tiles_id(p))
def blocks(request, monkeypatch):
    """The head kernels at the interpreter's small tiles and at each tiling a GPU compiles (HEAD_CONFIGS)."""
    if request.param != "interpreter-blocks":
        from megakd.kernels import linear_head_triton
        from megakd.kernels.launch import LaunchConfig

        monkeypatch.setattr(linear_head_triton, "INTERPRETER_CONFIG", LaunchConfig(request.param))
        return _tiles_id(request.param)
    return request.param


# (N, H, V): ragged against every tiling (16/32/16 and those HEAD_CONFIGS ships), and a single row.
HEAD_SHAPES = [(1, 5, 7), (130, 70, 300)]


def _skip_unless_tiled(backend: str, blocks: str, kernels: tuple[str, ...], n: int = 0) -> None:
    """Beyond the interpreter's tiles: the Triton path at the tilings HEAD_CONFIGS ships for ``kernels``, at the
    ragged shape (its single row fits any tile)."""
    from megakd.kernels.linear_head_triton import HEAD_CONFIGS

    shipped = {_tiles_id(config.blocks) for (kernel, _, _), config in HEAD_CONFIGS.items() if kernel in kernels}
    if blocks != "interpreter-blocks" and (backend == "torch" or n == 1 or blocks not in shipped):
        pytest.skip(f"{blocks} is not a tiling the Triton {'/'.join(kernels)} kernels ship at this shape")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("combo", DTYPES)
@pytest.mark.parametrize("n,h,v", HEAD_SHAPES)
def test_cross_entropy_every_dtype(backend, combo, n, h, v, blocks):
    _skip_unless_tiled(backend, blocks, ("forward", "grad_logits", "backward"), n)
    act, wdt = DTYPES[combo]
    g = torch.Generator().manual_seed(n + h + v)
    hidden, weight, bias = _rounded(g, n, h, dtype=act), _rounded(g, v, h, dtype=wdt, scale=0.2), _rounded(
        g, v, dtype=wdt, scale=0.1)
    target = torch.randint(0, v, (n,), generator=g)
    target[1::3] = -100
    ref = value_and_grads(lambda a, b, c: fused_linear_cross_entropy_reference(a, b, c, target),
                          hidden.double(), weight.double(), bias.double())
    out = value_and_grads(lambda a, b, c: fused_linear_cross_entropy(a, b, c, target, backend=backend),
                          hidden, weight, bias)
    _check(out, ref, (hidden, weight, bias), backend, act, wdt)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("combo", DTYPES)
@pytest.mark.parametrize("n,h,v", HEAD_SHAPES)
def test_kl_every_dtype(backend, combo, n, h, v, blocks):
    """The student in the run's dtypes; the frozen teacher in fp32 (its own autocast) or the same dtypes."""
    _skip_unless_tiled(backend, blocks, ("forward_kl", "grad_logits_kl", "backward_kl"), n)
    act, wdt = DTYPES[combo]
    g = torch.Generator().manual_seed(n * h + v)
    hs, ws, bs = _rounded(g, n, h, dtype=act), _rounded(g, v, h, dtype=wdt, scale=0.3), _rounded(g, v, dtype=wdt)
    th, tw = _rounded(g, n, h + 3, dtype=act), _rounded(g, v, h + 3, dtype=wdt, scale=0.3)
    ref = value_and_grads(lambda a, b, c: fused_linear_kl_reference(a, b, th.double(), tw.double(), 2.0, c),
                          hs.double(), ws.double(), bs.double())
    out = value_and_grads(lambda a, b, c: fused_linear_kl(a, b, th, tw, 2.0, c, backend=backend), hs, ws, bs)
    _check(out, ref, (hs, ws, bs), backend, act, wdt)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("combo", DTYPES)
@pytest.mark.parametrize("n,h", [(1, 3), (70, 40), (37, 768)])  # 768: electra-base's width, 8-row tiles
def test_rtd_every_dtype(backend, combo, n, h):
    act, wdt = DTYPES[combo]
    g = torch.Generator().manual_seed(n + h)
    hidden, weight, bias = _rounded(g, n, h, dtype=act, scale=0.5), _rounded(g, h, dtype=wdt, scale=0.1), _rounded(
        g, (), dtype=wdt)
    original = torch.randint(0, 50, (n,), generator=g)
    corrupted = torch.where(torch.rand(n, generator=g) < 0.3, original + 1, original)
    mask = torch.rand(n, generator=g) < 0.8
    mask[0] = True
    ref = value_and_grads(lambda a, b, c: fused_rtd_loss_reference(a, b, c, corrupted, original, mask),
                          hidden.double(), weight.double(), bias.double())
    out = value_and_grads(lambda a, b, c: fused_rtd_loss(a, b, c, corrupted, original, mask, backend=backend),
                          hidden, weight, bias)
    # The RTD head is elementwise + a dot over H in fp32 in both paths: no 16-bit logits on either.
    _check(out, ref, (hidden, weight, bias), "triton", act, wdt)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [F32, BF16, F16, "mixed"])
def test_lipschitz_every_dtype(backend, dtype):
    """Sums in fp32 and an exact subgradient: sign(W) in the maximizing column, in W's dtype."""
    g = torch.Generator().manual_seed(4)
    dtypes = [F32, BF16, F16, BF16] if dtype == "mixed" else [dtype] * 4
    ws = [_rounded(g, *s, dtype=d) for s, d in zip([(7, 11), (64, 33), (33, 65), (1, 1)], dtypes)]
    ws[1] = ws[1].t().contiguous().t()  # column-major: strides matter
    out = value_and_grads(lambda *w: lipschitz_1norm(list(w), backend=backend), *ws)
    ref = lipschitz_1norm_reference([w.double() for w in ws])
    assert out[0].dtype == torch.float32
    assert abs(float(out[0]) - float(ref)) / float(ref) < 1e-6
    for w, gr in zip(ws, out[1]):
        assert gr.dtype == w.dtype
        cols = gr.abs().sum(0).nonzero().flatten()
        expected_col = w.double().abs().sum(0).argmax()
        assert cols.tolist() == [int(expected_col)]
        assert torch.equal(gr[:, cols[0]], torch.sign(w[:, cols[0]]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("combo", ["bf16", "fp16", "bf16-w32"])
def test_sampling_distribution_every_dtype(backend, combo, blocks):
    """Chi-square of many draws from one row against softmax(z / tau) of the rounded inputs in float64, at the
    interpreter's tiles and at those the sampler ships."""
    _skip_unless_tiled(backend, blocks, ("sample",))
    if blocks != "interpreter-blocks" and combo != "bf16":
        pytest.skip("the sampler's own tiling: one dtype (the interpreter's tiles run them all)")
    act, wdt = DTYPES[combo]
    g = torch.Generator().manual_seed(9)
    v, h, tau, rows = 37, 6, 0.7, 4000
    weight, bias = _rounded(g, v, h, dtype=wdt, scale=0.4), _rounded(g, v, dtype=wdt, scale=0.3)
    one = _rounded(g, 1, h, dtype=act)
    samples, argmax = fused_linear_sample(one.expand(rows, h).contiguous(), weight, bias,
                                          torch.Generator().manual_seed(1), tau, backend=backend)
    logits = (one.double() @ weight.double().T + bias.double())[0]
    assert int(argmax[0]) == int(logits.argmax()) and bool((argmax == argmax[0]).all())
    expected = torch.softmax(logits / tau, -1) * rows
    observed = torch.bincount(samples, minlength=v).double()
    stat = float(((observed - expected) ** 2 / expected).sum())
    # The torch path's logits carry one 16-bit rounding (a relative 2^-8 shift of each probability
    # at most), far below what 4,000 draws resolve. A correct sampler fails with probability 1e-6.
    assert stat < chi2.ppf(1 - 1e-6, df=v - 1), stat


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("combo", ["fp32", "bf16"])
def test_cross_entropy_at_128k_vocabulary(backend, combo, monkeypatch):
    """The production vocabulary (128,000 = 1,000 GPU tiles): no overflow of an index or a sum."""
    from megakd.kernels import linear_head_triton
    from megakd.kernels.launch import LaunchConfig

    monkeypatch.setattr(linear_head_triton, "INTERPRETER_CONFIG", LaunchConfig(max(_shipped_tiles())))
    act, wdt = DTYPES[combo]
    g = torch.Generator().manual_seed(0)
    n, h, v = 5, 8, 128_000
    hidden, weight = _rounded(g, n, h, dtype=act), _rounded(g, v, h, dtype=wdt, scale=0.3)
    target = torch.tensor([0, v - 1, 64_000, 127_872, -100])
    ref = value_and_grads(lambda a, b: fused_linear_cross_entropy_reference(a, b, None, target),
                          hidden.double(), weight.double())
    out = value_and_grads(lambda a, b: fused_linear_cross_entropy(a, b, None, target, backend=backend),
                          hidden, weight)
    _check(out, ref, (hidden, weight), backend, act, wdt, terms=v)


# ------------------------------------------------------------------------------------------------
# The sampler's random numbers: Philox-4x32-10 on (column // 4, row) counters, whatever the Triton release.

_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_U32 = 0xFFFFFFFF


def _philox4x32_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox-4x32-10 as Random123 defines it (Salmon et al., SC'11), in plain Python integers."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & _U32, (p0 >> 32) ^ c3 ^ k1, p0 & _U32
        k0, k1 = (k0 + _W0) & _U32, (k1 + _W1) & _U32
    return c0, c1, c2, c3


def test_reference_philox_matches_random123_known_answers():
    # Random123's kat_vectors for philox4x32_10: the reference itself is checked before it judges.
    assert _philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert _philox4x32_10((_U32,) * 4, (_U32, _U32)) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)


def _gumbel64(word: int) -> float:
    """The noise of one 32-bit word in float64: -log(-log(U)) for U = (word + 1/2) / 2**32, with -log(U)
    taken as -log1p(-(1 - U)) above 1/2, where 1 - U is exact."""
    u = (word + 0.5) / 2.0**32
    e = -math.log1p(-((_U32 - word) + 0.5) / 2.0**32) if word >> 31 else -math.log(u)
    return -math.log(e)


@pytest.mark.parametrize("backend", [TRITON])
def test_sampler_noise_is_philox_of_row_and_column(backend):
    """Column c of row r gets word c % 4 of Philox(counter=(c // 4, r, 0, 0), key=seed) as Gumbel noise: one
    fixed stream for any Triton version and tiling, every word of each Philox call used, and the fp32
    transform within a few ulps of float64 (the 24-bit rounding of the word costs 2**-24 / log 2 at most)."""
    from megakd.kernels.linear_head_triton import sampler_noise

    seed, rows, vocab = 1_234_567, 19, 45
    got = sampler_noise(seed, rows, vocab, torch.device("cpu")).double().numpy()
    want = np.empty((rows, vocab))
    for r in range(rows):
        for c in range(vocab):
            want[r, c] = _gumbel64(_philox4x32_10((c // 4, r, 0, 0), (seed, 0))[c % 4])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=4e-7)
    assert len(np.unique(got)) == rows * vocab
