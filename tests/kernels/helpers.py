"""Shared helpers for kernel tests: backend parametrization and fused-vs-reference gradients."""

from __future__ import annotations

import pytest
import torch
from megakd.kernels.dispatch import triton_available, triton_interpret

TRITON = pytest.param(
    "triton",
    marks=pytest.mark.skipif(
        not (triton_available() and triton_interpret()), reason="needs triton with TRITON_INTERPRET=1"
    ),
)
BACKENDS = ["torch", TRITON]


def value_and_grads(fn, *inputs: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Evaluate ``fn`` on fresh leaf copies of ``inputs`` and return its value and their gradients."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward()
    return out.detach(), [None if t is None else t.grad for t in leaves]


def assert_matches(fused, reference, rtol: float = 1e-10, atol: float = 1e-12) -> None:
    """Compare (value, grads) pairs from :func:`value_and_grads`."""
    torch.testing.assert_close(fused[0], reference[0], rtol=rtol, atol=atol)
    for i, (g, r) in enumerate(zip(fused[1], reference[1])):
        if r is None:
            assert g is None or not g.any(), f"input {i}: unexpected gradient"
        else:
            assert g is not None, f"input {i}: missing gradient"
            torch.testing.assert_close(g, r, rtol=rtol, atol=atol, msg=lambda m, i=i: f"grad of input {i}: {m}")
