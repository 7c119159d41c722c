"""Triton kernels for :mod:`kernels.lipschitz` (imported lazily by the dispatcher).

All matrices of one dtype go to one launch: a table of data pointers, shapes and strides is indexed
by ``program_id(0)`` (the matrix) while ``program_id(1)`` picks a block of columns. The backward
kernel writes ``grad_output * sign(W[:, j])`` into the maximizing column of each zeroed gradient,
again in one launch. Sums and sign tests run in fp32 (fp64 for fp64 weights), loaded as such.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .launch import LaunchConfig
from .linear_head_triton import TL_DTYPES

_COLSUM = LaunchConfig.of(BLOCK_R=32, BLOCK_C=32)
_SIGN_GRAD = LaunchConfig.of(BLOCK_R=32)


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
                      DTYPE: tl.constexpr, ACC: tl.constexpr, BLOCK_R: tl.constexpr):
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
    # Compared in ACC: the interpreter compares 16-bit floats on their raw bits.
    w = tl.load(w_ptr + rows.to(tl.int64) * s_row + j * s_col, mask=ok, other=0.0).to(ACC)
    sign = tl.where(w > 0, 1.0, tl.where(w < 0, -1.0, 0.0))
    g = sign * tl.load(gout_ptr)
    tl.store(g_ptr + rows.to(tl.int64) * n_cols + j, g.to(DTYPE), mask=ok)


def _table(values: list, device: torch.device) -> torch.Tensor:
    # Built on the host and copied without waiting (a blocking copy to a GPU is a host-device sync).
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def _tables(weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dev = weights[0].device
    return (_table([w.data_ptr() for w in weights], dev), _table([list(w.shape) for w in weights], dev),
            _table([list(w.stride()) for w in weights], dev))


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _by_dtype(weights: Sequence[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    """Indices of the weights of each dtype: one launch per dtype (a launch reads one element type)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, w in enumerate(weights):
        groups.setdefault(w.dtype, []).append(i)
    return groups


def column_abs_sums_triton(weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per matrix: max column absolute sum (fp32; fp64 if any weight is fp64) and its column index."""
    acc_t = torch.float64 if any(w.dtype == torch.float64 for w in weights) else torch.float32
    dev = weights[0].device
    values = torch.empty(len(weights), dtype=acc_t, device=dev)
    argmax = torch.empty(len(weights), dtype=torch.int64, device=dev)
    for dtype, idx in _by_dtype(weights).items():
        group = [weights[i] for i in idx]
        ptrs, shapes, strides = _tables(group)
        max_cols = max(w.shape[1] for w in group)
        out = torch.full((len(group), max_cols), -1.0, dtype=_acc(dtype), device=dev)
        grid = (len(group), triton.cdiv(max_cols, _COLSUM["BLOCK_C"]))
        _colsum_kernel[grid](ptrs, shapes, strides, out, out.stride(0),
                             DTYPE=TL_DTYPES[dtype], ACC=TL_DTYPES[_acc(dtype)], **_COLSUM.kwargs())
        group_values, group_argmax = out.max(dim=1)
        where = _table(idx, dev)
        values[where] = group_values.to(acc_t)
        argmax[where] = group_argmax
    return values, argmax


def column_sign_grads_triton(weights: Sequence[torch.Tensor], argmax: torch.Tensor,
                             grad_out: torch.Tensor) -> list[torch.Tensor]:
    """Zero gradients with ``grad_out * sign(W[:, j])`` in each maximizing column, one launch per dtype."""
    grads = [torch.zeros(w.shape, dtype=w.dtype, device=w.device) for w in weights]
    for dtype, idx in _by_dtype(weights).items():
        group = [weights[i] for i in idx]
        ptrs, shapes, strides = _tables(group)
        gptrs = _table([grads[i].data_ptr() for i in idx], ptrs.device)
        acc_t = _acc(dtype)
        grid = (len(group), triton.cdiv(max(w.shape[0] for w in group), _SIGN_GRAD["BLOCK_R"]))
        _sign_grad_kernel[grid](ptrs, gptrs, shapes, strides, argmax[_table(idx, ptrs.device)].contiguous(),
                                grad_out.reshape(1).to(acc_t), DTYPE=TL_DTYPES[dtype], ACC=TL_DTYPES[acc_t],
                                **_SIGN_GRAD.kwargs())
    return grads
