"""The cheap CPU dropout mask: its statistics, its determinism, and attention built on it against a
float64 reference that applies the same mask with plain autograd ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megakd.models.dropout import LANES, attention, dropout, keep_mask


@pytest.mark.parametrize("p", [0.1, 0.5, 0.03, 1 / LANES])  # the last drops one lane value: an off-by-one doubles it
def test_keep_mask_drops_p_rounded_to_lanes_and_scale_preserves_the_mean(p: float) -> None:
    torch.manual_seed(0)
    keep, scale = keep_mask(torch.Size([1 << 24]), p)
    p_eff = round(p * LANES) / LANES
    drop_rate = 1 - keep.double().mean().item()
    sigma = (p_eff * (1 - p_eff) / keep.numel()) ** 0.5
    assert abs(drop_rate - p_eff) < 6 * sigma
    assert scale * (1 - p_eff) == pytest.approx(1.0, abs=1e-15)
    # The four lanes of one 64-bit draw are independent: lane pairs are both dropped at p_eff².
    lanes = ~keep.view(-1, 4)
    for a, b in [(0, 1), (1, 2), (2, 3), (0, 3)]:
        both = (lanes[:, a] & lanes[:, b]).double().mean().item()
        assert abs(both - p_eff ** 2) < 6 * (p_eff ** 2 * (1 - p_eff ** 2) / lanes.shape[0]) ** 0.5


def test_mask_follows_the_torch_seed_and_not_the_thread_count() -> None:
    threads = torch.get_num_threads()
    masks = []
    try:
        for seed, n_threads in [(3, 1), (3, 2), (4, 1)]:
            torch.set_num_threads(n_threads)
            torch.manual_seed(seed)
            masks.append(keep_mask(torch.Size([64, 1000]), 0.1)[0])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(masks[0], masks[1])
    assert not torch.equal(masks[0], masks[2])


def test_dropout_is_the_input_times_the_scaled_mask_forward_and_backward() -> None:
    x = torch.randn(4, 7, 9, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(5)
    out = dropout(x, 0.2, training=True)
    out.backward(torch.arange(out.numel(), dtype=torch.float64).view_as(out))
    torch.manual_seed(5)
    keep, scale = keep_mask(x.shape, 0.2)
    expected = torch.where(keep, x.detach() * scale, 0.0)
    assert torch.equal(out.detach(), expected)
    assert torch.equal(x.grad, torch.where(keep, torch.arange(x.numel(), dtype=torch.float64).view_as(x) * scale, 0.0))
    assert 0 < keep.logical_not().sum() < keep.numel()


def test_outside_cpu_training_it_is_torch_itself() -> None:
    x = torch.randn(3, 5, 8, 16)
    assert torch.equal(dropout(x, 0.1, training=False), x)
    q, k, v = torch.randn(3, 3, 2, 5, 16).unbind(0)
    mask = torch.rand(3, 1, 1, 5) > 0.3
    mask[..., 0] = True
    assert torch.equal(attention(q, k, v, mask, 0.1, training=False),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def reference_attention(q, k, v, bias, keep, scale):
    """softmax(q kᵀ / √d + bias), dropped with `keep`, scaled, times v: autograd over plain ops."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + bias
    return (torch.softmax(scores, dim=-1) * keep * scale) @ v


@pytest.mark.parametrize("bias_kind", ["bool", "relative"])
def test_attention_matches_the_plain_autograd_reference_in_float64(bias_kind: str) -> None:
    g = torch.Generator().manual_seed(0)
    batch, heads, length, dim = 3, 2, 11, 8
    qkv = torch.randn(batch, length, 3, heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    key_mask = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    key_mask[1, ..., 7:] = False
    key_mask[2, ..., 3:] = False
    relative = torch.randn(1, heads, length, length, generator=g, dtype=torch.float64, requires_grad=True)
    if bias_kind == "bool":
        attn_mask = key_mask
        additive = torch.zeros(key_mask.shape, dtype=torch.float64).masked_fill(~key_mask, float("-inf"))
    else:  # as Encoder.forward passes it: the relative bias with masked keys at the dtype's minimum
        attn_mask = relative.masked_fill(~key_mask, torch.finfo(torch.float64).min)
        additive = relative.masked_fill(~key_mask, float("-inf"))
    grad_out = torch.randn(batch, heads, length, dim, generator=g, dtype=torch.float64)

    torch.manual_seed(7)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # the head views SelfAttention passes
    out = attention(q, k, v, attn_mask, 0.25, training=True)
    got = torch.autograd.grad(out, (qkv, relative) if bias_kind == "relative" else (qkv,), grad_out)
    torch.manual_seed(7)
    keep, scale = keep_mask(torch.Size([batch, heads, length, length]), 0.25)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    expected_out = reference_attention(q, k, v, additive, keep, scale)
    expected = torch.autograd.grad(expected_out, (qkv, relative) if bias_kind == "relative" else (qkv,), grad_out)

    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-12)
    for name, a, b in zip(("qkv", "relative bias"), got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)
    assert (~keep).any() and keep.any()
    assert got[0].abs().max() > 1e-2  # the gradients are not trivially zero


def test_attention_under_bf16_autocast_runs_in_bf16_and_matches_float32_on_the_same_mask() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 16, generator=g, requires_grad=True)
    proj = torch.nn.Linear(16, 48)
    torch.manual_seed(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = proj(x).view(2, 6, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        out = attention(q, k, v, None, 0.1, training=True)
    assert out.dtype == torch.bfloat16
    grad_x, = torch.autograd.grad(out.float().sum(), x)
    torch.manual_seed(3)
    keep, scale = keep_mask(torch.Size([2, 2, 6, 6]), 0.1)
    q, k, v = proj(x).view(2, 6, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
    expected = reference_attention(q, k, v, 0.0, keep, scale)
    expected_grad, = torch.autograd.grad(expected.sum(), x)
    assert grad_x.dtype == torch.float32 and (~keep).any()
    # bf16 rounding leaves ~0.006 here; a 1/(1-p) scale lost in forward or backward moves both by ~0.1.
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=0.02)
    torch.testing.assert_close(grad_x, expected_grad, rtol=0, atol=0.02)
