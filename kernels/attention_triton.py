"""Triton kernels for :mod:`kernels.attention` (imported lazily): flash attention with a T5 relative-position
bias table, a key mask, packed-row segments and attention dropout, never materialising [B, heads, L, L].

Forward (FlashAttention-2): one program per (query block, batch x head) walks the keys in ``BLOCK_N``
tiles with an online softmax; each score tile is ``q k^T * scale + table[buckets[k - q + L - 1], head]``,
masked where the key is invisible (``-1e30``: a row with no visible key averages every key, as SDPA does
with the dtype's minimum, and passes no gradient) and ``-inf`` past the length. Backward reads the output and
the log-sum-exp, nothing of [L x L].

Dropout: key ``k`` of query ``q`` in head-row ``bh`` is kept when the top 24 bits of word ``k % 4`` of
Philox-4x32-10(counter=(k // 4, q, bh, 0), key=seed) are at least ``threshold = ceil(p * 2**24)`` (an exact
integer compare: the drop probability is ``threshold / 2**24``, and kept values are scaled by the exact inverse
of the keep probability). The draw depends on (seed, bh, q, k) only, so the forward, both backward kernels and
:func:`keep_mask_triton` regenerate the same mask whatever their tiles.

Backward, the FA2 split without atomics: :func:`_attention_dq_kernel` per (query block, bh) loops over key
blocks for dQ and writes ``delta = rowsum(dO * O)`` of its rows; :func:`_attention_dkdv_kernel` per (key block,
bh) loops over query blocks for dK and dV. The table's gradient: each of its dS tiles is summed per bucket into
its own slot of a zeroed [B, heads, key blocks x query blocks, buckets] fp32 buffer that the host sums
(deterministic; 12.6 MB at electra-base's 32 x 12 heads, L = 512, 32 x 32 tiles). A bucket's offsets are one
interval (:func:`.attention_parts.bucket_spans`), so its sum is a compare of the tile's offsets with two bounds, a
select and a reduction, done only for the buckets whose interval meets the tile (the bounds of every bucket are
two scalar loads a tile): near the diagonal one pass per
bucket there, on tiles wholly past the max distance one pass; at L = 512 with 32 buckets, max distance 128 and
32 x 32 tiles, 4.2 passes a tile on average (CUDA-core work beside the tile's four 32 x 32 x 64 dots).

Dtypes as in :mod:`.linear_head_triton`: 16-bit dots on the GPU (``DOT``), fp32 softmax and accumulators
(``ACC``); under the interpreter ``DOT`` is ``ACC`` (fp32 or fp64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_parts import KEEP_BITS, bucket_spans, dropout_threshold
from .dispatch import cuda_target, triton_interpret
from .launch import LaunchConfig
from .linear_head_triton import TL_DTYPES

KEEP_BITS_TL: tl.constexpr = tl.constexpr(KEEP_BITS)
# the score of an invisible key: finite, so a row without visible keys stays finite
MASKED: tl.constexpr = tl.constexpr(-1e30)

# (kernel, matmul class, generation) -> launch; the class is "16bit" (bf16/fp16 tensor-core dots) or "fp32".
# tools/compile_kernels.py's "attention" workload (electra-base: head dim 64, L = 512, dropout, padding, the
# table's gradient) compiles each spill-free for sm_80 and sm_90a, on Triton 3.9 and 3.6. Registers bound every
# choice: the dK/dV kernel holds the most tiles at once (scores, dP, dS, the keep mask, two accumulators) and
# spills at 64 x 64 with 4 or 8 warps (about 152 registers at 32 x 32); the dQ kernel at 64 x 64 reaches 255
# registers and spills with an fp32 table on sm_80; the fp32 forward and dK/dV spill on sm_90a with 4 warps.
_16BIT = {
    "forward": LaunchConfig.of(num_warps=8, num_stages=3, BLOCK_M=128, BLOCK_N=64),
    "backward_dq": LaunchConfig.of(num_warps=4, num_stages=2, BLOCK_M=64, BLOCK_N=32),
    "backward_dkdv": LaunchConfig.of(num_warps=4, num_stages=2, BLOCK_M=32, BLOCK_N=32),
}
_FP32 = {"forward": LaunchConfig.of(num_warps=8, num_stages=2, BLOCK_M=32, BLOCK_N=32),
         "backward_dq": LaunchConfig.of(num_warps=4, num_stages=2, BLOCK_M=32, BLOCK_N=32),
         "backward_dkdv": LaunchConfig.of(num_warps=8, num_stages=2, BLOCK_M=32, BLOCK_N=32)}
ATTENTION_CONFIGS: dict[tuple[str, str, str], LaunchConfig] = {
    **{(kernel, "16bit", gen): config for kernel, config in _16BIT.items() for gen in ("sm80", "sm90")},
    **{(kernel, "fp32", gen): config for kernel, config in _FP32.items() for gen in ("sm80", "sm90")},
}
# Under the interpreter: small tiles (BLOCK_N a multiple of 4, one Philox call per four keys), so that small
# test shapes span several tiles; tests also run other tiles by setting this.
INTERPRETER_CONFIG = LaunchConfig.of(BLOCK_M=16, BLOCK_N=8)


def _dtypes(q: torch.Tensor) -> tuple[torch.dtype, tl.dtype, tl.dtype]:
    acc_t, acc = (torch.float64, tl.float64) if q.dtype == torch.float64 else (torch.float32, tl.float32)
    if q.dtype in (torch.bfloat16, torch.float16) and not triton_interpret():
        return acc_t, acc, TL_DTYPES[q.dtype]
    return acc_t, acc, acc


def _config(kernel: str, q: torch.Tensor, dot: tl.dtype) -> LaunchConfig:
    if triton_interpret():
        return INTERPRETER_CONFIG
    matmul = "16bit" if dot in (tl.bfloat16, tl.float16) else "fp32"
    return ATTENTION_CONFIGS[kernel, matmul, cuda_target(q.device).generation]


@triton.jit
def _keep_tile(seed, bh, rows, k0, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Dropout keep mask [BLOCK_M, BLOCK_N] of keys ``k0 ..`` (``k0`` a multiple of 4) for query ``rows``."""
    groups = k0 // 4 + tl.arange(0, BLOCK_N // 4)
    zero = tl.zeros((BLOCK_M, BLOCK_N // 4), tl.uint32)
    w0, w1, w2, w3 = tl.philox(seed, zero + groups[None, :].to(tl.uint32), zero + rows[:, None].to(tl.uint32),
                               zero + bh.to(tl.uint32), zero)
    # join(join(w0, w2), join(w1, w3)) is [row, group, b, a] = word 2b + a, i.e. key 4 * group + 2b + a
    words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK_M, BLOCK_N))
    return (words >> (32 - KEEP_BITS_TL)).to(tl.int32) >= threshold


@triton.jit
def _head_tile(ptr, b, h, stride_b, stride_h, stride_l, positions, d):
    """Pointers to the [positions, d] tile of head ``h`` of batch row ``b`` in a [B, heads, L, D] view."""
    return ptr + b.to(tl.int64) * stride_b + h * stride_h + positions[:, None].to(tl.int64) * stride_l + d[None, :]


@triton.jit
def _key_tile_t(k_ptr, cols, col_ok, d, d_ok, stride_kl, DOT: tl.constexpr):
    """Keys ``cols`` transposed, [BLOCK_D, BLOCK_N] in DOT: the right operand of ``q k^T``."""
    return tl.load(k_ptr + cols[None, :].to(tl.int64) * stride_kl + d[:, None], mask=col_ok[None, :] & d_ok[:, None],
                   other=0.0).to(DOT)


@triton.jit
def _scores(q, kt, cols, col_ok, scale, rows, row_ok, b, h, L,
            bias_ptr, key_ptr, seg_ptr, seg_q,
            HAS_BIAS: tl.constexpr, HAS_KEY: tl.constexpr, HAS_SEG: tl.constexpr, ACC: tl.constexpr):
    """(scores [BLOCK_M, BLOCK_N] in ACC, visible): ``q k^T * scale + bias``, ``MASKED`` where the key is
    invisible, ``-inf`` past the length. ``bias_ptr``: [heads, 2L - 1], the table read through the buckets."""
    s = tl.dot(q, kt, out_dtype=ACC, input_precision="ieee") * scale
    valid = row_ok[:, None] & col_ok[None, :]
    if HAS_BIAS:
        s += tl.load(bias_ptr + h * (2 * L - 1) + (cols[None, :] - rows[:, None] + L - 1), mask=valid,
                     other=0.0).to(ACC)
    visible = col_ok[None, :] & (rows[:, None] >= 0)
    if HAS_KEY:
        visible = visible & (tl.load(key_ptr + b * L + cols, mask=col_ok, other=0) != 0)[None, :]
    if HAS_SEG:
        visible = visible & (seg_q[:, None] == tl.load(seg_ptr + b * L + cols, mask=col_ok, other=-1)[None, :])
    s = tl.where(col_ok[None, :], tl.where(visible, s, MASKED), float("-inf"))
    return s, visible


@triton.jit
def _attention_forward_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, bias_ptr, key_ptr, seg_ptr, scale_ptr, inv_keep_ptr,
    seed, threshold, L, NH, D, sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sob, soh, sol,
    HAS_BIAS: tl.constexpr, HAS_KEY: tl.constexpr, HAS_SEG: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
):
    bh = tl.program_id(1)
    b = bh // NH
    h = bh % NH
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < L
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    scale = tl.load(scale_ptr)
    q = tl.load(_head_tile(q_ptr, b, h, sqb, sqh, sql, rows, d),
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT)
    seg_q = rows
    if HAS_SEG:
        seg_q = tl.load(seg_ptr + b * L + rows, mask=row_ok, other=-1)
    k_base = k_ptr + b.to(tl.int64) * skb + h * skh
    v_base = v_ptr + b.to(tl.int64) * svb + h * svh
    m = tl.full((BLOCK_M,), float("-inf"), ACC)
    denom = tl.zeros((BLOCK_M,), ACC)
    acc = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    for k0 in range(0, L, BLOCK_N):
        cols = k0 + tl.arange(0, BLOCK_N)
        col_ok = cols < L
        s, visible = _scores(q, _key_tile_t(k_base, cols, col_ok, d, d_ok, skl, DOT), cols, col_ok, scale, rows,
                             row_ok, b, h, L, bias_ptr, key_ptr, seg_ptr, seg_q, HAS_BIAS, HAS_KEY, HAS_SEG, ACC)
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: key 0 of the first tile is in range
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        if DROPOUT:
            p = tl.where(_keep_tile(seed, bh, rows, k0, threshold, BLOCK_M, BLOCK_N), p, 0.0)
        v = tl.load(v_base + cols[:, None].to(tl.int64) * svl + d[None, :], mask=col_ok[:, None] & d_ok[None, :],
                    other=0.0).to(DOT)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v, out_dtype=ACC, input_precision="ieee")
        m = m_new
    out = acc / denom[:, None]
    if DROPOUT:
        out = out * tl.load(inv_keep_ptr)
    tl.store(_head_tile(o_ptr, b, h, sob, soh, sol, rows, d),
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + bh.to(tl.int64) * L + rows, m + tl.log(denom), mask=row_ok)


@triton.jit
def _attention_dq_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, bias_ptr, spans_ptr, key_ptr, seg_ptr,
    scale_ptr, inv_keep_ptr, seed, threshold, L, NH, D, sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sob, soh, sol,
    sdb, sdh, sdl, HAS_BIAS: tl.constexpr, HAS_KEY: tl.constexpr, HAS_SEG: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
):
    """dQ of one query block (``dq`` contiguous [B, heads, L, D]); also stores its rows' delta."""
    bh = tl.program_id(1)
    b = bh // NH
    h = bh % NH
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < L
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    tile_ok = row_ok[:, None] & d_ok[None, :]
    scale = tl.load(scale_ptr)
    q = tl.load(_head_tile(q_ptr, b, h, sqb, sqh, sql, rows, d),
                mask=tile_ok, other=0.0).to(DOT)
    at = bh.to(tl.int64) * L + rows
    do = tl.load(_head_tile(do_ptr, b, h, sdb, sdh, sdl, rows, d),
                 mask=tile_ok, other=0.0)
    o = tl.load(_head_tile(o_ptr, b, h, sob, soh, sol, rows, d),
                mask=tile_ok, other=0.0)
    delta = tl.sum(do.to(ACC) * o.to(ACC), axis=1)
    tl.store(delta_ptr + at, delta, mask=row_ok)
    do = do.to(DOT)
    lse = tl.load(lse_ptr + at, mask=row_ok, other=0.0)
    inv_keep = tl.load(inv_keep_ptr)
    seg_q = rows
    if HAS_SEG:
        seg_q = tl.load(seg_ptr + b * L + rows, mask=row_ok, other=-1)
    k_base = k_ptr + b.to(tl.int64) * skb + h * skh
    v_base = v_ptr + b.to(tl.int64) * svb + h * svh
    dq = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    for k0 in range(0, L, BLOCK_N):
        cols = k0 + tl.arange(0, BLOCK_N)
        col_ok = cols < L
        s, visible = _scores(q, _key_tile_t(k_base, cols, col_ok, d, d_ok, skl, DOT), cols, col_ok, scale, rows,
                             row_ok, b, h, L, bias_ptr, key_ptr, seg_ptr, seg_q, HAS_BIAS, HAS_KEY, HAS_SEG, ACC)
        p = tl.exp(s - lse[:, None])
        vt = tl.load(v_base + cols[None, :].to(tl.int64) * svl + d[:, None], mask=col_ok[None, :] & d_ok[:, None],
                     other=0.0).to(DOT)
        dp = tl.dot(do, vt, out_dtype=ACC, input_precision="ieee")
        if DROPOUT:
            dp = tl.where(_keep_tile(seed, bh, rows, k0, threshold, BLOCK_M, BLOCK_N), dp * inv_keep, 0.0)
        ds = tl.where(visible, p * (dp - delta[:, None]), 0.0)
        k = tl.load(k_base + cols[:, None].to(tl.int64) * skl + d[None, :], mask=col_ok[:, None] & d_ok[None, :],
                    other=0.0).to(DOT)
        dq += tl.dot(ds.to(DOT), k, out_dtype=ACC, input_precision="ieee")
    tl.store(dq_ptr + at[:, None] * D + d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty), mask=tile_ok)


@triton.jit
def _attention_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dtable_ptr, bias_ptr, spans_ptr, key_ptr,
    seg_ptr, scale_ptr, inv_keep_ptr, seed, threshold, L, NH, D, NB, sqb, sqh, sql, skb, skh, skl, svb, svh, svl,
    sdb, sdh, sdl, HAS_BIAS: tl.constexpr, HAS_KEY: tl.constexpr, HAS_SEG: tl.constexpr, DROPOUT: tl.constexpr,
    GRAD_TABLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ACC: tl.constexpr, DOT: tl.constexpr,
):
    """dK, dV of one key block (``dk``, ``dv`` contiguous [B, heads, L, D]) and, with ``GRAD_TABLE``, each dS
    tile's per-bucket sums, stored at ``dtable[bh, key block, query block, bucket]`` (zeros where a tile has no
    such bucket): each element written once, by one program, without a vector carried through the loop."""
    bh = tl.program_id(1)
    b = bh // NH
    h = bh % NH
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < L
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    kv_ok = col_ok[:, None] & d_ok[None, :]
    scale = tl.load(scale_ptr)
    inv_keep = tl.load(inv_keep_ptr)
    k_base = k_ptr + b.to(tl.int64) * skb + h * skh
    kt = _key_tile_t(k_base, cols, col_ok, d, d_ok, skl, DOT)
    vt = tl.load(v_ptr + b.to(tl.int64) * svb + h * svh + cols[None, :].to(tl.int64) * svl + d[:, None],
                 mask=col_ok[None, :] & d_ok[:, None], other=0.0).to(DOT)
    q_base = q_ptr + b.to(tl.int64) * sqb + h * sqh
    do_base = do_ptr + b.to(tl.int64) * sdb + h * sdh
    row_base = bh.to(tl.int64) * L
    dk = tl.zeros((BLOCK_N, BLOCK_D), ACC)
    dv = tl.zeros((BLOCK_N, BLOCK_D), ACC)
    for q0 in range(0, L, BLOCK_M):
        rows = q0 + tl.arange(0, BLOCK_M)
        row_ok = rows < L
        tile_ok = row_ok[:, None] & d_ok[None, :]
        q = tl.load(q_base + rows[:, None].to(tl.int64) * sql + d[None, :], mask=tile_ok, other=0.0).to(DOT)
        seg_q = rows
        if HAS_SEG:
            seg_q = tl.load(seg_ptr + b * L + rows, mask=row_ok, other=-1)
        s, visible = _scores(q, kt, cols, col_ok, scale, rows, row_ok, b, h, L, bias_ptr, key_ptr, seg_ptr,
                             seg_q, HAS_BIAS, HAS_KEY, HAS_SEG, ACC)
        # rows past the length: lse = +inf, so p = 0
        p = tl.exp(s - tl.load(lse_ptr + row_base + rows, mask=row_ok, other=float("inf"))[:, None])
        do = tl.load(do_base + rows[:, None].to(tl.int64) * sdl + d[None, :], mask=tile_ok, other=0.0).to(DOT)
        dp = tl.dot(do, vt, out_dtype=ACC, input_precision="ieee")
        if DROPOUT:
            keep = _keep_tile(seed, bh, rows, tl.program_id(0) * BLOCK_N, threshold, BLOCK_M, BLOCK_N)
            dv += tl.dot(tl.trans(tl.where(keep, p, 0.0).to(DOT)), do, out_dtype=ACC, input_precision="ieee")
            dp = tl.where(keep, dp * inv_keep, 0.0)
        else:
            dv += tl.dot(tl.trans(p.to(DOT)), do, out_dtype=ACC, input_precision="ieee")
        delta = tl.load(delta_ptr + row_base + rows, mask=row_ok, other=0.0)
        ds = tl.where(visible & row_ok[:, None], p * (dp - delta[:, None]), 0.0)
        dk += tl.dot(tl.trans(ds.to(DOT)), q, out_dtype=ACC, input_precision="ieee")
        if GRAD_TABLE:
            # offsets k - q + L - 1 of the tile (ds is 0 off its valid part) and the range they span
            index = cols[None, :] - rows[:, None] + L - 1
            first = tl.program_id(0) * BLOCK_N - tl.minimum(q0 + BLOCK_M, L) + L
            last = tl.minimum(tl.program_id(0) * BLOCK_N + BLOCK_N, L) - 1 - q0 + L - 1
            tile = dtable_ptr + ((bh.to(tl.int64) * tl.num_programs(0) + tl.program_id(0)) * tl.cdiv(L, BLOCK_M)
                                 + q0 // BLOCK_M) * NB
            for bucket in range(NB):
                low = tl.load(spans_ptr + 2 * bucket)
                high = tl.load(spans_ptr + 2 * bucket + 1)
                if (low <= last) & (high >= first):
                    inside = (index >= low) & (index <= high)
                    tl.store(tile + bucket, tl.sum(tl.sum(tl.where(inside, ds, 0.0), axis=1), axis=0))
    if DROPOUT:
        dv = dv * inv_keep
    at = row_base + cols
    tl.store(dk_ptr + at[:, None] * D + d[None, :], (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_ok)
    tl.store(dv_ptr + at[:, None] * D + d[None, :], dv.to(dv_ptr.dtype.element_ty), mask=kv_ok)


@triton.jit
def _attention_keep_kernel(out_ptr, seed, threshold, L, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k0 = tl.program_id(1) * BLOCK_N
    cols = k0 + tl.arange(0, BLOCK_N)
    keep = _keep_tile(seed, bh, rows, k0, threshold, BLOCK_M, BLOCK_N)
    tl.store(out_ptr + (bh.to(tl.int64) * L + rows[:, None]) * L + cols[None, :], keep.to(tl.int8),
             mask=(rows < L)[:, None] & (cols < L)[None, :])


def keep_mask_triton(seed: int, p: float, batch_heads: int, length: int, device: torch.device) -> torch.Tensor:
    """The [batch x heads, L, L] bool keep mask the kernels apply for ``seed`` and ``p``."""
    out = torch.empty(batch_heads, length, length, dtype=torch.int8, device=device)
    launch = LaunchConfig.of(BLOCK_M=16, BLOCK_N=16)
    grid = (triton.cdiv(length, 16), triton.cdiv(length, 16), batch_heads)
    _attention_keep_kernel[grid](out, seed, dropout_threshold(p)[0], length, **launch.kwargs())
    return out.bool()


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _scalars(dim: int, inv_keep: float, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The score scale 1/sqrt(d) and the kept values' scale as one-element tensors in the accumulator dtype
    (a float argument would be fp32: 1e-8 off in fp64), made by a fill (no host-device copy)."""
    return tuple(torch.full((1,), value, dtype=dtype, device=device) for value in (dim ** -0.5, inv_keep))


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class _RelativeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, table, buckets, key_mask, segment_ids, p, seed):
        q, k, v = _last_dim_dense(q), _last_dim_dense(k), _last_dim_dense(v)
        batch, heads, length, dim = q.shape
        acc_t, acc_tl, dot_tl = _dtypes(q)
        has_bias = table is not None
        # [heads, 2L - 1]: the bias of each offset k - q (a gather of 2L - 1 table rows)
        bias = table[buckets.long()].t().contiguous() if has_bias else q
        buckets_c = buckets.to(torch.int32) if has_bias else q
        # a bool mask is read as its bytes: no copy
        key_c = (key_mask.view(torch.int8) if key_mask.dtype == torch.bool else key_mask.ne(0).view(torch.int8)
                 ).contiguous() if key_mask is not None else q
        seg_c = segment_ids.to(torch.int32).contiguous() if segment_ids is not None else q
        threshold, inv_keep = dropout_threshold(p) if p > 0 else (0, 1.0)
        flags = dict(HAS_BIAS=has_bias, HAS_KEY=key_mask is not None, HAS_SEG=segment_ids is not None,
                     DROPOUT=p > 0, BLOCK_D=max(16, triton.next_power_of_2(dim)), ACC=acc_tl, DOT=dot_tl)
        dims = (length, heads, dim, *_strides(q), *_strides(k), *_strides(v))
        # [B, L, heads, d] memory seen as [B, heads, L, d]: the output projection reads it as [B, L, H], a view
        out = torch.empty(batch, length, heads, dim, dtype=q.dtype, device=q.device).transpose(1, 2)
        lse = torch.empty(batch * heads, length, dtype=acc_t, device=q.device)
        config = _config("forward", q, dot_tl)
        _attention_forward_kernel[(triton.cdiv(length, config["BLOCK_M"]), batch * heads)](
            q, k, v, out, lse, bias, key_c, seg_c, *_scalars(dim, inv_keep, acc_t, q.device), seed,
            threshold, *dims, *_strides(out), **flags, **config.kwargs())
        ctx.save_for_backward(q, k, v, out, lse, bias, buckets_c, key_c, seg_c)
        ctx.meta = (seed, threshold, inv_keep, dims, flags, table.dtype if has_bias else None,
                    table.shape[0] if has_bias else 0)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, bias, buckets, key_c, seg_c = ctx.saved_tensors
        seed, threshold, inv_keep, dims, flags, table_dtype, num_buckets = ctx.meta
        batch, heads, length, dim = q.shape
        grad_out = _last_dim_dense(grad_out)
        dq, dk, dv = (torch.empty(batch, heads, length, dim, dtype=q.dtype, device=q.device) for _ in range(3))
        delta = torch.empty_like(lse)
        grad_table = flags["HAS_BIAS"] and ctx.needs_input_grad[3]
        spans = bucket_spans(buckets, num_buckets) if grad_table else lse
        common = (bias, spans, key_c, seg_c, *_scalars(dim, inv_keep, lse.dtype, q.device), seed, threshold,
                  *dims[:3])
        strides = dims[3:]
        config = _config("backward_dq", q, flags["DOT"])
        _attention_dq_kernel[(triton.cdiv(length, config["BLOCK_M"]), batch * heads)](
            q, k, v, out, grad_out, lse, delta, dq, *common, *strides, *_strides(out), *_strides(grad_out),
            **flags, **config.kwargs())
        config = _config("backward_dkdv", q, flags["DOT"])
        key_blocks = triton.cdiv(length, config["BLOCK_N"])
        query_blocks = triton.cdiv(length, config["BLOCK_M"])
        parts = torch.zeros(batch, heads, key_blocks * query_blocks, num_buckets, dtype=lse.dtype, device=q.device) \
            if grad_table else lse
        _attention_dkdv_kernel[(key_blocks, batch * heads)](
            q, k, v, grad_out, lse, delta, dk, dv, parts, *common, num_buckets, *strides, *_strides(grad_out),
            GRAD_TABLE=grad_table, **flags, **config.kwargs())
        dtable = None
        if grad_table:
            dtable = parts.sum((0, 2)).t().to(table_dtype)
        return dq, dk, dv, dtable, None, None, None, None, None


def relative_attention_triton(q, k, v, table, buckets, key_mask, segment_ids, p: float, seed: int) -> torch.Tensor:
    """Triton path of :func:`kernels.attention.relative_attention` (arguments checked there)."""
    return _RelativeAttention.apply(q, k, v, table, buckets, key_mask, segment_ids, p, seed)
