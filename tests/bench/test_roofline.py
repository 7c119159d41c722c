"""Operator shares of a profiled step: they add up to one and leave megakd's phase ranges out."""

from __future__ import annotations

import pytest
import torch

from megakd.bench.roofline import op_shares
from megakd.engine.profiling import phase


def test_op_shares_add_up_and_rank_the_matmul_first():
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    small = torch.randn(8)

    def step() -> None:
        with phase("discriminator"):
            a @ b
            small.add(1.0)

    shares = op_shares(step, 2, torch.device("cpu"))
    assert next(iter(shares)) == "aten::mm"
    assert list(shares.values()) == sorted(shares.values(), reverse=True)
    assert sum(shares.values()) == pytest.approx(1.0)
    assert "aten::add" in shares and not any(name.startswith("megakd.") for name in shares)
