"""Triton kernels for :mod:`kernels.linear_head` (imported lazily by the dispatcher).

Forward: one program per block of ``BLOCK_N`` rows walks the vocabulary in ``BLOCK_V`` tiles; each
logit tile is a ``tl.dot`` over ``BLOCK_H`` slices of the hidden size and is folded into an online
softmax (running max and sum, and for KL the running teacher-weighted log-ratio), so only O(N)
numbers leave the kernel: per-row loss and log-sum-exp. Backward: one program per (row block,
vocab tile) recomputes its logit tile, forms d(loss)/d(logits) from the saved log-sum-exp, and
atomically adds its contributions to ``grad_hidden``, ``grad_weight`` and ``grad_bias``. Nothing of
size [N x V] is ever allocated. Float32 atomics make the Triton gradients non-bitwise-deterministic
on GPU (summation order); use the torch path where bitwise determinism matters.

Dtypes: hidden states and weights may be fp32, bf16 or fp16, and may differ (bf16 activations with
fp32 weights, as under autocast). Every tile is converted once, at load, to the matmul dtype
``DOT`` (the 16-bit activation dtype on GPU, so ``tl.dot`` uses the tensor cores as autocast's
matmul would; fp32 or fp64 otherwise), and everything after the matmul (softmax, logs, sums, atomics)
runs in ``ACC`` = fp32 (fp64 for fp64 inputs). The interpreter cannot compute 16-bit arithmetic
(it operates on raw bits), so under ``TRITON_INTERPRET=1`` ``DOT`` is ``ACC``: the same kernels,
verifiable on CPU on the same rounded inputs; what this leaves for a GPU to confirm is in
docs/decisions.md ("Kernel dtypes").

Launch configurations are fixed per kernel, matmul dtype and GPU generation (:data:`HEAD_CONFIGS`; no
autotune: the interpreter rejects multi-config autotuning); docs/decisions.md ("Launch configurations")
gives the compile table they were chosen from.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import cuda_target, triton_interpret
from .launch import LaunchConfig

# torch -> Triton element types, for the constexpr dtypes of this module and of lipschitz_triton.
TL_DTYPES = {torch.float64: tl.float64, torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
       torch.float16: tl.float16}

# (kernel, matmul class, generation) -> launch. The matmul class is "16bit" (bf16/fp16 tensor-core dots),
# "tf32" (fp32 inputs on TF32 tensor cores) or "fp32" (IEEE fp32 products on the CUDA cores). Every entry
# compiles without a register spill at production shapes for sm_80 and sm_90a (tools/compile_kernels.py);
# docs/decisions.md ("Launch configurations") has the table each was chosen from.
_TENSOR_CORE = LaunchConfig.of(num_warps=8, BLOCK_N=64, BLOCK_V=128, BLOCK_H=32)
_FP32 = LaunchConfig.of(num_warps=8, BLOCK_N=64, BLOCK_V=128, BLOCK_H=16)  # half-depth k-steps: operand registers
_FP32_NARROW = LaunchConfig.of(num_warps=8, BLOCK_N=64, BLOCK_V=64, BLOCK_H=32)  # two logit tiles, half as wide
_SAMPLE = LaunchConfig.of(num_warps=8, BLOCK_N=32, BLOCK_V=128, BLOCK_H=32)  # float64 Gumbel tiles: 32 rows
_KERNELS = ("forward", "forward_kl", "backward", "backward_kl", "sample")
HEAD_CONFIGS: dict[tuple[str, str, str], LaunchConfig] = {
    **{(kernel, matmul, generation): _SAMPLE if kernel == "sample" else _TENSOR_CORE
       for kernel in _KERNELS for matmul in ("16bit", "tf32") for generation in ("sm80", "sm90")},
    **{(kernel, "fp32", generation): _SAMPLE if kernel == "sample" else _FP32
       for kernel in _KERNELS for generation in ("sm80", "sm90")},
    # sm_80's ptxas holds this kernel to 128 registers at 64 x 128 x 16 and spills 32 B; sm_90a's uses 200.
    ("backward_kl", "fp32", "sm80"): _FP32_NARROW,
}
# Under the interpreter: small tiles, so that small test shapes span several tiles (tests also run the
# tiles HEAD_CONFIGS ships, by setting this).
INTERPRETER_CONFIG = LaunchConfig.of(BLOCK_N=16, BLOCK_V=32, BLOCK_H=16)


def _dtypes(hidden: torch.Tensor) -> tuple[torch.dtype, tl.dtype, tl.dtype, str]:
    """(accumulator torch dtype, ACC, DOT, input precision) for a head whose activations are ``hidden``."""
    acc_t, acc = (torch.float64, tl.float64) if hidden.dtype == torch.float64 else (torch.float32, tl.float32)
    if hidden.dtype in (torch.bfloat16, torch.float16) and not triton_interpret():
        return acc_t, acc, TL_DTYPES[hidden.dtype], "ieee"  # 16-bit dots: the precision flag is for fp32 only
    # Match torch: fp32 matmuls use TF32 only when torch itself is allowed to.
    tf32 = acc is tl.float32 and not triton_interpret() and torch.backends.cuda.matmul.allow_tf32
    return acc_t, acc, acc, "tf32" if tf32 else "ieee"


def _config(kernel: str, hidden: torch.Tensor, dot: tl.dtype, prec: str) -> LaunchConfig:
    """The launch of ``kernel`` ("forward", "backward", "forward_kl", "backward_kl", "sample") for these
    activations and matmul dtype ``dot``: :data:`INTERPRETER_CONFIG` under the interpreter."""
    if triton_interpret():
        return INTERPRETER_CONFIG
    matmul = "16bit" if dot in (tl.bfloat16, tl.float16) else "tf32" if prec == "tf32" else "fp32"
    return HEAD_CONFIGS[kernel, matmul, cuda_target(hidden.device).generation]


@triton.jit
def _logit_tile(
    h_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
):
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=ACC)
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_ok = ks < H
        a = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT)
        b = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_w + ks[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0).to(DOT)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(ACC)[None, :]
    return acc


@triton.jit
def _forward_kernel(
    hs_ptr, ws_ptr, bs_ptr, ht_ptr, wt_ptr, bt_ptr, tgt_ptr,
    m_s_ptr, z_s_ptr, m_t_ptr, z_t_ptr, a_t_ptr, z_tgt_ptr,
    N, V, Hs, Ht, stride_hs, stride_ws, stride_ht, stride_wt, inv_tau_ptr, V_PER_SPLIT,
    KL: tl.constexpr, HAS_BS: tl.constexpr, HAS_BT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
):
    """Online-softmax partials of one row block over one vocabulary split (``program_id(1)``), stored at
    ``[split, row]``: running max and sum of the student (and teacher) logits, the teacher-weighted
    log-ratio for KL, the target's logit for CE. The host combines the splits."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    v_begin = tl.program_id(1) * V_PER_SPLIT
    v_end = tl.minimum(v_begin + V_PER_SPLIT, V)
    m_s = tl.full((BLOCK_N,), float("-inf"), ACC)
    z_s = tl.zeros((BLOCK_N,), ACC)
    m_t = tl.full((BLOCK_N,), float("-inf"), ACC)
    z_t = tl.zeros((BLOCK_N,), ACC)
    a_t = tl.zeros((BLOCK_N,), ACC)  # sum exp(t - m_t) * (t - s): the teacher-weighted log-ratio
    z_tgt = tl.zeros((BLOCK_N,), ACC)
    inv_tau = tl.load(inv_tau_ptr)
    if KL:
        target = rows  # unused
    else:
        target = tl.load(tgt_ptr + rows, mask=row_ok, other=0)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_end
        s_raw = _logit_tile(hs_ptr, ws_ptr, bs_ptr, rows, cols, row_ok, col_ok, Hs, stride_hs, stride_ws,
                            HAS_BS, BLOCK_N, BLOCK_V, BLOCK_H, ACC, DOT, PREC) * inv_tau
        s = tl.where(col_ok[None, :], s_raw, float("-inf"))
        m_new = tl.maximum(m_s, tl.max(s, axis=1))
        z_s = z_s * tl.exp(m_s - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m_s = m_new
        if KL:
            t_raw = _logit_tile(ht_ptr, wt_ptr, bt_ptr, rows, cols, row_ok, col_ok, Ht, stride_ht, stride_wt,
                                HAS_BT, BLOCK_N, BLOCK_V, BLOCK_H, ACC, DOT, PREC) * inv_tau
            t = tl.where(col_ok[None, :], t_raw, float("-inf"))
            mt_new = tl.maximum(m_t, tl.max(t, axis=1))
            alpha = tl.exp(m_t - mt_new)
            e = tl.exp(t - mt_new[:, None])
            z_t = z_t * alpha + tl.sum(e, axis=1)
            # e is 0 on padding columns, and the raw logits keep t - s finite there
            a_t = a_t * alpha + tl.sum(e * (t_raw - s_raw), axis=1)
            m_t = mt_new
        else:
            z_tgt += tl.sum(tl.where(cols[None, :] == target[:, None], s, 0.0), axis=1)
    at = tl.program_id(1) * N + rows
    tl.store(m_s_ptr + at, m_s, mask=row_ok)
    tl.store(z_s_ptr + at, z_s, mask=row_ok)
    if KL:
        tl.store(m_t_ptr + at, m_t, mask=row_ok)
        tl.store(z_t_ptr + at, z_t, mask=row_ok)
        tl.store(a_t_ptr + at, a_t, mask=row_ok)
    else:
        tl.store(z_tgt_ptr + at, z_tgt, mask=row_ok)


@triton.jit
def _backward_kernel(
    hs_ptr, ws_ptr, bs_ptr, ht_ptr, wt_ptr, bt_ptr, tgt_ptr,
    lse_s_ptr, lse_t_ptr, scale_ptr, gh_ptr, gw_ptr, gb_ptr,
    N, V, Hs, Ht, stride_hs, stride_ws, stride_ht, stride_wt, inv_tau_ptr, ignore_index,
    KL: tl.constexpr, HAS_BS: tl.constexpr, HAS_BT: tl.constexpr,
    GRAD_H: tl.constexpr, GRAD_W: tl.constexpr, GRAD_B: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
):
    inv_tau = tl.load(inv_tau_ptr)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    col_ok = cols < V
    s = _logit_tile(hs_ptr, ws_ptr, bs_ptr, rows, cols, row_ok, col_ok, Hs, stride_hs, stride_ws,
                    HAS_BS, BLOCK_N, BLOCK_V, BLOCK_H, ACC, DOT, PREC) * inv_tau
    p_s = tl.exp(s - tl.load(lse_s_ptr + rows, mask=row_ok, other=0.0)[:, None])
    keep = row_ok[:, None] & col_ok[None, :]
    if KL:
        t = _logit_tile(ht_ptr, wt_ptr, bt_ptr, rows, cols, row_ok, col_ok, Ht, stride_ht, stride_wt,
                        HAS_BT, BLOCK_N, BLOCK_V, BLOCK_H, ACC, DOT, PREC) * inv_tau
        dz = p_s - tl.exp(t - tl.load(lse_t_ptr + rows, mask=row_ok, other=0.0)[:, None])
    else:
        target = tl.load(tgt_ptr + rows, mask=row_ok, other=ignore_index)
        dz = p_s - tl.where(cols[None, :] == target[:, None], 1.0, 0.0).to(ACC)
        keep = keep & (target != ignore_index)[:, None]
    # scale = grad_output / denominator (/ tau for KL), computed by the host wrapper
    dz = tl.where(keep, dz * tl.load(scale_ptr), 0.0)
    if GRAD_B:
        tl.atomic_add(gb_ptr + cols, tl.sum(dz, axis=0), mask=col_ok)
    dz_in = dz.to(DOT)
    for k0 in range(0, Hs, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_ok = ks < Hs
        if GRAD_H:
            w = tl.load(ws_ptr + cols[:, None].to(tl.int64) * stride_ws + ks[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(DOT)
            tl.atomic_add(gh_ptr + rows[:, None].to(tl.int64) * Hs + ks[None, :],
                          tl.dot(dz_in, w, out_dtype=ACC, input_precision=PREC),
                          mask=row_ok[:, None] & k_ok[None, :])
        if GRAD_W:
            h = tl.load(hs_ptr + rows[:, None].to(tl.int64) * stride_hs + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT)
            tl.atomic_add(gw_ptr + cols[:, None].to(tl.int64) * Hs + ks[None, :],
                          tl.dot(tl.trans(dz_in), h, out_dtype=ACC, input_precision=PREC),
                          mask=col_ok[:, None] & k_ok[None, :])


@triton.jit
def _uniform53(seed, rows, cols, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """A float64 uniform in [0, 1) for each (row, column): 53 bits from two words of Philox-4x32-10
    (genrand_res53), so the Gumbel tail is not cut at float32 resolution.

    The counter is (column, row, 0, 0) as 32-bit words and the key the 31-bit seed, passed to
    ``tl.philox`` itself: not ``tl.randint4x``, whose handling of 64-bit offsets changed between
    Triton releases (older ones return 64-bit words for them). One counter per (row, column) makes
    the draw independent of the tiling.
    """
    zero = tl.zeros((BLOCK_N, BLOCK_V), tl.uint32)
    r0, r1, _, _ = tl.philox(seed, zero + cols[None, :].to(tl.uint32), zero + rows[:, None].to(tl.uint32),
                             zero, zero)
    return ((r0 >> 5).to(tl.float64) * 67108864.0 + (r1 >> 6).to(tl.float64)) * (1.0 / 9007199254740992.0)


@triton.jit
def _sample_kernel(
    h_ptr, w_ptr, b_ptr, sample_ptr, argmax_ptr, seed,
    N, V, H, stride_h, stride_w, inv_tau_ptr,
    HAS_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
):
    inv_tau = tl.load(inv_tau_ptr)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    best_noisy = tl.full((BLOCK_N,), float("-inf"), tl.float64)
    best_sample = tl.zeros((BLOCK_N,), tl.int64)
    best_raw = tl.full((BLOCK_N,), float("-inf"), ACC)
    best_arg = tl.zeros((BLOCK_N,), tl.int64)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        z = _logit_tile(h_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w,
                        HAS_B, BLOCK_N, BLOCK_V, BLOCK_H, ACC, DOT, PREC)
        z = tl.where(col_ok[None, :], z, float("-inf"))
        # Strict ">" keeps the earlier tile on ties: first maximal index, like torch.argmax.
        tile_max = tl.max(z, axis=1)
        tile_arg = tl.argmax(z, axis=1).to(tl.int64) + v0
        better = tile_max > best_raw
        best_raw = tl.where(better, tile_max, best_raw)
        best_arg = tl.where(better, tile_arg, best_arg)
        u = _uniform53(seed, rows, cols, BLOCK_N, BLOCK_V)
        noisy = z.to(tl.float64) * inv_tau - tl.log(-tl.log(u))
        noisy = tl.where(col_ok[None, :], noisy, float("-inf"))
        tile_max = tl.max(noisy, axis=1)
        tile_arg = tl.argmax(noisy, axis=1).to(tl.int64) + v0
        better = tile_max > best_noisy
        best_noisy = tl.where(better, tile_max, best_noisy)
        best_sample = tl.where(better, tile_arg, best_sample)
    tl.store(sample_ptr + rows, best_sample, mask=row_ok)
    tl.store(argmax_ptr + rows, best_arg, mask=row_ok)


@triton.jit
def _uniform_kernel(out_ptr, seed, N, V, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = (rows < N)[:, None] & (cols < V)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * V + cols[None, :], _uniform53(seed, rows, cols, BLOCK_N, BLOCK_V),
             mask=ok)


def sampler_uniforms(seed: int, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """The [rows, vocab] uniforms the sampling kernel draws for ``seed`` (tests compare them with Philox)."""
    out = torch.empty(rows, vocab, dtype=torch.float64, device=device)
    launch = LaunchConfig.of(BLOCK_N=16, BLOCK_V=32)
    grid = (triton.cdiv(rows, launch["BLOCK_N"]), triton.cdiv(vocab, launch["BLOCK_V"]))
    _uniform_kernel[grid](out, seed, rows, vocab, **launch.kwargs())
    return out


def _row_major(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _scalar(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A one-element tensor on ``device`` made by a fill, not copied from the host (no sync on CUDA)."""
    return torch.full((1,), value, dtype=dtype, device=device)


def _vocab_splits(row_blocks: int, v_tiles: int, device: torch.device) -> int:
    """How many programs share one row block's vocabulary in the forward pass.

    One program per row block alone leaves most of a GPU idle (2,458 masked tokens in 64-row blocks
    are 39 programs for 132 SMs), so the vocabulary is split until there are about four programs per
    SM. Under the interpreter: three splits, so that small test shapes cross split boundaries.
    """
    if triton_interpret():
        return max(1, min(3, v_tiles))
    want = 4 * cuda_target(device).multiprocessors
    return max(1, min(v_tiles, triton.cdiv(want, max(row_blocks, 1))))


def _combine_splits(m: torch.Tensor, z: torch.Tensor, a: torch.Tensor | None = None):
    """Log-sum-exp over the splits of [split, N] partial maxima ``m`` and sums ``z`` (and ``a``, summed
    with the same weights): (lse [N], a's total over z's total [N] or None)."""
    top = m.max(0).values
    weight = torch.exp(m - top)
    total = (z * weight).sum(0)
    return top + total.log(), None if a is None else (a * weight).sum(0) / total


class _LinearLossTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kl, hs, ws, bs, ht, wt, bt, target, inv_tau, ignore_index):
        hs, ws, bs = _row_major(hs), _row_major(ws), _row_major(bs)
        ht, wt, bt = _row_major(ht), _row_major(wt), _row_major(bt)
        n, v = hs.shape[0], ws.shape[0]
        acc_t, acc_tl, dot_tl, prec = _dtypes(hs)
        forward = _config("forward_kl" if kl else "forward", hs, dot_tl, prec)
        bn, bv = forward["BLOCK_N"], forward["BLOCK_V"]
        dev = hs.device
        row_blocks, v_tiles = triton.cdiv(n, bn), triton.cdiv(v, bv)
        splits = _vocab_splits(row_blocks, v_tiles, dev)
        tiles_per_split = triton.cdiv(v_tiles, splits)
        splits = triton.cdiv(v_tiles, tiles_per_split)  # none empty
        m_s, z_s, m_t, z_t, a_t, z_tgt = (torch.empty(splits, n, dtype=acc_t, device=dev) for _ in range(6))
        tgt = target if target is not None else m_s  # dummy pointer for KL
        teacher = (ht, wt, bt) if kl else (hs, ws, bs)  # dummies for CE, never read
        args = (
            hs, ws, bs if bs is not None else ws, teacher[0], teacher[1],
            teacher[2] if teacher[2] is not None else teacher[1], tgt,
        )
        dims = (
            n, v, hs.shape[1], teacher[0].shape[1], hs.stride(0), ws.stride(0),
            teacher[0].stride(0), teacher[1].stride(0), _scalar(inv_tau, acc_t, dev),
        )
        flags = dict(KL=kl, HAS_BS=bs is not None, HAS_BT=kl and bt is not None, ACC=acc_tl, DOT=dot_tl, PREC=prec)
        if n > 0:
            _forward_kernel[(row_blocks, splits)](*args, m_s, z_s, m_t, z_t, a_t, z_tgt, *dims,
                                                  tiles_per_split * bv, **flags, **forward.kwargs())
        lse_s, _ = _combine_splits(m_s, z_s)
        if kl:
            lse_t, expected_log_ratio = _combine_splits(m_t, z_t, a_t)
            loss_rows = expected_log_ratio - lse_t + lse_s
        else:
            lse_t = lse_s[:0]
            loss_rows = torch.where(target != ignore_index, lse_s - z_tgt.sum(0), 0.0)
        dims = (*dims, ignore_index)
        if kl:
            denom = _scalar(float(max(n, 1)), acc_t, dev)[0]
        else:
            denom = (target != ignore_index).sum().to(acc_t).clamp(min=1.0)
        ctx.save_for_backward(*args[:6], target, lse_s, lse_t, denom)
        backward = _config("backward_kl" if kl else "backward", hs, dot_tl, prec)
        ctx.meta = (kl, bs is not None, inv_tau, dims, flags, backward, hs.dtype, ws.dtype,
                    None if bs is None else bs.dtype)
        return loss_rows.sum() / denom

    @staticmethod
    def backward(ctx, grad_out):
        hs, ws, bs, ht, wt, bt, target, lse_s, lse_t, denom = ctx.saved_tensors
        kl, has_bs, inv_tau, dims, flags, launch, dt_h, dt_w, dt_b = ctx.meta
        want_h, want_w, want_b = ctx.needs_input_grad[1], ctx.needs_input_grad[2], has_bs and ctx.needs_input_grad[3]
        acc_t = lse_s.dtype
        n, v = hs.shape[0], ws.shape[0]
        gh = torch.zeros(hs.shape, dtype=acc_t, device=hs.device) if want_h else lse_s
        gw = torch.zeros(ws.shape, dtype=acc_t, device=ws.device) if want_w else lse_s
        gb = torch.zeros(v, dtype=acc_t, device=ws.device) if want_b else lse_s
        scale = (grad_out.to(acc_t) / denom * (inv_tau if kl else 1.0)).reshape(1)
        tgt = target if target is not None else lse_s
        if n > 0 and (want_h or want_w or want_b):
            grid = (triton.cdiv(n, launch["BLOCK_N"]), triton.cdiv(v, launch["BLOCK_V"]))
            _backward_kernel[grid](hs, ws, bs, ht, wt, bt, tgt, lse_s, lse_t, scale, gh, gw, gb, *dims,
                                   GRAD_H=want_h, GRAD_W=want_w, GRAD_B=want_b, **flags, **launch.kwargs())
        return (
            None,
            gh.to(dt_h) if want_h else None,
            gw.to(dt_w) if want_w else None,
            gb.to(dt_b) if want_b else None,
            None, None, None, None, None, None,
        )


def linear_kl_triton(hs, ws, bs, ht, wt, bt, temperature: float) -> torch.Tensor:
    """Triton path of ``fused_linear_kl`` (teacher tensors already detached); the loss in fp32 (fp64)."""
    return _LinearLossTriton.apply(True, hs, ws, bs, ht, wt, bt, None, 1.0 / temperature, 0)


def linear_cross_entropy_triton(hidden, weight, bias, target, ignore_index: int) -> torch.Tensor:
    """Triton path of ``fused_linear_cross_entropy``; the loss in fp32 (fp64)."""
    return _LinearLossTriton.apply(False, hidden, weight, bias, None, None, None, target, 1.0, ignore_index)


def linear_sample_triton(hidden, weight, bias, generator, temperature: float):
    """Triton path of ``fused_linear_sample``; the Philox seed is drawn from ``generator``."""
    hidden, weight, bias = _row_major(hidden), _row_major(weight), _row_major(bias)
    n, v = hidden.shape[0], weight.shape[0]
    seed = int(torch.randint(0, 2**31 - 1, (), generator=generator, device="cpu" if generator is None
                             else generator.device))
    samples = torch.empty(n, dtype=torch.long, device=hidden.device)
    argmax = torch.empty(n, dtype=torch.long, device=hidden.device)
    _, acc_tl, dot_tl, prec = _dtypes(hidden)
    launch = _config("sample", hidden, dot_tl, prec)
    if n > 0:
        _sample_kernel[(triton.cdiv(n, launch["BLOCK_N"]),)](
            hidden, weight, bias if bias is not None else weight, samples, argmax, seed,
            n, v, hidden.shape[1], hidden.stride(0), weight.stride(0),
            _scalar(1.0 / temperature, torch.float64, hidden.device),
            HAS_B=bias is not None, ACC=acc_tl, DOT=dot_tl, PREC=prec, **launch.kwargs(),
        )
    return samples, argmax
