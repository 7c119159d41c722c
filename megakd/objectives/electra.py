"""ELECTRA objectives as plain functions of tensors: MLM, generator sampling, corruption, RTD.

Conventions (docs/decisions.md § RTD labels): RTD label 1 = replaced, 0 = original; a sampled token equal to the
original is original. MLM loss is the mean CE over masked positions; RTD loss is the mean BCE
over non-padding positions. The generator head is sparse: every function here takes hidden
states at masked positions only, and the vocabulary projection happens inside a fused kernel
that never builds [tokens × vocab].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megakd.kernels import (
    fused_linear_cross_entropy_and_sample,
    fused_linear_sample,
    fused_rtd_loss,
)


@dataclass(frozen=True)
class SamplingTemperature:
    """The generator's sampling temperature at each optimizer step: `start`, then, with `end`, a
    linear anneal to `end` over the first `steps` optimizer steps, held there after.

    A function of the step alone, so an exact resume draws exactly what an uninterrupted run draws
    (docs/recipes.md § Annealing the sampling temperature to 1).
    """

    start: float = 1.0
    end: float | None = None
    steps: int = 0

    @property
    def annealed(self) -> bool:
        return self.end is not None and self.end != self.start

    def at(self, step: int) -> float:
        """The temperature at the 0-based optimizer step `step`."""
        if not self.annealed:
            return self.start
        if step >= self.steps:
            return self.end
        return self.start + (self.end - self.start) * step / self.steps


def mlm_loss_and_replacements(
    masked_hidden: torch.Tensor,
    decoder_weight: torch.Tensor,
    decoder_bias: torch.Tensor | None,
    targets: torch.Tensor,
    generator: torch.Generator | None = None,
    temperature: float = 1.0,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean cross-entropy of the generator at masked positions, samples, argmax) from one pass over
    the logits ([N, E] hidden, [N] targets). The samples are those `sample_replacements` draws from
    `generator`; gradients reach the loss only."""
    return fused_linear_cross_entropy_and_sample(masked_hidden, decoder_weight, decoder_bias, targets,
                                                 generator=generator, temperature=temperature, backend=backend)


@torch.no_grad()
def sample_replacements(
    masked_hidden: torch.Tensor,
    decoder_weight: torch.Tensor,
    decoder_bias: torch.Tensor | None,
    generator: torch.Generator | None = None,
    temperature: float = 1.0,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(samples, argmax) from the generator's softmax at masked positions; no gradient flows."""
    return fused_linear_sample(
        masked_hidden.detach(), decoder_weight.detach(),
        None if decoder_bias is None else decoder_bias.detach(),
        generator=generator, temperature=temperature, backend=backend,
    )


def masked_positions(mlm_mask: torch.Tensor) -> torch.Tensor:
    """Flat row-major indices of the masked slots of a [B, L] mask.

    On the host (the collate's `mlm_positions`) this is free; on a GPU it is a host-device sync
    (its row count depends on the data). The gathers and the scatter that use it need none.
    """
    return mlm_mask.reshape(-1).nonzero().squeeze(1)


def batch_positions(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The micro-batch's masked positions: `mlm_positions` where the collate computed them on the host
    (copied to the device with the batch, so no sync), else `masked_positions` of its `mlm_mask`."""
    positions = batch.get("mlm_positions")
    return masked_positions(batch["mlm_mask"]) if positions is None else positions


def corrupt(input_ids: torch.Tensor, mlm_mask: torch.Tensor, samples: torch.Tensor,
            positions: torch.Tensor | None = None) -> torch.Tensor:
    """x̂: the original sequence with the generator's samples written into the masked slots.

    `positions` (`masked_positions(mlm_mask)`, when the caller has it) writes them without the
    host sync of boolean-mask indexing.
    """
    corrupted = input_ids.clone()
    if positions is None:
        corrupted[mlm_mask] = samples.to(input_ids.dtype)
    else:
        corrupted.view(-1).index_copy_(0, positions, samples.to(input_ids.dtype))
    return corrupted


def rtd_labels(corrupted: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """1 where the token was replaced by something different from the original."""
    return (corrupted != original).long()


def rtd_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    corrupted: torch.Tensor,
    original: torch.Tensor,
    attention_mask: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """Mean BCE of the discriminator's last projection over non-padding tokens.

    `hidden` is the output of the RTD head's transform ([..., H]); `weight` [H] and `bias` []
    are its final H→1 projection. Leading dimensions are flattened.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    return fused_rtd_loss(
        h, weight.reshape(-1), bias.reshape(()), corrupted.reshape(-1), original.reshape(-1),
        attention_mask.reshape(-1), backend=backend,
    )


@torch.no_grad()
def rtd_counts(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Confusion counts of RTD predictions (logit > 0 = replaced) over non-padding tokens.

    Counts (not ratios) so they can be summed over micro-batches and ranks before computing
    precision/recall/F1. Masked with `&`, not selected: fixed-size ops, no host sync on a GPU.
    """
    mask = mask.bool()
    pred = (logits > 0) & mask
    gold = labels.bool() & mask
    return {
        "tokens": mask.sum(),
        "correct": ((pred == gold) & mask).sum(),
        "tp": (pred & gold).sum(),
        "fp": (pred & ~gold).sum(),
        "fn": (~pred & gold).sum(),
    }


def precision_recall_f1(tp: float, fp: float, fn: float) -> tuple[float, float, float]:
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """ROC AUC = P(a random positive scores above a random negative), ties counting one half.

    The Mann–Whitney form over tie-averaged ranks, in float64 (exact for any number of tokens,
    no threshold grid); None when one class is absent and the AUC is undefined.
    """
    scores, labels = scores.detach().double().flatten(), labels.bool().flatten()
    positives = int(labels.sum())
    negatives = labels.numel() - positives
    if positives == 0 or negatives == 0:
        return None
    order = torch.argsort(scores)
    _, group, counts = torch.unique_consecutive(scores[order], return_inverse=True, return_counts=True)
    last_rank = torch.cumsum(counts, 0).double()  # 1-based rank of each tie group's last member
    ranks = torch.empty_like(scores)
    ranks[order] = (last_rank - (counts.double() - 1) / 2)[group]
    return float((ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * negatives))
