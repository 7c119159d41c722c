"""Triton kernel for :func:`kernels.rtd_loss.fused_rtd_loss` (imported lazily by the dispatcher).

One program owns ``BLOCK_N`` rows and the whole hidden width (``BLOCK_H = next_pow2(H)``), so each
row of ``hidden`` is read once: logit, BCE, d(loss)/d(logit), the row's ``grad_hidden`` and the
program's partial ``grad_weight`` all come out of that single read. Partials are summed in torch
(deterministic, no atomics). Gradients are computed unscaled in forward; backward multiplies them by
``grad_output / count``.

Any float dtype goes in (fp32, bf16, fp16, and bf16 activations with fp32 head weights): every load
is converted to ``ACC`` (fp32; fp64 for fp64 inputs) at once, so the logit, the BCE and the gradients
are computed in fp32 (Triton's exp/log accept nothing narrower, and the interpreter cannot compute
16-bit arithmetic). The loss is returned in ``ACC``; each gradient in its input's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import LaunchConfig

_MAX_BLOCK_ELEMS = 8192  # BLOCK_N * BLOCK_H held in registers per program


@triton.jit
def _rtd_kernel(
    h_ptr, w_ptr, b_ptr, corr_ptr, orig_ptr, mask_ptr,
    loss_ptr, gh_ptr, gw_part_ptr, gb_part_ptr,
    N, H, stride_h,
    COMPUTE_GRAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < N
    col_ok = cols < H
    tile_ok = row_ok[:, None] & col_ok[None, :]
    h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + cols[None, :], mask=tile_ok, other=0.0).to(ACC)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(ACC)
    b = tl.load(b_ptr).to(ACC)
    z = tl.sum(h * w[None, :], axis=1) + b
    y = (tl.load(corr_ptr + rows, mask=row_ok, other=0) != tl.load(orig_ptr + rows, mask=row_ok, other=0))
    y = y.to(ACC)
    keep = (tl.load(mask_ptr + rows, mask=row_ok, other=0) != 0) & row_ok
    keep_f = keep.to(ACC)
    # Stable BCE-with-logits: max(z, 0) - z*y + log(1 + exp(-|z|)).
    loss = tl.maximum(z, 0.0) - z * y + tl.log(1.0 + tl.exp(-tl.abs(z)))
    tl.store(loss_ptr + rows, loss * keep_f, mask=row_ok)
    if COMPUTE_GRAD:
        dz = (tl.sigmoid(z) - y) * keep_f
        tl.store(gh_ptr + rows[:, None].to(tl.int64) * H + cols[None, :], dz[:, None] * w[None, :], mask=tile_ok)
        tl.store(gw_part_ptr + pid * H + cols, tl.sum(dz[:, None] * h, axis=0), mask=col_ok)
        tl.store(gb_part_ptr + pid, tl.sum(dz, axis=0))


class _RTDTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, corrupted, original, mask):
        n, h = hidden.shape
        if hidden.stride(1) != 1:
            hidden = hidden.contiguous()
        weight = weight.contiguous()
        block_h = triton.next_power_of_2(max(h, 1))
        if block_h > _MAX_BLOCK_ELEMS:
            raise ValueError(f"fused_rtd_loss: hidden size {h} exceeds the Triton kernel limit {_MAX_BLOCK_ELEMS}")
        block_n = max(1, min(64, _MAX_BLOCK_ELEMS // block_h, triton.next_power_of_2(max(n, 1))))
        launch = LaunchConfig.of(BLOCK_N=block_n, BLOCK_H=block_h)
        grid_n = triton.cdiv(n, block_n)
        compute_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        acc, acc_tl = (torch.float64, tl.float64) if hidden.dtype == torch.float64 else (torch.float32, tl.float32)
        loss_rows = torch.empty(n, device=hidden.device, dtype=acc)
        if compute_grad:
            gh = torch.empty(n, h, device=hidden.device, dtype=acc)
            gw_part = torch.empty(grid_n, h, device=hidden.device, dtype=acc)
            gb_part = torch.empty(grid_n, device=hidden.device, dtype=acc)
        else:
            gh = gw_part = gb_part = loss_rows  # never written
        mask_i8 = mask.to(torch.int8)
        if grid_n > 0:
            _rtd_kernel[(grid_n,)](
                hidden, weight, bias, corrupted, original, mask_i8,
                loss_rows, gh, gw_part, gb_part,
                n, h, hidden.stride(0),
                COMPUTE_GRAD=compute_grad, ACC=acc_tl, **launch.kwargs(),
            )
        count = mask_i8.sum().to(acc).clamp(min=1.0)
        loss = loss_rows.sum() / count
        if compute_grad:
            ctx.save_for_backward(gh, gw_part.sum(0), gb_part.sum(), count)
            ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        gh, gw, gb, count = ctx.saved_tensors
        scale = grad_out.to(gh.dtype) / count
        dt_h, dt_w, dt_b = ctx.dtypes
        return (gh * scale).to(dt_h), (gw * scale).to(dt_w), (gb * scale).to(dt_b), None, None, None


def rtd_loss_triton(hidden, weight, bias, corrupted, original, mask) -> torch.Tensor:
    """Triton path of ``fused_rtd_loss`` (``bias`` is a 0-d tensor here)."""
    return _RTDTriton.apply(hidden, weight, bias, corrupted, original, mask)
