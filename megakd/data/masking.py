"""MLM masking and collation as pure functions of (seed, epoch, global sample index).

Masks come from a counter-based hash, not a stateful RNG, so the same sample gets the same mask in
the same epoch whatever the worker count, batch composition, padding length or resume point.
Per sample, exactly ``max(1, floor(mask_prob * n + 0.5))`` of its ``n`` maskable tokens are
masked (0 if ``n == 0``): the positions with the smallest hash keys, i.e. a uniform random subset.
Specials ([CLS], [SEP], [PAD], [UNK], [MASK]) and padding are never maskable. Masked positions
are replaced by [MASK] only (no 80/10/10 split; docs/methods.md § ELECTRA objectives).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MAX = np.iinfo(np.uint64).max


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: a bijective, well-scrambled map of uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def mask_keys(seed: int, epochs: np.ndarray, indices: np.ndarray, length: int) -> np.ndarray:
    """uint64 keys [B, length]; key (b, i) depends only on (seed, epochs[b], indices[b], i)."""
    with np.errstate(over="ignore"):
        base = _mix(np.full(len(indices), seed, dtype=np.uint64) + _GOLDEN)
        base = _mix(base ^ epochs.astype(np.uint64))
        base = _mix(base ^ indices.astype(np.uint64))
        pos = (np.arange(length, dtype=np.uint64) + np.uint64(1)) * _GOLDEN
        return _mix(base[:, None] ^ pos[None, :])


def num_to_mask(n_maskable: np.ndarray, mask_prob: float) -> np.ndarray:
    k = np.floor(mask_prob * n_maskable + 0.5).astype(np.int64)
    return np.where(n_maskable > 0, np.maximum(k, 1), 0)


def mlm_mask(
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    epochs: np.ndarray,
    indices: np.ndarray,
    *,
    seed: int,
    mask_prob: float,
    special_ids: Sequence[int],
) -> np.ndarray:
    """Boolean [B, L] mask of the positions to replace by [MASK]."""
    maskable = attention_mask & ~np.isin(input_ids, np.asarray(list(special_ids)))
    keys = mask_keys(seed, epochs, indices, input_ids.shape[1])
    keys[~maskable] = _MAX
    order = np.argsort(keys, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(order.shape[1])[None, :].repeat(len(order), 0), axis=1)
    k = num_to_mask(maskable.sum(axis=1), mask_prob)
    return rank < k[:, None]


def collate(
    samples: Sequence[np.ndarray],
    epochs: Sequence[int],
    indices: Sequence[int],
    *,
    pad_id: int,
    mask_id: int,
    special_ids: Sequence[int],
    seed: int,
    mask_prob: float,
    segment_start_id: int | None = None,
) -> dict[str, torch.Tensor]:
    """Pad to the longest sample and mask; returns the batch dict the trainer consumes.

    ``mlm_positions`` holds the flat indices of the masked slots (`masked_positions`), computed here on
    the host: on a GPU the sparse generator head would otherwise wait for the device to count them
    (`megakd.objectives.electra.batch_positions`).

    Packed samples (several documents, each starting with `segment_start_id`, i.e. [CLS]) also get
    ``segment_ids`` [B, L]: 1, 2, ... per document, 0 on padding. Masking is the same either way.
    """
    length = max(len(s) for s in samples)
    ids = np.full((len(samples), length), pad_id, dtype=np.int64)
    attn = np.zeros((len(samples), length), dtype=bool)
    for b, s in enumerate(samples):
        ids[b, : len(s)] = s
        attn[b, : len(s)] = True
    ep = np.asarray(epochs, dtype=np.int64)
    idx = np.asarray(indices, dtype=np.int64)
    mask = mlm_mask(ids, attn, ep, idx, seed=seed, mask_prob=mask_prob, special_ids=special_ids)
    masked = np.where(mask, mask_id, ids)
    extra = {}
    if segment_start_id is not None:
        extra["segment_ids"] = torch.from_numpy(np.cumsum(ids == segment_start_id, axis=1) * attn)
    return {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(attn),
        "masked_input_ids": torch.from_numpy(masked),
        "mlm_mask": torch.from_numpy(mask),
        "mlm_positions": torch.from_numpy(np.flatnonzero(mask).astype(np.int64)),
        "index": torch.from_numpy(idx),
        "epoch": torch.from_numpy(ep),
        **extra,
    }


@dataclass(frozen=True)
class Masking:
    """The arguments of :func:`collate` that a data set and its tokenizer fix (all but the seed, which
    also orders the samples): what a reader needs to turn samples into a batch."""

    pad_id: int
    mask_id: int
    special_ids: tuple[int, ...]
    mask_prob: float
    segment_start_id: int | None = None  # [CLS] for packed shards (see megakd.data.shards), else None

    def collate(self, samples: Sequence[np.ndarray], epochs: Sequence[int], indices: Sequence[int],
                seed: int) -> dict[str, torch.Tensor]:
        return collate(samples, epochs, indices, pad_id=self.pad_id, mask_id=self.mask_id,
                       special_ids=self.special_ids, seed=seed, mask_prob=self.mask_prob,
                       segment_start_id=self.segment_start_id)
