"""Operator shares of a profiled step: they add up to one and leave megakd's phase ranges out."""

from __future__ import annotations

import pytest
import torch

from megakd.bench.roofline import format_phases, op_shares
from megakd.engine.profiling import phase


def test_op_shares_add_up_and_rank_the_matmul_first():
    # A matmul of ~2 GFLOP: tens of ms a step, so a small op the scheduler preempts on a loaded machine
    # (seen at 384 x 384: `aten::_to_copy` ranked first) cannot outweigh it.
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
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


def test_phase_shares_are_of_the_profiled_phases_and_add_up_to_100_percent():
    """Profiling slows every range, so shares of the unprofiled step would add up to more than 100 %."""
    line = format_phases({"generator": 0.03, "discriminator": 0.09, "optimizer": 0.0})
    assert line == "generator 30 ms (25%), discriminator 90 ms (75%), optimizer 0 ms (0%)"
    assert format_phases({"data": 0.0}) == "data 0 ms (0%)"  # nothing profiled: no division by zero
