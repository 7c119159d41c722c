import pytest
import torch
from megakd.kernels import lipschitz_1norm, lipschitz_1norm_reference

from .helpers import BACKENDS, assert_matches, value_and_grads


def _weights(seed: int, dtype=torch.float64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, 1), (7, 11), (33, 65), (64, 32), (5, 50)]
    ws = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
    ws.append(torch.randn(40, 3, generator=g, dtype=dtype).t())  # non-contiguous [3, 40]
    return ws


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference_float64(backend, seed):
    ws = _weights(seed)
    ref = value_and_grads(lambda *w: lipschitz_1norm_reference(w), *ws)
    out = value_and_grads(lambda *w: lipschitz_1norm(list(w), backend=backend), *ws)
    assert_matches(out, ref, rtol=1e-12, atol=1e-12)
    # subgradient: exactly one nonzero column per matrix, equal to sign(W) there
    for w, g in zip(ws, out[1]):
        nz = g.abs().sum(0).nonzero().flatten()
        assert nz.numel() == 1
        torch.testing.assert_close(g[:, nz[0]], torch.sign(w[:, nz[0]]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_known_value_and_float32(backend):
    w = torch.tensor([[1.0, -4.0, 0.5], [-2.0, 1.0, 0.5]])
    val = lipschitz_1norm([w, 2 * w], backend=backend)
    assert val.dtype == torch.float32
    assert val.item() == pytest.approx(5.0 + 10.0)


def test_bad_input():
    with pytest.raises(ValueError, match="non-empty list"):
        lipschitz_1norm([])
    with pytest.raises(ValueError, match=r"weights\[1\] must be a non-empty 2-D floating tensor"):
        lipschitz_1norm([torch.randn(2, 2), torch.randn(3)])
