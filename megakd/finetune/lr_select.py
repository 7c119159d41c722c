"""Learning-rate selection's rules: which rates `finetune.lr` stands for, and the slice of train that
decides among them (the selection itself: `select_lr` in megakd/finetune/trainer.py)."""

from __future__ import annotations

import torch

from megakd.finetune.config import auto_lr


def candidate_lrs(setting: float | list[float] | str, hidden_size: int) -> list[float]:
    """The learning rates `finetune.lr` stands for: one rate, `auto` (`auto_lr`), or a list."""
    if setting == "auto":
        return [auto_lr(hidden_size)]
    return [float(v) for v in setting] if isinstance(setting, list) else [float(setting)]


def held_out_count(n: int, frac: float) -> int:
    """How many of `n` train examples the LR selection holds out: `frac` of them, at least one, not all."""
    return min(max(1, round(frac * n)), n - 1)


def selection_rows(n: int, frac: float) -> tuple[list[int], list[int]]:
    """(fit rows, held-out rows) of a train split of `n` examples: a fixed permutation (seed 0), both non-empty."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    held = held_out_count(n, frac)
    return sorted(order[held:]), sorted(order[:held])
