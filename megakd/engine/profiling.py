"""Named phases of a training step, visible to `torch.profiler` (and free when it is off).

The benchmarks split a step's time by these labels (`megakd.bench.roofline.phase_seconds`); a
`record_function` range costs about a microsecond when no profiler is running.
"""

from __future__ import annotations

from torch.profiler import record_function

PHASES = ("data", "generator", "discriminator", "optimizer")
PREFIX = "megakd."


def phase(name: str) -> record_function:
    """Context manager labelling the enclosed work as phase `name` (one of PHASES)."""
    return record_function(PREFIX + name)
