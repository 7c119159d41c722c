"""The Triton sampler: Gumbel-max inside the head's forward kernel, with fp32 Philox noise.

Its noise function at the words that bound it (the largest noise, the smallest, the 2**31 seam where
it switches from -log(U) to -log1p(-(1 - U))), its draws against softmax(z / tau) by chi-square (and
the test's power: a wrong temperature fails), and draws that do not depend on the tiling or on how
many splits share a row's vocabulary.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from megakd.kernels import fused_linear_sample
from scipy.stats import chi2

from .helpers import TRITON

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from megakd.kernels.linear_head_triton import _gumbel_of_words  # noqa: E402

pytestmark = pytest.mark.parametrize("backend", [TRITON])


@triton.jit
def _noise_of_words_kernel(w_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, _gumbel_of_words(tl.load(w_ptr + i).to(tl.uint32)))


def _noise_of_words(words: list[int]) -> np.ndarray:
    block = triton.next_power_of_2(len(words))
    w = torch.tensor(words + [0] * (block - len(words)), dtype=torch.int64)
    out = torch.empty(block, dtype=torch.float32)
    _noise_of_words_kernel[(1,)](w, out, BLOCK=block)
    return out[: len(words)].double().numpy()


def test_noise_at_its_bounds_matches_float64(backend):
    """Within a few fp32 ulps of float64 over the whole range of words; the largest noise is
    -log(-log1p(-2**-33)) = 22.87 (the docstring's truncation point), the smallest -log(33 log 2)."""
    from .test_dtypes import _gumbel64

    words = [0, 1, 2, 255, 2**24 - 1, 2**24 + 3, 2**31 - 2, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 2**24,
             2**32 - 256, 2**32 - 3, 2**32 - 2, 2**32 - 1, 12345678, 3_000_000_000]
    got = _noise_of_words(words)
    want = np.array([_gumbel64(w) for w in words])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=4e-7)
    assert got.max() == got[words.index(2**32 - 1)]
    assert abs(got.max() - -math.log(-math.log1p(-(2.0**-33)))) < 1e-5 and 22.86 < got.max() < 22.88
    assert abs(got.min() - -math.log(33 * math.log(2))) < 1e-6


def _draws(backend, tau, monkeypatch, rows=4000, seed=1):
    """``rows`` draws from one row of logits; interpreter tiles of 256 rows keep the programs few (the
    interpreter's cost is per program and operation, not per element)."""
    from megakd.kernels import linear_head_triton
    from megakd.kernels.launch import LaunchConfig

    monkeypatch.setattr(linear_head_triton, "INTERPRETER_CONFIG", LaunchConfig.of(BLOCK_N=256, BLOCK_V=32, BLOCK_H=16))
    g = torch.Generator().manual_seed(9)
    v, h = 37, 6  # 37 = one full 32-wide interpreter tile plus a partial one
    weight, bias = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.4, torch.randn(v, generator=g,
                                                                                           dtype=torch.float64) * 0.3
    hidden = torch.randn(1, h, generator=g, dtype=torch.float64).expand(rows, h).contiguous()
    samples, _ = fused_linear_sample(hidden, weight, bias, torch.Generator().manual_seed(seed), tau, backend=backend)
    return samples, hidden[0] @ weight.T + bias


def _p_value(samples, logits, tau) -> float:
    expected = torch.softmax(logits / tau, -1) * samples.shape[0]
    observed = torch.bincount(samples, minlength=logits.shape[0]).double()
    return float(chi2.sf(((observed - expected) ** 2 / expected).sum(), df=logits.shape[0] - 1))


def test_draws_follow_the_softmax_at_the_run_temperature_and_not_another(backend, monkeypatch):
    """4,000 draws from one row at tau = 0.7: chi-square p > 1e-3 against softmax(z / 0.7), and p < 1e-3
    against softmax(z / 0.85), a temperature 20 % off: the test can tell them apart."""
    samples, logits = _draws(backend, 0.7, monkeypatch)
    assert _p_value(samples, logits, 0.7) > 1e-3
    assert _p_value(samples, logits, 0.85) < 1e-3


def test_draws_do_not_depend_on_tiles_or_splits(backend, monkeypatch):
    """The same seed gives the same draws at other row and vocabulary tiles and with one, two or three
    vocabulary splits (the noise is a function of seed, row and column)."""
    from megakd.kernels import linear_head_triton
    from megakd.kernels.launch import LaunchConfig

    g = torch.Generator().manual_seed(4)
    n, h, v = 40, 16, 301
    hidden, weight = torch.randn(n, h, generator=g, dtype=torch.float64), torch.randn(v, h, generator=g,
                                                                                      dtype=torch.float64)
    results = []
    for blocks, splits in (((16, 32), 3), ((32, 64), 1), ((8, 128), 2)):
        monkeypatch.setattr(linear_head_triton, "INTERPRETER_CONFIG",
                            LaunchConfig.of(BLOCK_N=blocks[0], BLOCK_V=blocks[1], BLOCK_H=16))
        monkeypatch.setattr(linear_head_triton, "_vocab_splits", lambda *_, s=splits: s)
        results.append(fused_linear_sample(hidden, weight, None, torch.Generator().manual_seed(3), 1.3,
                                           backend=backend))
    for samples, argmax in results[1:]:
        assert torch.equal(samples, results[0][0]) and torch.equal(argmax, results[0][1])
    assert torch.equal(results[0][1], (hidden @ weight.T).argmax(-1))
    assert (results[0][0] != results[0][1]).any()  # at tau = 1.3 not every draw is the argmax
