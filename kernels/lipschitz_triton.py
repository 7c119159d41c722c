"""Triton kernels for :mod:`kernels.lipschitz` (imported lazily by the dispatcher).

All matrices go to one launch: a table of data pointers, shapes and strides is indexed by
``program_id(0)`` (the matrix) while ``program_id(1)`` picks a block of columns. The backward
kernel writes ``grad_output * sign(W[:, j])`` into the maximizing column of each zeroed gradient,
again in one launch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

_BLOCK_R = 32
_BLOCK_C = 32


@triton.jit
def _colsum_kernel(ptrs, shapes, strides, out_ptr, out_stride,
                   DTYPE: tl.constexpr, ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    m = tl.program_id(0)
    n_rows = tl.load(shapes + 2 * m)
    n_cols = tl.load(shapes + 2 * m + 1)
    s_row = tl.load(strides + 2 * m)
    s_col = tl.load(strides + 2 * m + 1)
    w_ptr = tl.load(ptrs + m).to(tl.pointer_type(DTYPE))
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < n_cols
    acc = tl.zeros((BLOCK_C,), ACC)
    for r0 in range(0, n_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * s_row + cols[None, :].to(tl.int64) * s_col,
                    mask=(rows < n_rows)[:, None] & col_ok[None, :], other=0.0)
        acc += tl.sum(tl.abs(w.to(ACC)), axis=0)
    # Rows of out are pre-filled with -1 so padding columns never win the max.
    tl.store(out_ptr + m * out_stride + cols, acc, mask=col_ok)


@triton.jit
def _sign_grad_kernel(w_ptrs, g_ptrs, shapes, strides, argmax_ptr, gout_ptr,
                      DTYPE: tl.constexpr, BLOCK_R: tl.constexpr):
    m = tl.program_id(0)
    n_rows = tl.load(shapes + 2 * m)
    n_cols = tl.load(shapes + 2 * m + 1)
    s_row = tl.load(strides + 2 * m)
    s_col = tl.load(strides + 2 * m + 1)
    w_ptr = tl.load(w_ptrs + m).to(tl.pointer_type(DTYPE))
    g_ptr = tl.load(g_ptrs + m).to(tl.pointer_type(DTYPE))
    j = tl.load(argmax_ptr + m)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < n_rows
    w = tl.load(w_ptr + rows.to(tl.int64) * s_row + j * s_col, mask=ok, other=0.0)
    sign = tl.where(w > 0, 1.0, tl.where(w < 0, -1.0, 0.0))
    g = sign * tl.load(gout_ptr)
    tl.store(g_ptr + rows.to(tl.int64) * n_cols + j, g.to(DTYPE), mask=ok)


def _tables(weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dev = weights[0].device
    ptrs = torch.tensor([w.data_ptr() for w in weights], dtype=torch.int64, device=dev)
    shapes = torch.tensor([list(w.shape) for w in weights], dtype=torch.int64, device=dev)
    strides = torch.tensor([list(w.stride()) for w in weights], dtype=torch.int64, device=dev)
    return ptrs, shapes, strides


def _dtypes(t: torch.Tensor):
    table = {torch.float64: tl.float64, torch.float32: tl.float32, torch.float16: tl.float16,
             torch.bfloat16: tl.bfloat16}
    acc = tl.float64 if t.dtype == torch.float64 else tl.float32
    return table[t.dtype], acc


def column_abs_sums_triton(weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per matrix: max column absolute sum and its column index, from a single kernel launch."""
    ptrs, shapes, strides = _tables(weights)
    max_cols = max(w.shape[1] for w in weights)
    acc_t = torch.float64 if weights[0].dtype == torch.float64 else torch.float32
    out = torch.full((len(weights), max_cols), -1.0, dtype=acc_t, device=weights[0].device)
    dtype, acc = _dtypes(weights[0])
    grid = (len(weights), triton.cdiv(max_cols, _BLOCK_C))
    _colsum_kernel[grid](ptrs, shapes, strides, out, out.stride(0),
                         DTYPE=dtype, ACC=acc, BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C)
    values, argmax = out.max(dim=1)
    return values.to(weights[0].dtype), argmax


def column_sign_grads_triton(weights: Sequence[torch.Tensor], argmax: torch.Tensor,
                             grad_out: torch.Tensor) -> list[torch.Tensor]:
    """Zero gradients with ``grad_out * sign(W[:, j])`` in each maximizing column, one launch."""
    grads = [torch.zeros(w.shape, dtype=w.dtype, device=w.device) for w in weights]
    ptrs, shapes, strides = _tables(weights)
    gptrs = torch.tensor([g.data_ptr() for g in grads], dtype=torch.int64, device=ptrs.device)
    dtype, _ = _dtypes(weights[0])
    gout = grad_out.reshape(1).to(weights[0].dtype)
    grid = (len(weights), triton.cdiv(max(w.shape[0] for w in weights), _BLOCK_R))
    _sign_grad_kernel[grid](ptrs, gptrs, shapes, strides, argmax.contiguous(), gout,
                            DTYPE=dtype, BLOCK_R=_BLOCK_R)
    return grads
