"""Attention with a T5 relative-position bias table, a key mask, packed-row segments and attention dropout,
through a flash-attention Triton kernel (:mod:`.attention_triton`) that never materialises [B, heads, L, L].

``softmax(q k^T / sqrt(d) + table[buckets[k - q + L - 1], head], masked) * keep / (1 - p_drop) @ v``, the
bias gathered per (head, query, key) inside the kernel and its gradient summed per bucket there. Query ``q``
sees key ``k`` when ``key_mask[b, k]`` (padding) and ``segment_ids[b, q] == segment_ids[b, k]`` (packed rows),
whichever are given; a query with no visible key averages every key's value (as SDPA does with the masked
scores at the dtype's minimum) and passes no gradient to q or k.

There is no torch path: a model uses SDPA where this kernel does not run (megakd/models/encoder.py,
``attention_kernel``). :func:`relative_attention_reference` is the materialising reference the tests compare
with, and :func:`attention_keep_mask` the dropout mask the kernel applies.
"""

from __future__ import annotations

import torch

from .attention_parts import bucket_spans, dropout_threshold
from .dispatch import check_float, check_tensor, resolve_backend

_OP = "relative_attention"
def _check(q, k, v, bias_table, buckets, key_mask, segment_ids) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 4, _OP)
        check_float(name, t, _OP)
    if k.shape != q.shape or v.shape != q.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{_OP}: q, k, v must share shape and dtype, got {tuple(q.shape)} {q.dtype}, "
                         f"{tuple(k.shape)} {k.dtype}, {tuple(v.shape)} {v.dtype}")
    batch, heads, length, _ = q.shape
    if (bias_table is None) != (buckets is None):
        raise ValueError(f"{_OP}: bias_table and buckets go together, got only one of them")
    if bias_table is not None:
        check_tensor("bias_table", bias_table, 2, _OP)
        if bias_table.shape[1] != heads:
            raise ValueError(f"{_OP}: bias_table must be [buckets, heads={heads}], got {tuple(bias_table.shape)}")
        if buckets.shape != (2 * length - 1,) or buckets.is_floating_point():
            raise ValueError(f"{_OP}: buckets must be an integer tensor of shape ({2 * length - 1},) (2L - 1), "
                             f"got {buckets.dtype} {tuple(buckets.shape)}")
        if buckets.device.type == "cpu":  # on a GPU this check would wait for it: the encoder's come from the CPU
            if buckets.min() < 0 or buckets.max() >= bias_table.shape[0]:
                raise ValueError(f"{_OP}: buckets must lie in [0, {bias_table.shape[0]}) (the table's rows)")
            first, last = bucket_spans(buckets, bias_table.shape[0]).long().unbind(1)
            counts = torch.bincount(buckets.long(), minlength=bias_table.shape[0])
            if not torch.equal(torch.where(counts > 0, last - first + 1, 0), counts):
                raise ValueError(f"{_OP}: buckets: each bucket's offsets must form one interval (T5's do)")
    for name, t in (("key_mask", key_mask), ("segment_ids", segment_ids)):
        if t is not None and t.shape != (batch, length):
            raise ValueError(f"{_OP}: {name} must be [batch, L] = ({batch}, {length}), got {tuple(t.shape)}")


def draw_seed(generator: torch.Generator | None = None) -> int:
    """A dropout key: 31 bits from ``generator`` (torch's default CPU generator when None), so seeding, saved RNG
    states and activation checkpointing's recomputation (which restores the CPU RNG) give the same mask."""
    return int(torch.randint(0, 2**31 - 1, (), generator=generator))


def relative_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias_table: torch.Tensor | None = None,
    buckets: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    backend: str = "triton",
) -> torch.Tensor:
    """Attention of q, k, v [B, heads, L, head_dim] (any strides with a dense last dimension) -> [B, heads, L, d].

    ``bias_table`` [buckets, heads] with ``buckets`` [2L - 1] (the bucket of offset ``k - q`` at index
    ``k - q + L - 1``); ``key_mask`` [B, L] (True = visible key); ``segment_ids`` [B, L]; ``dropout_p`` the
    attention dropout (applied as given: pass 0 outside training), keyed by ``seed`` (:func:`draw_seed` when None).
    ``backend``: "triton" or "auto" (both the kernel: on CPU it needs ``TRITON_INTERPRET=1``)."""
    _check(q, k, v, bias_table, buckets, key_mask, segment_ids)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{_OP}: dropout_p must be in [0, 1), got {dropout_p}")
    if backend not in ("auto", "triton"):
        raise ValueError(f"{_OP}: backend must be 'auto' or 'triton' (no torch path), got {backend!r}")
    resolve_backend("triton", q.device, _OP)
    from .attention_triton import relative_attention_triton

    seed = draw_seed() if seed is None and dropout_p > 0 else seed or 0
    return relative_attention_triton(q, k, v, bias_table, buckets, key_mask, segment_ids, dropout_p, seed)


def attention_keep_mask(seed: int, dropout_p: float, batch: int, heads: int, length: int,
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """The [B, heads, L, L] bool keep mask (True = kept) :func:`relative_attention` applies for ``seed``."""
    resolve_backend("triton", torch.device(device), _OP)
    from .attention_triton import keep_mask_triton

    return keep_mask_triton(seed, dropout_p, batch * heads, length, torch.device(device)).view(
        batch, heads, length, length)


def relative_attention_reference(q, k, v, bias_table=None, buckets=None, key_mask=None, segment_ids=None,
                                 keep=None, dropout_p: float = 0.0) -> torch.Tensor:
    """Materialising reference: softmax attention with the [B, heads, L, L] bias (masked keys at the dtype's
    minimum) and the keep mask ``keep`` [B, heads, L, L] applied to the probabilities explicitly, scaled as the
    kernel does."""
    _check(q, k, v, bias_table, buckets, key_mask, segment_ids)
    batch, heads, length, _ = q.shape
    bias = torch.zeros(1, heads, length, length, dtype=q.dtype, device=q.device)
    if bias_table is not None:
        offsets = torch.arange(length, device=q.device)
        index = offsets[None, :] - offsets[:, None] + length - 1
        bias = bias_table[buckets.long()[index]].permute(2, 0, 1)[None].to(q.dtype)
    visible = torch.ones(batch, 1, length, length, dtype=torch.bool, device=q.device)
    if key_mask is not None:
        visible = visible & key_mask.bool()[:, None, None, :]
    if segment_ids is not None:
        visible = visible & (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + bias.masked_fill(~visible, torch.finfo(q.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    if keep is not None and dropout_p > 0:
        probs = probs * keep.to(probs.dtype) * dropout_threshold(dropout_p)[1]
    return probs @ v
