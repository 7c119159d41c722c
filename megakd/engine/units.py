"""What a layout is made of and what one step hands it: its units and the step's context.

Below both `megakd.engine.layouts` (which builds units and drives a micro-batch through them) and
`megakd.engine.backends` (which wraps and steps them), so neither imports the other for these.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


@dataclass
class Unit:
    name: str
    loss_module: nn.Module  # computes the loss in forward; what backends wrap
    model: nn.Module  # what is checkpointed and exported
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    clip_norm: float  # 0 = off; bounds the gradient of the unweighted loss
    loss_scale: float = 1.0  # the λ this unit's loss is multiplied by before backward
    wrapped: nn.Module | None = None
    scaler: torch.amp.GradScaler | None = None

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @property
    def max_grad_norm(self) -> float:
        """The threshold for the λ-weighted gradient this unit actually holds (inf = no clipping)."""
        return self.clip_norm * self.loss_scale if self.clip_norm > 0 else float("inf")


def untimed(_phase: str) -> contextlib.AbstractContextManager:
    """The default timing hook: no measurement."""
    return contextlib.nullcontext()


def no_stop() -> tuple[bool, bool]:
    """The default stop flags: no signal received."""
    return False, False


def never() -> bool:
    return False


@dataclass
class StepInput:
    """One step's micro-batches and what the step's context carries besides the loop's own values."""

    micro_batches: Iterator[dict]
    epoch: int = 0
    loss_weight: float = 1.0
    held: Callable[[], bool] = never


@dataclass(frozen=True)
class StepContext:
    """What one optimizer step needs besides its batches. Passed down the call, never stored.

    `stop_flags` is this rank's (stop requested, a SIGINT was among the signals), read when the
    step's one agreement all-reduce runs; so is `held`: whether this rank's micro-batches were
    stand-ins because its storage failed (then every rank skips the update and stops). `timer(phase)`
    is a context manager around each "forward", "backward" and "optimizer" phase (`megakd bench`
    measures through it).
    """

    index: int  # the 0-based optimizer step being computed (DWT's α_s(t) depends on it)
    rng: torch.Generator | None = None  # this rank's replacement-sampling stream (pretraining's layouts)
    stop_flags: Callable[[], tuple[bool, bool]] = no_stop
    held: Callable[[], bool] = never
    timer: Callable[[str], contextlib.AbstractContextManager] = untimed
    epoch: int = 0  # the epoch of an epoch-based job (fine-tuning's objectives schedule on it)
    loss_weight: float = 1.0  # this rank's weight on its micro-batch loss (its share of an uneven global batch)


class MicroBatchRun(Protocol):
    """What a layout's `micro_step` drives: `backends.MicroBatch` when training, `validation.ForwardOnly`
    when scoring. `with run.unit(u):` opens unit u's pass; `forward` and `backward` run inside it."""

    def unit(self, unit: Unit) -> contextlib.AbstractContextManager: ...

    def forward(self, unit: Unit, *args, **kwargs) -> dict: ...

    def backward(self, unit: Unit, loss: torch.Tensor) -> None: ...
