"""The relative-position flash-attention kernel (kernels/attention_triton.py) under the interpreter, in float64,
against the materialising reference with the same dropout keep mask: outputs and the gradients of q, k, v and
the bias table; the keep mask's statistics and its independence of the tiles."""

from __future__ import annotations

import pytest
import torch
from megakd.kernels import attention_triton
from megakd.kernels.attention import attention_keep_mask, relative_attention, relative_attention_reference
from megakd.kernels.attention_parts import dropout_threshold
from megakd.kernels.launch import LaunchConfig

from megakd.models.encoder import relative_position_bucket

from .helpers import TRITON

pytestmark = pytest.mark.parametrize("backend", [TRITON])
BATCH, HEADS, LENGTH, BUCKETS = 2, 3, 21, 8  # 21: no multiple of the interpreter's 16 x 8 tiles


def _inputs(dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(BATCH, HEADS, LENGTH, dim, generator=g, dtype=torch.float64) for _ in range(3))
    table = torch.randn(BUCKETS, HEADS, generator=g, dtype=torch.float64)
    buckets = relative_position_bucket(torch.arange(1 - LENGTH, LENGTH), BUCKETS, 12)
    return q, k, v, table, buckets, torch.randn(BATCH, HEADS, LENGTH, dim, generator=g, dtype=torch.float64)


def _masks(kind: str):
    """(key_mask, segment_ids): right padding; or packed documents, padding (segment 0) and two masked keys.
    No query without a visible key: there the kernel passes no gradient, the reference one through the
    uniform average."""
    key_mask = torch.ones(BATCH, LENGTH, dtype=torch.bool)
    if kind == "padding":
        key_mask[1, 15:] = False
        return key_mask, None
    key_mask[0, 3] = key_mask[1, 16] = False
    return key_mask, torch.tensor([[1] * 9 + [2] * 9 + [0] * 3, [1] * 4 + [2] * 11 + [0] * 6])


def _value_and_grads(fn, q, k, v, table, grad_out):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, table)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    return out.detach(), grads


@pytest.mark.parametrize("p,kind,dim,bias", [(0.0, "padding", 12, True), (0.1, "packed", 8, True),
                                             (0.1, "padding", 8, False)])
def test_matches_reference_float64(backend, p, kind, dim, bias):
    """dim 12 pads the head dimension to the kernel's 16; 0.1 with packed rows runs every mask and dropout;
    without a table: absolute positions."""
    q, k, v, table, buckets, grad_out = _inputs(dim, seed=dim)
    buckets = buckets if bias else None
    key_mask, segments = _masks(kind)
    keep = attention_keep_mask(7, p, BATCH, HEADS, LENGTH)

    def kernel(q, k, v, table):
        return relative_attention(q, k, v, table if bias else None, buckets, key_mask, segments, p, seed=7)

    def reference(q, k, v, table):
        return relative_attention_reference(q, k, v, table if bias else None, buckets, key_mask, segments, keep, p)

    out, grads = _value_and_grads(kernel, q, k, v, table, grad_out)
    ref, ref_grads = _value_and_grads(reference, q, k, v, table, grad_out)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    if not bias:
        assert grads[3] is None and ref_grads[3] is None
        grads, ref_grads = grads[:3], ref_grads[:3]
    for name, g, r in zip(("q", "k", "v", "bias_table"), grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"grad of {name}: {m}")
    if p:  # the mask matters: without it the reference is far off
        plain = relative_attention_reference(q, k, v, table if bias else None, buckets, key_mask, segments)
        assert (plain - ref).abs().max() > 0.1


def test_tiles_change_nothing_but_rounding(backend, monkeypatch):
    """Two other tilings (more and fewer programs than the default 16 x 8) give the reference's output with the
    keep mask drawn by attention_keep_mask's own 16 x 16 tiles: the mask depends on (seed, bh, q, k) alone. The
    query tile alone changes no bit (each row is computed the same way)."""
    q, k, v, table, buckets, grad_out = _inputs(8, seed=3)
    keep = attention_keep_mask(11, 0.3, BATCH, HEADS, LENGTH)
    ref = relative_attention_reference(q, k, v, table, buckets, None, None, keep, 0.3)
    outs = []
    for tiles in ((8, 4), (32, 4), (32, 16)):
        monkeypatch.setattr(attention_triton, "INTERPRETER_CONFIG", LaunchConfig.of(BLOCK_M=tiles[0],
                                                                                    BLOCK_N=tiles[1]))
        outs.append(relative_attention(q, k, v, table, buckets, dropout_p=0.3, seed=11))
        torch.testing.assert_close(outs[-1], ref, rtol=1e-10, atol=1e-12)
    assert torch.equal(outs[0], outs[1])


def test_keep_mask_statistics(backend):
    """Keep rate within 5 binomial sigmas overall and in each of the four Philox words' key lanes; different
    seeds and different (batch, head) rows draw different masks; p is rounded up to a multiple of 2**-24."""
    p, batch, heads, length = 0.1, 2, 2, 64
    keep = attention_keep_mask(1, p, batch, heads, length)
    threshold, scale = dropout_threshold(p)
    assert threshold == 1677722 and scale == 2**24 / (2**24 - threshold)
    rate = 1 - threshold / 2**24
    n = keep.numel()
    assert abs(keep.double().mean().item() - rate) < 5 * (rate * (1 - rate) / n) ** 0.5
    for lane in range(4):
        lane_keep = keep[..., lane::4]
        assert abs(lane_keep.double().mean().item() - rate) < 5 * (rate * (1 - rate) / lane_keep.numel()) ** 0.5
    flat = keep.view(batch * heads, length, length)
    assert all(not torch.equal(flat[0], flat[i]) for i in range(1, batch * heads))
    assert not torch.equal(keep, attention_keep_mask(2, p, batch, heads, length))
    assert torch.equal(keep, attention_keep_mask(1, p, batch, heads, length))


def test_bad_arguments_name_what_was_expected(backend):
    q, k, v, table, buckets, _ = _inputs(8, seed=1)
    with pytest.raises(ValueError, match=r"buckets must be an integer tensor of shape \(41,\)"):
        relative_attention(q, k, v, table, buckets[:-1])
    with pytest.raises(ValueError, match="each bucket's offsets must form one interval"):
        relative_attention(q, k, v, table, torch.arange(2 * LENGTH - 1) % 2)
    with pytest.raises(ValueError, match=r"buckets must lie in \[0, 8\)"):
        relative_attention(q, k, v, table, buckets + 1)
    with pytest.raises(ValueError, match=r"bias_table must be \[buckets, heads=3\]"):
        relative_attention(q, k, v, table[:, :2], buckets)
    with pytest.raises(ValueError, match=r"key_mask must be \[batch, L\]"):
        relative_attention(q, k, v, key_mask=torch.ones(BATCH, LENGTH + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        relative_attention(q, k, v, dropout_p=1.0)
