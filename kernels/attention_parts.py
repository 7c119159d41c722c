"""What :mod:`.attention` and its Triton kernels share, in torch alone: the dropout compare and the bucket spans
the table's gradient reads."""

from __future__ import annotations

import math

import torch

KEEP_BITS = 24  # the bits of each Philox word the dropout compare reads


def dropout_threshold(p: float) -> tuple[int, float]:
    """(threshold, scale): a key is dropped when its 24-bit draw is below ``threshold = ceil(p * 2**24)``, and
    kept values are scaled by ``2**24 / (2**24 - threshold)``, the exact inverse of the keep probability."""
    lanes = 1 << KEEP_BITS
    threshold = math.ceil(p * lanes)
    return threshold, lanes / (lanes - threshold)


def bucket_spans(buckets: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """[buckets, 2] int32: the first and last index ``k - q + L - 1`` of each bucket (first > last for a bucket no
    offset reaches). The kernel's backward sums dS over ``first..last``: right when each bucket's offsets are one
    interval, as T5's are (monotone in the distance on each side); :func:`.attention.relative_attention` checks it."""
    index = torch.arange(buckets.numel(), device=buckets.device)
    ids = buckets.long()
    first = torch.full((num_buckets,), buckets.numel(), device=buckets.device).scatter_reduce(0, ids, index, "amin")
    last = torch.full((num_buckets,), -1, device=buckets.device).scatter_reduce(0, ids, index, "amax")
    return torch.stack([first, last], 1).to(torch.int32)
