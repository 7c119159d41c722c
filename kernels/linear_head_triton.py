"""Triton kernels for :mod:`kernels.linear_head` (imported lazily by the dispatcher).

Forward: one program per (block of ``BLOCK_N`` rows, vocabulary split) walks its split in ``BLOCK_V``
tiles; each logit tile is a ``tl.dot`` over ``BLOCK_H`` slices of the hidden size and is folded into
an online softmax (running max and sum, and for KL the running teacher-weighted log-ratio), so only
O(N x splits) numbers leave the kernel. The same kernel samples: Gumbel-max over the tiles it
already computes (fp32 Philox noise, :func:`_gumbel_tile`), alongside the cross-entropy or alone.

Backward, two variants (``kernels.dispatch.head_backward``; the roofline in
``megakd.bench.roofline.head_backward_roofline`` picks the default): "chunked" (default) writes
d(loss)/d(logits) of a row chunk once (:func:`_grad_logits_kernel`, recomputed from the saved
log-sum-exp) and hands the two gradient products to cuBLAS: no atomics, bitwise reproducible, the
[chunk x V] temporary bounded by ``_BACKWARD_CHUNK_ELEMS``. "atomic": one program per (row block,
vocab tile) adds its products into the gradients with fp32 atomics, allocating nothing of [N x V]
but read-modify-writing the gradients once per row block (``grad_weight``) or vocabulary tile
(``grad_hidden``), in a GPU-dependent order (not bitwise reproducible).

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

from .chunked_grads import chunked_grads, rows_per_chunk
from .dispatch import chosen_head_backward, cuda_target, triton_interpret
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
# "sample" is the forward kernel with sampling and no loss terms; "grad_logits(_kl)" the chunked backward's
# d(loss)/d(logits) kernel; "backward(_kl)" the atomic backward (kernels.dispatch.head_backward).
_KERNELS = ("forward", "forward_kl", "sample", "grad_logits", "grad_logits_kl", "backward", "backward_kl")
HEAD_CONFIGS: dict[tuple[str, str, str], LaunchConfig] = {
    **{(kernel, matmul, generation): _TENSOR_CORE
       for kernel in _KERNELS for matmul in ("16bit", "tf32") for generation in ("sm80", "sm90")},
    **{(kernel, "fp32", generation): _FP32 for kernel in _KERNELS for generation in ("sm80", "sm90")},
    # sm_80's ptxas holds this kernel to 128 registers at 64 x 128 x 16 and spills 32 B; sm_90a's uses 200.
    ("backward_kl", "fp32", "sm80"): _FP32_NARROW,
    # Triton 3.6 (pyproject's floor) spills 8 B here at 64 x 128 x 32 for sm_80 with a bias (80 registers);
    # 64-deep k-steps compile spill-free on 3.6 and 3.9 (90 / 118 registers, 48 KiB shared).
    ("grad_logits", "16bit", "sm80"): LaunchConfig.of(num_warps=8, BLOCK_N=64, BLOCK_V=128, BLOCK_H=64),
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
    """The launch of ``kernel`` (a kernel key of :data:`HEAD_CONFIGS`) for these activations and matmul
    dtype ``dot``: :data:`INTERPRETER_CONFIG` under the interpreter."""
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
def _gumbel_tile(seed, rows, v0, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """fp32 Gumbel noise of columns ``v0 .. v0 + BLOCK_V`` (``v0`` a multiple of 4) of ``rows``.

    Column ``c`` of row ``r`` takes word ``c % 4`` of Philox-4x32-10(counter=(c // 4, r, 0, 0), key=seed):
    one Philox call feeds four columns, and the draw depends on (seed, row, column) only, not on the
    tiling or the vocabulary splits. ``tl.philox`` is called directly, not ``tl.randint4x``, whose
    handling of 64-bit offsets changed between Triton releases. The word ``w`` is the uniform
    ``U = (w + 1/2) / 2**32``, read through its distance ``x = min(U, 1 - U)`` from the nearer end, which
    fp32 holds to 24 significant bits; so ``E = -log(U)`` is right to a few ulps at both ends, near
    ``U -> 1`` as ``-log1p(-x)`` (where ``-log(U)`` would lose every digit). The noise is ``-log(E)``.

    Against float64 noise from a 53-bit uniform (the sampler's previous form): the noise stops at
    ``-log(-log1p(-2**-33)) = 22.87`` (float64's at 36.7), and a standard Gumbel exceeds 22.87 with
    probability ``2**-33``, so over V = 128,000 columns the cut tail moves at most
    ``V * 2**-33 = 1.5e-5`` of a row's probability (total variation from exact Gumbel-max). The fp32
    arithmetic moves each score by a few ulps (about ``1e-6 * |g|``), which changes a draw only when
    the top two scores are that close: of the order of 1e-6 more.
    """
    groups = v0 // 4 + tl.arange(0, BLOCK_V // 4)
    zero = tl.zeros((BLOCK_N, BLOCK_V // 4), tl.uint32)
    w0, w1, w2, w3 = tl.philox(seed, zero + groups[None, :].to(tl.uint32), zero + rows[:, None].to(tl.uint32),
                               zero, zero)
    # join(join(w0, w2), join(w1, w3)) is [row, group, b, a] = word 2b + a, i.e. column 4 * group + 2b + a
    return _gumbel_of_words(tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK_N, BLOCK_V)))


@triton.jit
def _gumbel_of_words(w):
    """fp32 Gumbel noise -log(-log(U)) of uint32 words ``w``, U = (w + 1/2) / 2**32 (see :func:`_gumbel_tile`)."""
    high = (w >> 31) == 1
    x = (tl.where(high, ~w, w).to(tl.float32) + 0.5) * 2.3283064365386963e-10  # min(U, 1 - U) in (0, 1/2]
    y = 1.0 - x
    # log1p(-x) to a few ulps (Goldberg's form); the floor only keeps the unused branch finite where y == 1
    log1p_neg_x = tl.where(y == 1.0, -x, tl.log(y) * (x / tl.maximum(1.0 - y, 1e-30)))
    return -tl.log(tl.where(high, -log1p_neg_x, -tl.log(x)))


@triton.jit
def _forward_kernel(
    hs_ptr, ws_ptr, bs_ptr, ht_ptr, wt_ptr, bt_ptr, tgt_ptr,
    m_s_ptr, z_s_ptr, m_t_ptr, z_t_ptr, a_t_ptr, z_tgt_ptr, arg_ptr, noisy_ptr, pick_ptr,
    N, V, Hs, Ht, stride_hs, stride_ws, stride_ht, stride_wt, inv_tau_ptr, V_PER_SPLIT, seed, inv_tau_sample_ptr,
    KL: tl.constexpr, LOSS: tl.constexpr, SAMPLE: tl.constexpr, HAS_BS: tl.constexpr, HAS_BT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
):
    """Partials of one row block over one vocabulary split (``program_id(1)``), stored at ``[split, row]``.

    ``LOSS``: the online softmax's running max and sum of the student (and teacher) logits, the
    teacher-weighted log-ratio for KL, the target's logit for CE. ``SAMPLE`` (CE or no loss, where the
    logits are unscaled): the logits' max and its first index, and the best Gumbel-perturbed score
    ``z * inv_tau_sample + g`` and its index (Gumbel-max sampling from softmax(z * inv_tau_sample)), from
    the very logit tiles the loss uses. The host combines the splits.
    """
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
    arg = tl.zeros((BLOCK_N,), tl.int32)
    noisy = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    pick = tl.zeros((BLOCK_N,), tl.int32)
    inv_tau = tl.load(inv_tau_ptr)
    if SAMPLE:
        inv_tau_sample = tl.load(inv_tau_sample_ptr)
    if KL or not LOSS:
        target = rows  # unused
    else:
        target = tl.load(tgt_ptr + rows, mask=row_ok, other=0)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_end
        z = _logit_tile(hs_ptr, ws_ptr, bs_ptr, rows, cols, row_ok, col_ok, Hs, stride_hs, stride_ws,
                        HAS_BS, BLOCK_N, BLOCK_V, BLOCK_H, ACC, DOT, PREC)
        s_raw = z * inv_tau
        s = tl.where(col_ok[None, :], s_raw, float("-inf"))
        tile_max = tl.max(s, axis=1)
        m_new = tl.maximum(m_s, tile_max)
        if SAMPLE:
            # Strict ">" keeps the earlier tile on ties: the first maximal index, like torch.argmax.
            arg = tl.where(tile_max > m_s, tl.argmax(s, axis=1) + v0, arg)
            score = tl.where(col_ok[None, :], z.to(tl.float32) * inv_tau_sample + _gumbel_tile(
                seed, rows, v0, BLOCK_N, BLOCK_V), float("-inf"))
            score_max = tl.max(score, axis=1)
            pick = tl.where(score_max > noisy, tl.argmax(score, axis=1) + v0, pick)
            noisy = tl.maximum(noisy, score_max)
        if LOSS:
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
        elif LOSS:
            z_tgt += tl.sum(tl.where(cols[None, :] == target[:, None], s, 0.0), axis=1)
    at = tl.program_id(1) * N + rows
    tl.store(m_s_ptr + at, m_s, mask=row_ok)
    if LOSS:
        tl.store(z_s_ptr + at, z_s, mask=row_ok)
        if KL:
            tl.store(m_t_ptr + at, m_t, mask=row_ok)
            tl.store(z_t_ptr + at, z_t, mask=row_ok)
            tl.store(a_t_ptr + at, a_t, mask=row_ok)
        else:
            tl.store(z_tgt_ptr + at, z_tgt, mask=row_ok)
    if SAMPLE:
        tl.store(arg_ptr + at, arg, mask=row_ok)
        tl.store(noisy_ptr + at, noisy, mask=row_ok)
        tl.store(pick_ptr + at, pick, mask=row_ok)


@triton.jit
def _grad_logit_tile(
    hs_ptr, ws_ptr, bs_ptr, ht_ptr, wt_ptr, bt_ptr, tgt_ptr, lse_s_ptr, lse_t_ptr, scale_ptr, rows, cols,
    N, V, Hs, Ht, stride_hs, stride_ws, stride_ht, stride_wt, inv_tau_ptr, ignore_index,
    KL: tl.constexpr, HAS_BS: tl.constexpr, HAS_BT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
):
    """d(loss)/d(logits) of one [rows x cols] tile, recomputed from the saved log-sum-exp: softmax minus
    one-hot (CE) or p_s - p_t (KL), times ``scale`` (grad_output / denominator, / tau for KL); 0 on
    padding and on ignored rows."""
    inv_tau = tl.load(inv_tau_ptr)
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
    return tl.where(keep, dz * tl.load(scale_ptr), 0.0)


@triton.jit
def _grad_logits_kernel(
    hs_ptr, ws_ptr, bs_ptr, ht_ptr, wt_ptr, bt_ptr, tgt_ptr, lse_s_ptr, lse_t_ptr, scale_ptr, dz_ptr, gb_ptr,
    N, V, Hs, Ht, stride_hs, stride_ws, stride_ht, stride_wt, inv_tau_ptr, ignore_index, ROW0,
    KL: tl.constexpr, HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, GRAD_B: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
):
    """The chunked backward's first half: d(loss)/d(logits) of rows ``ROW0 ..`` (one chunk) into ``dz``
    [chunk, V] in the matmul dtype, and the bias gradient's per-row-block column sums in ``ACC`` (from
    the unrounded tile) at ``gb[program_id(0), :]``. Every element has one writer: no atomics."""
    rows = ROW0 + tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    dz = _grad_logit_tile(hs_ptr, ws_ptr, bs_ptr, ht_ptr, wt_ptr, bt_ptr, tgt_ptr, lse_s_ptr, lse_t_ptr, scale_ptr,
                          rows, cols, N, V, Hs, Ht, stride_hs, stride_ws, stride_ht, stride_wt, inv_tau_ptr,
                          ignore_index, KL, HAS_BS, HAS_BT, BLOCK_N, BLOCK_V, BLOCK_H, ACC, DOT, PREC)
    col_ok = cols < V
    tl.store(dz_ptr + (rows - ROW0)[:, None].to(tl.int64) * V + cols[None, :], dz.to(DOT),
             mask=(rows < N)[:, None] & col_ok[None, :])
    if GRAD_B:
        tl.store(gb_ptr + tl.program_id(0).to(tl.int64) * V + cols, tl.sum(dz, axis=0), mask=col_ok)


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
    """The atomic backward (``head_backward("atomic")``): one program per (row block, vocab tile) adds its
    products into the gradients with fp32 atomics. Relaxed: the order of a sum's terms does not matter
    to it (only to its rounding, which is why this backward is not bitwise reproducible)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    col_ok = cols < V
    dz = _grad_logit_tile(hs_ptr, ws_ptr, bs_ptr, ht_ptr, wt_ptr, bt_ptr, tgt_ptr, lse_s_ptr, lse_t_ptr, scale_ptr,
                          rows, cols, N, V, Hs, Ht, stride_hs, stride_ws, stride_ht, stride_wt, inv_tau_ptr,
                          ignore_index, KL, HAS_BS, HAS_BT, BLOCK_N, BLOCK_V, BLOCK_H, ACC, DOT, PREC)
    if GRAD_B:
        tl.atomic_add(gb_ptr + cols, tl.sum(dz, axis=0), mask=col_ok, sem="relaxed")
    dz_in = dz.to(DOT)
    for k0 in range(0, Hs, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_ok = ks < Hs
        if GRAD_H:
            w = tl.load(ws_ptr + cols[:, None].to(tl.int64) * stride_ws + ks[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(DOT)
            tl.atomic_add(gh_ptr + rows[:, None].to(tl.int64) * Hs + ks[None, :],
                          tl.dot(dz_in, w, out_dtype=ACC, input_precision=PREC),
                          mask=row_ok[:, None] & k_ok[None, :], sem="relaxed")
        if GRAD_W:
            h = tl.load(hs_ptr + rows[:, None].to(tl.int64) * stride_hs + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT)
            tl.atomic_add(gw_ptr + cols[:, None].to(tl.int64) * Hs + ks[None, :],
                          tl.dot(tl.trans(dz_in), h, out_dtype=ACC, input_precision=PREC),
                          mask=col_ok[:, None] & k_ok[None, :], sem="relaxed")


@triton.jit
def _noise_kernel(out_ptr, seed, N, V, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    v0 = tl.program_id(1) * BLOCK_V
    cols = v0 + tl.arange(0, BLOCK_V)
    ok = (rows < N)[:, None] & (cols < V)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * V + cols[None, :], _gumbel_tile(seed, rows, v0, BLOCK_N, BLOCK_V),
             mask=ok)


def sampler_noise(seed: int, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """The [rows, vocab] fp32 Gumbel noise the sampling forward adds for ``seed`` (tests compare it with Philox)."""
    out = torch.empty(rows, vocab, dtype=torch.float32, device=device)
    launch = LaunchConfig.of(BLOCK_N=16, BLOCK_V=32)
    grid = (triton.cdiv(rows, launch["BLOCK_N"]), triton.cdiv(vocab, launch["BLOCK_V"]))
    _noise_kernel[grid](out, seed, rows, vocab, **launch.kwargs())
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


# Elements of one [rows x V] chunk of d(loss)/d(logits) in the chunked backward: 2**28 (512 MiB in bf16) is
# 2,097 rows at V = 128,000, so a micro-batch's 2,458 masked rows take two chunks. Larger than the torch path's
# _CHUNK_ELEMS on purpose: each chunk reads and rewrites the fp32 [V x H] weight gradient (786 MB at
# electra-base), which in 131-row chunks would be 15 GB of traffic a backward
# (megakd.bench.roofline.head_backward_roofline counts it).
_BACKWARD_CHUNK_ELEMS = 1 << 28


def _combine_draws(m: torch.Tensor, arg: torch.Tensor, noisy: torch.Tensor, pick: torch.Tensor):
    """(samples, argmax) [N] from the splits' [split, N] partials: the best perturbed score's index and the
    largest logit's; a tie between splits goes to the earlier split, i.e. the first index."""
    def first_best(score, index):
        return index.gather(0, score.argmax(0, keepdim=True))[0].long()

    return first_best(noisy, pick), first_best(m, arg)


def _forward(kl: bool, loss: bool, hs, ws, bs, ht, wt, bt, target, inv_tau: float, ignore_index: int,
             sample: tuple[int, float] | None):
    """Launch the forward over (row blocks, vocabulary splits) and combine the splits.

    Returns (lse_s, lse_t, loss_rows, draws, relaunch): log-sum-exps [N] and the per-row loss (CE: 0 on
    ignored rows), all None without ``loss``; ``draws`` = (samples, argmax) when ``sample`` =
    (seed, temperature), else None; ``relaunch`` = (args, dims, flags) for the backward.
    """
    n, v = hs.shape[0], ws.shape[0]
    acc_t, acc_tl, dot_tl, prec = _dtypes(hs)
    config = _config("forward_kl" if kl else "forward" if loss else "sample", hs, dot_tl, prec)
    bn, bv = config["BLOCK_N"], config["BLOCK_V"]
    dev = hs.device
    row_blocks, v_tiles = triton.cdiv(n, bn), triton.cdiv(v, bv)
    splits = _vocab_splits(row_blocks, v_tiles, dev)
    tiles_per_split = triton.cdiv(v_tiles, splits)
    splits = triton.cdiv(v_tiles, tiles_per_split)  # none empty
    parts = [torch.empty(splits, n, dtype=acc_t, device=dev) for _ in range(6 if loss else 1)]
    m_s = parts[0]
    draws = [torch.empty(splits, n, dtype=dt, device=dev) for dt in (torch.int32, torch.float32, torch.int32)] \
        if sample is not None else [m_s] * 3  # dummies when not sampling, never written
    tgt = target if target is not None else m_s  # dummy pointer for KL and sampling alone
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
    seed, temperature = sample if sample is not None else (0, 1.0)
    if n > 0:
        _forward_kernel[(row_blocks, splits)](
            *args, *(parts if loss else parts * 6), *draws, *dims, tiles_per_split * bv, seed,
            _scalar(1.0 / temperature, torch.float32, dev), LOSS=loss, SAMPLE=sample is not None, **flags,
            **config.kwargs())
    drawn = _combine_draws(m_s, *draws) if sample is not None and n > 0 else None
    if sample is not None and n == 0:
        drawn = (torch.empty(0, dtype=torch.long, device=dev),) * 2
    if not loss:
        return None, None, None, drawn, None
    _, z_s, m_t, z_t, a_t, z_tgt = parts
    lse_s, _ = _combine_splits(m_s, z_s)
    if kl:
        lse_t, expected_log_ratio = _combine_splits(m_t, z_t, a_t)
        loss_rows = expected_log_ratio - lse_t + lse_s
    else:
        lse_t = lse_s[:0]
        loss_rows = torch.where(target != ignore_index, lse_s - z_tgt.sum(0), 0.0)
    return lse_s, lse_t, loss_rows, drawn, (args, dims, flags)


def _chunked_backward(args, dims, flags, target, lse_s, lse_t, scale, wants, launch):
    """Gradients without atomics: per row chunk, :func:`_grad_logits_kernel` writes d(loss)/d(logits) and the
    bias's column sums, then two GEMMs (cuBLAS on a GPU) give grad_hidden[chunk] = dz @ W and add
    dz^T @ h to grad_weight, through the torch path's accumulation (:func:`.chunked_grads.chunked_grads`).
    Each output element is written by one program or one GEMM in a fixed order: bitwise reproducible.
    Returns fp32 (fp64) (grad_hidden, grad_weight, grad_bias), None where not wanted."""

    hs, ws = args[0], args[1]
    n, v = dims[0], dims[1]
    dot_t = next(t for t, tl_t in TL_DTYPES.items() if tl_t == flags["DOT"])
    bn, bv = launch["BLOCK_N"], launch["BLOCK_V"]
    step = rows_per_chunk(n, v, _BACKWARD_CHUNK_ELEMS)
    grad_b = wants[2]

    def chunk_terms(r0, h, grad):
        rows = h.shape[0]
        dz = torch.empty(rows, v, dtype=dot_t, device=hs.device)
        bias = torch.empty(triton.cdiv(rows, bn), v, dtype=lse_s.dtype, device=hs.device) if grad_b else dz
        _grad_logits_kernel[(triton.cdiv(rows, bn), triton.cdiv(v, bv))](
            *args[:6], target if target is not None else lse_s, lse_s, lse_t, scale, dz, bias, r0 + rows,
            *dims[1:], r0, GRAD_B=grad_b, **flags, **launch.kwargs())
        return None, dz, None, bias.sum(0) if grad_b else None

    _, gh, gw, gb = chunked_grads(hs.to(dot_t), ws.to(dot_t), wants, step, chunk_terms)
    return gh, gw, gb


class _LinearLossTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kl, hs, ws, bs, ht, wt, bt, target, inv_tau, ignore_index, sample, draws):
        """``sample`` = (seed, temperature) also draws from the CE's logits, into the list ``draws``."""
        hs, ws, bs = _row_major(hs), _row_major(ws), _row_major(bs)
        ht, wt, bt = _row_major(ht), _row_major(wt), _row_major(bt)
        lse_s, lse_t, loss_rows, drawn, (args, dims, flags) = _forward(
            kl, True, hs, ws, bs, ht, wt, bt, target, inv_tau, ignore_index, sample)
        if drawn is not None:
            draws.extend(drawn)
        acc_t = lse_s.dtype
        if kl:
            denom = _scalar(float(max(hs.shape[0], 1)), acc_t, hs.device)[0]
        else:
            denom = (target != ignore_index).sum().to(acc_t).clamp(min=1.0)
        ctx.save_for_backward(*args[:6], target, lse_s, lse_t, denom)
        variant = chosen_head_backward()  # here, not in backward: autograd may run that on another thread
        kernel = ("backward" if variant == "atomic" else "grad_logits") + ("_kl" if kl else "")
        launch = _config(kernel, hs, flags["DOT"], flags["PREC"])
        ctx.meta = (kl, bs is not None, inv_tau, (*dims, ignore_index), flags, variant, launch, hs.dtype, ws.dtype,
                    None if bs is None else bs.dtype)
        return loss_rows.sum() / denom

    @staticmethod
    def backward(ctx, grad_out):
        hs, ws, bs, ht, wt, bt, target, lse_s, lse_t, denom = ctx.saved_tensors
        kl, has_bs, inv_tau, dims, flags, variant, launch, dt_h, dt_w, dt_b = ctx.meta
        wants = (ctx.needs_input_grad[1], ctx.needs_input_grad[2], has_bs and ctx.needs_input_grad[3])
        acc_t = lse_s.dtype
        n, v = hs.shape[0], ws.shape[0]
        scale = (grad_out.to(acc_t) / denom * (inv_tau if kl else 1.0)).reshape(1)
        tgt = target if target is not None else lse_s
        if n == 0 or not any(wants):
            grads = [torch.zeros(t.shape, dtype=acc_t, device=t.device) if want else None
                     for t, want in zip((hs, ws, ws[:, 0]), wants)]
        elif variant == "chunked":
            grads = _chunked_backward((hs, ws, bs, ht, wt, bt), dims, flags, target, lse_s, lse_t, scale, wants,
                                      launch)
        else:
            gh, gw, gb = (torch.zeros(t.shape, dtype=acc_t, device=t.device) if want else lse_s
                          for t, want in zip((hs, ws, ws[:, 0]), wants))
            grid = (triton.cdiv(n, launch["BLOCK_N"]), triton.cdiv(v, launch["BLOCK_V"]))
            _backward_kernel[grid](hs, ws, bs, ht, wt, bt, tgt, lse_s, lse_t, scale, gh, gw, gb, *dims,
                                   GRAD_H=wants[0], GRAD_W=wants[1], GRAD_B=wants[2], **flags, **launch.kwargs())
            grads = [g if want else None for g, want in zip((gh, gw, gb), wants)]
        gh, gw, gb = (None if g is None else g.to(dt) for g, dt in zip(grads, (dt_h, dt_w, dt_b)))
        return None, gh, gw, gb, None, None, None, None, None, None, None, None


def linear_kl_triton(hs, ws, bs, ht, wt, bt, temperature: float) -> torch.Tensor:
    """Triton path of ``fused_linear_kl`` (teacher tensors already detached); the loss in fp32 (fp64)."""
    return _LinearLossTriton.apply(True, hs, ws, bs, ht, wt, bt, None, 1.0 / temperature, 0, None, None)


def linear_cross_entropy_triton(hidden, weight, bias, target, ignore_index: int) -> torch.Tensor:
    """Triton path of ``fused_linear_cross_entropy``; the loss in fp32 (fp64)."""
    return _LinearLossTriton.apply(False, hidden, weight, bias, None, None, None, target, 1.0, ignore_index, None,
                                   None)


def _seed(generator: torch.Generator | None) -> int:
    """The Philox key of one sampling call: 31 bits from ``generator`` (torch's default when None)."""
    return int(torch.randint(0, 2**31 - 1, (), generator=generator,
                             device="cpu" if generator is None else generator.device))


def linear_cross_entropy_and_sample_triton(hidden, weight, bias, target, ignore_index: int, generator,
                                           temperature: float):
    """Triton path of ``fused_linear_cross_entropy_and_sample``: one forward launch gives the loss's
    partials and the draws (the same as :func:`linear_sample_triton` with the same generator state)."""
    draws: list[torch.Tensor] = []
    loss = _LinearLossTriton.apply(False, hidden, weight, bias, None, None, None, target, 1.0, ignore_index,
                                   (_seed(generator), temperature), draws)
    return loss, draws[0], draws[1]


@torch.no_grad()
def linear_sample_triton(hidden, weight, bias, generator, temperature: float):
    """Triton path of ``fused_linear_sample``: the forward kernel with sampling alone (no loss terms); the
    Philox key is drawn from ``generator``."""
    hidden, weight, bias = _row_major(hidden), _row_major(weight), _row_major(bias)
    _, _, _, drawn, _ = _forward(False, False, hidden, weight, bias, None, None, None, None, 1.0, 0,
                                 (_seed(generator), temperature))
    return drawn
