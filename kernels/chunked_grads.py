"""Row-chunked gradients of a linear head's loss, shared by the torch path (kernels/linear_head.py, in its
forward) and the Triton path's chunked backward (kernels/linear_head_triton.py, from d(loss)/d(logits)
chunks its kernel writes): the products run in the operands' dtypes and accumulate in fp32 (fp64 for
fp64 inputs), and no [rows x V] tensor outlives its chunk.
"""

from __future__ import annotations

import torch


def rows_per_chunk(n: int, v: int, elems: int) -> int:
    """Rows of a [rows x v] chunk of at most ``elems`` elements (at least one row)."""
    return max(1, min(n, elems // max(v, 1)))


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` in ``out_dtype``. 16-bit operands on CUDA accumulate straight into an fp32 result (cuBLAS,
    as the Triton kernels' ``tl.dot`` does); on the CPU, which has no such GEMM, the product is rounded to
    the operands' dtype first."""
    if a.dtype == out_dtype:
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=out_dtype)
    return (a @ b).to(out_dtype)


def _addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``c + a @ b`` in ``c``'s dtype, in place where the dtypes allow (returns the result)."""
    b = b.to(a.dtype)
    if a.dtype == c.dtype:
        return c.addmm_(a, b)
    if a.is_cuda:
        return torch.addmm(c, a, b, out_dtype=c.dtype)
    return c.add_((a @ b).to(c.dtype))


def chunked_grads(hidden, weight, wants, step, chunk_terms):
    """Sum a loss over row chunks of ``hidden @ weight.T (+ bias)`` and build its gradients as it goes.

    ``wants`` = (grad_hidden?, grad_weight?, grad_bias?). ``chunk_terms(r0, h, grad)`` returns (this
    chunk's loss or None, d(chunk loss)/d(logits) or None when no gradient is needed, per-row scale
    [rows, 1] of that gradient or None, this chunk's bias gradient or None to take it from the former
    two). The products run in ``dz``'s and ``weight``'s dtypes and accumulate in fp32 (fp64 for fp64
    ``hidden``), so no [rows x V] tensor outlives its chunk. Used by the torch path's forward and by the
    Triton path's chunked backward. Returns (loss, grad_hidden, grad_weight, grad_bias), None where not wanted.
    """
    acc = acc_dtype(hidden)
    want_h, want_w, want_b = wants
    gh = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if want_h else None
    gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
    gb = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if want_b else None
    total = torch.zeros((), dtype=acc, device=hidden.device)
    for r0 in range(0, hidden.shape[0], step):
        h = hidden[r0 : r0 + step]
        loss, dz, row_scale, bias = chunk_terms(r0, h, want_h or want_w or want_b)
        if loss is not None:
            total += loss
        if dz is None:
            continue
        if want_h:
            part = _mm(dz.to(weight.dtype), weight, acc)
            gh[r0 : r0 + step] = part if row_scale is None else part.mul_(row_scale)
        if want_w:
            gw = _addmm(gw, dz.t(), h if row_scale is None else h.to(acc) * row_scale)
        if want_b:
            gb = gb.add_(bias) if bias is not None else gb.addmv_(dz.t(), row_scale.squeeze(1))
        del dz
    return total, gh, gw, gb
