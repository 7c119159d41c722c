import pytest
import torch
from megakd.kernels import fused_rtd_loss, fused_rtd_loss_reference

from .helpers import BACKENDS, assert_matches, value_and_grads


def _inputs(n: int, h: int, mask_kind: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(h, generator=g, dtype=torch.float64)
    bias = torch.randn((), generator=g, dtype=torch.float64)
    original = torch.randint(0, 5, (n,), generator=g)
    corrupted = torch.where(torch.rand(n, generator=g) < 0.4, torch.randint(0, 5, (n,), generator=g), original)
    mask = {
        "random": torch.rand(n, generator=g) < 0.7,
        "none": torch.zeros(n, dtype=torch.bool),
        "all": torch.ones(n, dtype=torch.bool),
    }[mask_kind]
    return hidden, weight, bias, corrupted, original, mask


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,h", [(1, 1), (37, 21), (64, 32), (70, 40)])
@pytest.mark.parametrize("mask_kind", ["random", "none", "all"])
def test_matches_reference_float64(backend, n, h, mask_kind):
    hidden, weight, bias, corrupted, original, mask = _inputs(n, h, mask_kind, seed=n * 100 + h)
    ref = value_and_grads(lambda a, b, c: fused_rtd_loss_reference(a, b, c, corrupted, original, mask),
                          hidden, weight, bias)
    out = value_and_grads(lambda a, b, c: fused_rtd_loss(a, b, c, corrupted, original, mask, backend=backend),
                          hidden, weight, bias)
    assert_matches(out, ref)
    if mask_kind == "none":
        assert out[0].item() == 0.0 and all(not g.any() for g in out[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_output_scaling_and_label_convention(backend):
    # Logit +20 on replaced tokens and -20 on originals: near-zero loss only if 1 = replaced.
    n = 9
    hidden = torch.zeros(n, 2, dtype=torch.float64)
    original = torch.arange(n)
    corrupted = original.clone()
    corrupted[::2] += 100
    hidden[:, 0] = torch.where(corrupted != original, 20.0, -20.0).double()
    w = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    loss = fused_rtd_loss(hidden, w, b, corrupted, original, torch.ones(n, dtype=torch.bool), backend=backend)
    assert loss.item() < 1e-8
    (3.0 * loss).backward()
    ref_w = w.detach().clone().requires_grad_(True)
    (3.0 * fused_rtd_loss_reference(hidden, ref_w, b.detach(), corrupted, original,
                                    torch.ones(n, dtype=torch.bool))).backward()
    torch.testing.assert_close(w.grad, ref_w.grad, rtol=1e-10, atol=1e-15)
    assert b.grad.shape == (1,)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_close_to_float64_reference(backend):
    hidden, weight, bias, corrupted, original, mask = _inputs(50, 24, "random", seed=7)
    ref = value_and_grads(lambda a, b, c: fused_rtd_loss_reference(a, b, c, corrupted, original, mask),
                          hidden, weight, bias)
    out = value_and_grads(lambda a, b, c: fused_rtd_loss(a, b, c, corrupted, original, mask, backend=backend),
                          hidden.float(), weight.float(), bias.float())
    assert out[0].dtype == torch.float32
    assert_matches((out[0].double(), [g.double() for g in out[1]]), ref, rtol=1e-5, atol=1e-6)


def test_bad_input_names_the_argument():
    hidden, weight, bias, corrupted, original, mask = _inputs(5, 4, "all", seed=0)
    with pytest.raises(ValueError, match="weight must have shape"):
        fused_rtd_loss(hidden, torch.randn(3, dtype=torch.float64), bias, corrupted, original, mask)
    with pytest.raises(ValueError, match="mask must have shape"):
        fused_rtd_loss(hidden, weight, bias, corrupted, original, mask[:3])
    with pytest.raises(ValueError, match="bias must be a one-element tensor"):
        fused_rtd_loss(hidden, weight, torch.zeros(2), corrupted, original, mask)
