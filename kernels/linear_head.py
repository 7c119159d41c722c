"""Fused linear output head + loss over a large vocabulary, never materializing [tokens x vocab].

Three operations share one tiling (rows of hidden states x vocabulary of an output matrix):

- :func:`fused_linear_kl`: KL(softmax(teacher/tau) || softmax(student/tau)) for distillation (DWT);
- :func:`fused_linear_cross_entropy`: the generator's MLM cross-entropy;
- :func:`fused_linear_sample`: sampling from the softmax (plus argmax) at masked positions;
- :func:`fused_linear_cross_entropy_and_sample`: the last two from one pass over the logits.

With a 128K vocabulary the logits of a few thousand tokens are gigabytes, while the inputs are
megabytes. The torch path processes rows in chunks of about ``_CHUNK_ELEMS / V`` rows and, as
Liger-Kernel's fused linear cross-entropy does, computes the gradients for hidden states, weight
and bias inside the forward (chunk by chunk) so the chunk's logits can be freed at once; backward
only scales the stored gradients by ``grad_output``. Peak extra memory is O(chunk x V + V x H)
instead of several N x V tensors. The Triton path goes further: an online softmax over vocabulary
tiles keeps O(N) state in forward (and samples from the same tiles), and backward recomputes the
logit tiles, by default writing one row chunk's d(loss)/d(logits) at a time for two cuBLAS products
accumulated by the same code as the torch path's (:func:`.chunked_grads.chunked_grads`; no atomics).

Dtypes: activations and weights may be fp32, bf16 or fp16, and may differ (bf16 activations with fp32
weights, as under autocast: the weights are cast to the activations' dtype for the matmul, as
autocast does). Softmax, logs and sums run in fp32 (fp64 for fp64 inputs), and the loss is returned
in that dtype; each gradient comes back in its input's dtype.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .chunked_grads import acc_dtype, chunked_grads, rows_per_chunk
from .dispatch import check_float, check_tensor, resolve_backend

# Elements of one [rows x V] chunk temporary: 2**24 fp32 = 64 MiB, i.e. 131 rows at V = 128K. Measured
# on 2 CPU cores (tools/bench_kernels.py): 128-262 rows run as fast as the naive full-size GEMMs,
# while the largest chunk temporaries (2-3 of them) stay well below the [V x H] weight gradient.
_CHUNK_ELEMS = 1 << 24


@functools.cache
def _initialize_vml() -> None:
    """Run each oneMKL VML function the torch path calls once, from one thread, before any real call.

    On CPU, ``exp`` and ``log`` of a float tensor go to oneMKL's VML (``vsExp``, ``vdLn``, ...) in pieces of
    2048 elements spread over the intra-op threads. VML picks its kernel (instruction set and accuracy)
    lazily, at a function's first call in the process, and that choice is not thread-safe: when two
    threads make the first call together, one of them can run with a half-made choice. Seen here as
    ``exp_`` of the first cross-entropy chunk after a process start computing the main thread's rows with
    the AVX2 "enhanced performance" kernel (bit for bit; ~1e-4 relative error) instead of the AVX-512
    high-accuracy one, in 1 of ~25-80 processes under CPU load: a resumed run's first loss then differed
    from the uninterrupted run's in the 7th digit (docs/reliability.md). One single-element call per
    function and dtype, made once per process when the torch path first runs (not on import, which
    should change nothing), settles the choice before any parallel call.
    """
    for dtype in (torch.float32, torch.float64):
        one = torch.ones(1, dtype=dtype)
        torch.exp(one)
        torch.log(one)


def _rows_per_chunk(n: int, v: int) -> int:
    """Rows of the torch path's [rows x v] chunks (``_CHUNK_ELEMS``, read at call time: tests shrink it)."""
    return rows_per_chunk(n, v, _CHUNK_ELEMS)


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, acc: torch.dtype) -> torch.Tensor:
    return F.linear(h, w, b).to(acc)


def _as_activation_dtype(hidden: torch.Tensor, *params: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The head's weights in the activations' dtype, as autocast would cast them for the matmul
    (bf16 activations with fp32 weights): a differentiable cast, so the gradient reaches the fp32 weight."""
    return [p if p is None or p.dtype == hidden.dtype else p.to(hidden.dtype) for p in params]


# ----------------------------------------------------------------------------------------------
# References: naive, materializing, plain autograd. Tests and benchmarks compare against these.


def fused_linear_kl_reference(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    temperature: float = 1.0,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Naive reference of :func:`fused_linear_kl` (materializes both [N, V] logit tensors)."""
    s = F.linear(student_hidden, student_weight, student_bias) / temperature
    t = F.linear(teacher_hidden, teacher_weight, teacher_bias) / temperature
    log_ps = torch.log_softmax(s, dim=-1)
    log_pt = torch.log_softmax(t, dim=-1)
    kl_rows = (log_pt.exp() * (log_pt - log_ps)).sum(-1)
    return kl_rows.sum() / max(kl_rows.shape[0], 1)


def fused_linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Naive reference of :func:`fused_linear_cross_entropy` (materializes [N, V] logits)."""
    logits = F.linear(hidden, weight, bias)
    if not bool((target != ignore_index).any()):
        return logits.sum() * 0.0
    return F.cross_entropy(logits, target, ignore_index=ignore_index)


def fused_linear_sample_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    generator: torch.Generator | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive reference of :func:`fused_linear_sample`: textbook inverse-CDF sampling in float64.

    One uniform per row, drawn from ``generator`` in row order as the chunked torch path draws them;
    the full [N, V] cumulative sum here and the two-level one there round differently only in the
    last bits, so both give the same samples for the same seed.
    """
    logits = F.linear(hidden, weight, bias)
    cdf = torch.softmax(logits.to(torch.float64) / temperature, -1).cumsum(-1)
    u = torch.rand(logits.shape[0], 1, generator=generator, dtype=torch.float64,
                   device=logits.device if generator is None else generator.device).to(logits.device)
    samples = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=logits.shape[1] - 1)
    return samples.squeeze(1), logits.argmax(-1)


# ----------------------------------------------------------------------------------------------
# Chunked torch path.


def _chunked_loss_and_grads(ctx, hidden, weight, bias, denom, chunk_terms):
    """:func:`chunked_grads` for a torch-path forward: the gradients are kept on ``ctx`` for backward."""
    _initialize_vml()
    need = ctx.needs_input_grad
    wants = (need[0], need[1], bias is not None and need[2])
    total, gh, gw, gb = chunked_grads(hidden, weight, wants, _rows_per_chunk(hidden.shape[0], weight.shape[0]),
                                       chunk_terms)
    ctx.save_for_backward(gh, gw, gb)
    ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    return total / denom  # fp32 (fp64 for fp64 inputs): a 16-bit loss would resolve only ~3 digits


class _ChunkedLinearLoss(torch.autograd.Function):
    """Shared backward: the gradients were computed in forward; scale them by the incoming gradient."""

    @staticmethod
    def backward(ctx, grad_out):
        gh, gw, gb = ctx.saved_tensors
        out = [None] * ctx.num_inputs
        for i, (g, dt) in enumerate(zip((gh, gw, gb), ctx.dtypes)):
            if g is not None:
                out[i] = (g * grad_out.to(g.dtype)).to(dt)
        return tuple(out)


class _ChunkedLinearKL(_ChunkedLinearLoss):
    """Mean over rows of KL(softmax(teacher/τ) ‖ softmax(student/τ)), chunked over rows."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, t_hidden, t_weight, t_bias, temperature):
        ctx.num_inputs = 7
        acc = acc_dtype(hidden)
        inv_tau = 1.0 / temperature
        denom = max(hidden.shape[0], 1)
        if inv_tau != 1.0:
            # Fold 1/tau into the small inputs ([rows x H], [V]) instead of the [rows x V] logits.
            bias = None if bias is None else bias * inv_tau
            t_bias = None if t_bias is None else t_bias * inv_tau

        def chunk_terms(r0, h, grad):
            th = t_hidden[r0 : r0 + h.shape[0]]
            hs = h * inv_tau if inv_tau != 1.0 else h
            if inv_tau != 1.0:
                th = th * inv_tau
            log_ps = torch.log_softmax(_logits(hs, weight, bias, acc), -1)
            log_pt = torch.log_softmax(_logits(th, t_weight, t_bias, acc), -1)
            p_t = log_pt.exp()
            # Row-major dot products avoid another [chunk x V] temporary.
            loss = torch.dot(p_t.view(-1), log_pt.view(-1)) - torch.dot(p_t.view(-1), log_ps.view(-1))
            del log_pt
            if not grad:
                return loss, None, None, None
            dz = log_ps.exp_().sub_(p_t)  # p_s - p_t, in place
            # d(loss)/d(logits) = dz / tau / N: the scale goes on the small GEMM operands.
            row_scale = torch.full((h.shape[0], 1), inv_tau / denom, dtype=acc, device=h.device)
            return loss, dz, row_scale, None

        return _chunked_loss_and_grads(ctx, hidden, weight, bias, denom, chunk_terms)


class _ChunkedLinearCE(_ChunkedLinearLoss):
    """Mean cross-entropy over rows whose target is not ``ignore_index``, chunked over rows.

    With ``draws`` (a :class:`_Draws`) each chunk's logits are also sampled from, so the sampling
    needs no second pass over the vocabulary. One pass finds each row's max and argmax, one
    exponentiates in place, one sums in 256-wide float64 blocks (the inverse CDF's block totals at
    temperature 1, and the softmax's normaliser), one divides: the gradient's softmax, the loss
    (log-sum-exp minus the target's logit) and the draws share them.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, draws):
        ctx.num_inputs = 6
        acc = acc_dtype(hidden)
        # A tensor, not a Python int: reading the count would wait for the device.
        denom = (target != ignore_index).sum().clamp(min=1).to(acc)

        def chunk_terms(r0, h, grad):
            tgt = target[r0 : r0 + h.shape[0]]
            valid = tgt != ignore_index
            safe = torch.where(valid, tgt, 0).unsqueeze(1)
            logits = _logits(h, weight, bias, acc)
            top, index = logits.max(-1, keepdim=True)
            target_shifted = logits.gather(1, safe) - top
            shifted = logits.sub_(top)
            if draws is not None and draws.temperature != 1.0:
                draws.take_shifted(r0, shifted.clone(), index)
            exp = shifted.exp_()
            totals = _block_totals(exp)
            norm = totals.sum(-1, keepdim=True)
            if draws is not None and draws.temperature == 1.0:
                draws.take_weights(r0, exp, index, totals)
            loss = ((norm.log().to(acc) - target_shifted).squeeze(1) * valid).sum()
            if not grad:
                return loss, None, None, None
            dz = exp.div_(norm.to(acc))  # softmax, in place
            dz.scatter_add_(1, safe, torch.full_like(safe, -1, dtype=acc))
            return loss, dz, (valid.to(acc) / denom).unsqueeze(1), None  # 0 on ignored rows

        return _chunked_loss_and_grads(ctx, hidden, weight, bias, denom, chunk_terms)


class _Draws:
    """One sample from softmax(logits / temperature) and the argmax of every row, filled chunk by chunk.

    Rows are drawn in order with one float64 uniform each from ``generator``, so the result does not
    depend on which pass over the logits (the sampler's own or the cross-entropy's) supplies them.
    """

    def __init__(self, rows: int, device: torch.device, generator: torch.Generator | None, temperature: float):
        self.samples = torch.empty(rows, dtype=torch.long, device=device)
        self.argmax = torch.empty(rows, dtype=torch.long, device=device)
        self.generator = generator
        self.temperature = temperature

    @torch.no_grad()
    def take(self, r0: int, logits: torch.Tensor) -> None:
        """Draw rows ``r0 ...`` from this chunk of ``logits`` [rows, V]; overwrites ``logits``."""
        top, index = logits.max(-1, keepdim=True)
        self.take_shifted(r0, logits.sub_(top), index)

    def take_shifted(self, r0: int, shifted: torch.Tensor, index: torch.Tensor) -> None:
        """The same from ``shifted`` = logits minus their row max, and the rows' argmax ``index`` [rows, 1];
        overwrites ``shifted``."""
        if self.temperature != 1.0:
            shifted.div_(self.temperature)
        self.take_weights(r0, shifted.exp_(), index)

    def take_weights(self, r0: int, weights: torch.Tensor, index: torch.Tensor,
                     totals: torch.Tensor | None = None) -> None:
        """The same from ``weights`` = exp(shifted / temperature) and, if known, their block totals."""
        rows = slice(r0, r0 + weights.shape[0])
        self.argmax[rows] = index.squeeze(1)
        self.samples[rows] = _inverse_cdf(weights, self._uniforms(weights.shape[0], weights.device), totals)

    def _uniforms(self, rows: int, device: torch.device) -> torch.Tensor:
        """[rows, 1] float64 uniforms from the generator, on its own device, then moved to ``device``.

        A CPU generator (the trainer's) thus drives CUDA tensors too, drawing the very numbers it
        draws for CPU tensors; the copy is asynchronous (no host-device sync).
        """
        gen_device = self.generator.device if self.generator is not None else device
        u = torch.rand(rows, 1, generator=self.generator, dtype=torch.float64, device=gen_device)
        return u.to(device, non_blocking=True)


def _sample_torch(hidden, weight, bias, generator, temperature):
    _initialize_vml()
    n, v = hidden.shape[0], weight.shape[0]
    draws = _Draws(n, hidden.device, generator, temperature)
    step = _rows_per_chunk(n, v)
    for r0 in range(0, n, step):
        draws.take(r0, _logits(hidden[r0 : r0 + step], weight, bias, acc_dtype(hidden)))
    return draws.samples, draws.argmax


# Width of the vocabulary blocks of the two-level inverse CDF: the cumulative sums cover V / 256 block
# totals and then one block per row, instead of all V entries.
_CDF_BLOCK = 256


def _block_totals(weights: torch.Tensor) -> torch.Tensor:
    """Float64 sums of each row's consecutive ``_CDF_BLOCK``-wide blocks of ``weights`` [R, V] (the last may be
    shorter): [R, ceil(V / _CDF_BLOCK)]."""
    rows, v = weights.shape
    full, tail = divmod(v, _CDF_BLOCK)
    totals = weights[:, : full * _CDF_BLOCK].view(rows, full, _CDF_BLOCK).sum(-1, dtype=torch.float64)
    if tail:
        totals = torch.cat([totals, weights[:, full * _CDF_BLOCK :].sum(-1, keepdim=True, dtype=torch.float64)], 1)
    return totals


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor, totals: torch.Tensor | None = None) -> torch.Tensor:
    """Row-wise index i with cdf[i-1] <= u * total < cdf[i], for unnormalized ``weights`` [R, V] >= 0.

    Exact inverse-CDF sampling with one uniform ``u`` [R, 1] per row, where Gumbel-max needs V uniforms
    and two logarithms per row: the per-element work is one exp (done by the caller) and one summation.
    Sums run in float64. A zero weight is never chosen (``right=True`` skips empty intervals), except
    when float64 rounding puts a draw at the very top of its block (the block's total and its inner
    cumulative sum add in different orders), where the block's last entry is taken.
    """
    v = weights.shape[1]
    totals = _block_totals(weights) if totals is None else totals
    block_cdf = totals.cumsum(-1)
    target = u * block_cdf[:, -1:]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)
    within = target - (block_cdf.gather(1, block) - totals.gather(1, block))
    index = block * _CDF_BLOCK + torch.arange(_CDF_BLOCK, device=weights.device)
    in_range = index < v
    inner_cdf = weights.gather(1, index.clamp(max=v - 1)).masked_fill_(~in_range, 0).cumsum(-1, dtype=torch.float64)
    offset = torch.searchsorted(inner_cdf, within, right=True).clamp_(max=_CDF_BLOCK - 1)
    return (block * _CDF_BLOCK + offset).clamp_(max=v - 1).squeeze(1)


# ----------------------------------------------------------------------------------------------
# Public API.


def _check_head(op: str, hname: str, hidden, wname: str, weight, bname: str, bias) -> None:
    check_tensor(hname, hidden, 2, op)
    check_tensor(wname, weight, 2, op)
    check_float(hname, hidden, op)
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"{op}: {wname} must be [V, {hidden.shape[1]}] to match {hname}, got {tuple(weight.shape)}"
        )
    if bias is not None:
        check_tensor(bname, bias, 1, op)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"{op}: {bname} must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")


def _check_temperature(op: str, temperature: float) -> None:
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"{op}: temperature must be a positive number, got {temperature!r}")


def _check_generator(op: str, generator) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"{op}: generator must be a torch.Generator or None, got {type(generator).__name__}")


def _check_target(op: str, target: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, ignore_index: int) -> None:
    check_tensor("target", target, 1, op)
    if target.shape[0] != hidden.shape[0] or target.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"{op}: target must be an integer tensor of shape ({hidden.shape[0]},), "
            f"got {target.dtype} {tuple(target.shape)}"
        )
    # An out-of-range target would read out of bounds. On the host the check is free and raises this
    # ValueError; on a GPU reading the answer would stall the host once per call, so the device asserts
    # instead: a bad target fails the run at the next sync with "CUDA error: device-side assert
    # triggered" (CUDA_LAUNCH_BLOCKING=1 names this line).
    in_range = (((target >= 0) & (target < weight.shape[0])) | (target == ignore_index)).all()
    message = f"{op}: target values must be in [0, {weight.shape[0]}) or ignore_index={ignore_index}"
    if target.device.type != "cpu":
        torch._assert_async(in_range, message)
    elif not bool(in_range):
        raise ValueError(message)


def fused_linear_kl(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    temperature: float = 1.0,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Mean over rows of KL(softmax(teacher/tau) || softmax(student/tau)); no tau**2 (caller scales).

    The teacher is treated as frozen: no gradient reaches ``teacher_*``. Gradients flow to
    ``student_hidden``, ``student_weight`` and ``student_bias``.
    """
    op = "fused_linear_kl"
    _check_head(op, "student_hidden", student_hidden, "student_weight", student_weight, "student_bias", student_bias)
    _check_head(op, "teacher_hidden", teacher_hidden, "teacher_weight", teacher_weight, "teacher_bias", teacher_bias)
    if teacher_hidden.shape[0] != student_hidden.shape[0]:
        raise ValueError(
            f"{op}: teacher_hidden must have {student_hidden.shape[0]} rows like student_hidden, "
            f"got {teacher_hidden.shape[0]}"
        )
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(
            f"{op}: teacher_weight vocabulary {teacher_weight.shape[0]} != student_weight vocabulary "
            f"{student_weight.shape[0]}"
        )
    _check_temperature(op, temperature)
    teacher = tuple(None if t is None else t.detach() for t in (teacher_hidden, teacher_weight, teacher_bias))
    if resolve_backend(backend, student_hidden.device, op) == "torch":
        student_weight, student_bias = _as_activation_dtype(student_hidden, student_weight, student_bias)
        t_hidden, t_weight, t_bias = teacher
        t_weight, t_bias = _as_activation_dtype(t_hidden, t_weight, t_bias)
        return _ChunkedLinearKL.apply(student_hidden, student_weight, student_bias, t_hidden, t_weight, t_bias,
                                      float(temperature))
    from .linear_head_triton import linear_kl_triton

    return linear_kl_triton(student_hidden, student_weight, student_bias, *teacher, float(temperature))


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int = -100,
    backend: str = "auto",
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T + bias`` over rows whose target != ignore_index.

    Returns 0 (with zero gradients) when every row is ignored. Gradients flow to all three inputs.
    """
    op = "fused_linear_cross_entropy"
    _check_head(op, "hidden", hidden, "weight", weight, "bias", bias)
    _check_target(op, target, hidden, weight, ignore_index)
    if resolve_backend(backend, hidden.device, op) == "torch":
        weight, bias = _as_activation_dtype(hidden, weight, bias)
        return _ChunkedLinearCE.apply(hidden, weight, bias, target.long(), int(ignore_index), None)
    from .linear_head_triton import linear_cross_entropy_triton

    return linear_cross_entropy_triton(hidden, weight, bias, target, int(ignore_index))


def fused_linear_cross_entropy_and_sample(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    generator: torch.Generator | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, samples, argmax): :func:`fused_linear_cross_entropy` and :func:`fused_linear_sample` of
    the same rows, equal to calling the two (bit for bit, the same draws from ``generator``).

    Both paths compute each chunk's (tile's) logits once for both: ELECTRA's generator samples its
    replacements from the very logits its loss needs, and at a 128K vocabulary that second
    [rows x V] product was most of the sampling's time. The Triton path is one forward launch.
    Gradients flow to the loss only.
    """
    op = "fused_linear_cross_entropy_and_sample"
    _check_head(op, "hidden", hidden, "weight", weight, "bias", bias)
    _check_target(op, target, hidden, weight, ignore_index)
    _check_temperature(op, temperature)
    _check_generator(op, generator)
    if resolve_backend(backend, hidden.device, op) == "torch":
        weight, bias = _as_activation_dtype(hidden, weight, bias)
        draws = _Draws(hidden.shape[0], hidden.device, generator, float(temperature))
        loss = _ChunkedLinearCE.apply(hidden, weight, bias, target.long(), int(ignore_index), draws)
        return loss, draws.samples, draws.argmax
    from .linear_head_triton import linear_cross_entropy_and_sample_triton

    return linear_cross_entropy_and_sample_triton(hidden, weight, bias, target, int(ignore_index), generator,
                                                  float(temperature))


@torch.no_grad()
def fused_linear_sample(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    generator: torch.Generator | None = None,
    temperature: float = 1.0,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from softmax((hidden @ weight.T + bias) / tau) and return the row argmax.

    No gradient. The torch path samples each row by inverse CDF from one float64 uniform drawn from
    ``generator`` in row order, so it is reproducible and equals :func:`fused_linear_sample_reference`
    for the same seed. The Triton path (Gumbel-max inside the loss's forward kernel, over vocabulary
    tiles and splits) draws a 31-bit Philox key from ``generator`` (or torch's default generator)
    and adds fp32 Gumbel noise that depends on (key, row, column) only: reproducible for the same
    generator state whatever the tiling, but a different stream from the torch path.
    """
    op = "fused_linear_sample"
    _check_head(op, "hidden", hidden, "weight", weight, "bias", bias)
    _check_temperature(op, temperature)
    _check_generator(op, generator)
    if resolve_backend(backend, hidden.device, op) == "torch":
        return _sample_torch(hidden, *_as_activation_dtype(hidden, weight, bias), generator, float(temperature))
    from .linear_head_triton import linear_sample_triton

    return linear_sample_triton(hidden, weight, bias, generator, float(temperature))
