"""A pretraining step on a GPU, computed part by part from datasheet peaks: what `megakd plan` times.

No GPU has run megakd, so this is a model, not a measurement. Each part of one micro-batch is the
larger of its FLOPs at a fraction of the matmul peak and its bytes at a fraction of the memory
bandwidth (`Assumptions` names each fraction and where it comes from); the optimizer runs once
per step and the data-parallel collectives add what compute does not hide. docs/performance.md
("An electra-base step, computed") prints the table for an H100 and an A100, and
`tools/gpu_check.py` puts the measured step beside it when a GPU is lent.

The parts:

- **encoder matmuls**: the Q/K/V/output projections and the FFN, forward and both gradients
  (plus one more forward per layer under activation checkpointing), at `gemm_efficiency`;
- **attention**: QKᵀ and PV on a flash-class kernel: 2 forward matmuls, 5 in backward (it
  recomputes the scores; 7 in megakd's Triton kernel for relative positions with dropout), at
  `attention_efficiency`; with relative positions on the SDPA path (`attention_kernel: sdpa`), the
  [B, heads, L, L] bias with the key mask folded in is also written, read, and its gradient written
  and reduced in every layer;
- **elementwise**: layer norms, dropouts, residual adds, GELU and the head reshapes, counted in
  [tokens, hidden] tensors read and written (`ELEMENTWISE_PASSES`), at `bandwidth_efficiency`;
- **generator head**: the MLM transform's matmuls at the masked positions, the fused vocabulary
  loss's forward (with the replacements sampled in the same pass) and its backward
  (`megakd.bench.roofline.head_backward_roofline`);
- **discriminator head**: the dense layer and the RTD projection over every position;
- **optimizer** (per step): fused AdamW reads and writes every local parameter's states;
- **communication** (per step): the data-parallel collectives of the ZeRO stage
  (`megakd.bench.planner`), minus the share `overlap` hides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megakd.bench.flops import (
    attention_flops_per_token,
    embedding_projection_flops_per_token,
    projection_flops_per_token,
    step_flops,
)
from megakd.bench.roofline import head_backward_roofline
from megakd.config import Config
from megakd.kernels.dispatch import DEFAULT_HEAD_BACKWARD
from megakd.models.encoder import EncoderConfig, attention_kernel

# Elementwise traffic of one post-LN layer per token, in [tokens, hidden] tensors read or written in
# the activations' dtype (the FFN's GELU counts 4: its input and output are 4H wide). Forward: two
# layer norms (read, write: 4), two dropouts (read, write: 4, plus a byte mask each, counted below),
# two residual adds (two reads, one write: 6), GELU (read, write, 4H: 8), Q/K/V into heads and the
# attention output back (3 + 3 + 2: 8) = 30. Backward reads what forward saved and writes a gradient
# for each: twice forward. Masks: 2 bytes per element of H per layer written in forward and read back.
ELEMENTWISE_PASSES = 90
MASK_BYTES_PER_HIDDEN = 4

# Fused AdamW, bytes per parameter per step: reads fp32 master, fp32 gradient, m, v (16), writes master,
# m, v (12) and, with 16-bit training, the 16-bit working copy (2).
ADAM_BYTES = {"mixed": 30, "fp32": 28}

# The sampler's Gumbel noise per (row, token) pair, in fp32 operations: a quarter of a Philox-4x32-10
# call (10 rounds of 2 multiplies and ~4 xor/adds for 4 words), two logarithms (~8 each on the special
# function units) and the compare and select: ~40. Counted at the fp32 CUDA-core rate.
SAMPLER_OPS_PER_PAIR = 40


@dataclass(frozen=True)
class Assumptions:
    """The fractions of datasheet peaks each kind of work reaches: assumptions until a GPU measures them.

    - `gemm_efficiency` 0.70: large cuBLAS GEMMs (thousands of rows by 768-3072) typically run at
      70-80 % of the dense tensor-core peak on A100 and H100; K = 768 is at the low end.
    - `attention_efficiency`: flash-class attention forward plus backward at head dim 64. The
      FlashAttention-2 paper reports about 50 % of an A100's peak for forward plus backward at head
      dim 64, the FlashAttention-3 paper about 35 % for FlashAttention-2 on an H100, and PyTorch's
      FlexAttention announcement 85-90 % of FlashAttention-2: 0.45 (A100), 0.30 (H100). The fused
      vocabulary kernels (a flash-like tiled matmul with an online softmax) are counted the same.
    - `bandwidth_efficiency` 0.80: streaming elementwise kernels reach 80-90 % of datasheet bandwidth.
    """

    gemm_efficiency: float = 0.70
    attention_efficiency: dict[str, float] = field(default_factory=lambda: {"A100-SXM4": 0.45, "H100-SXM5": 0.30})
    bandwidth_efficiency: float = 0.80
    default_attention_efficiency: float = 0.40  # a GPU not named above


@dataclass
class StepPrediction:
    """Seconds per optimizer step by part (micro-batch parts times the accumulation), and the totals."""

    parts: dict[str, float]
    micro_batch_s: float  # one micro-batch's compute
    step_s: float
    model_flops: float  # per GPU per step (megakd.bench.flops: what MFU divides)
    peak_tflops: float
    matmul: str  # the matmul class the peak is for: bf16, fp16, tf32 or fp32

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_s * self.peak_tflops * 1e12)


def matmul_class(precision: str, tf32: bool, hw) -> str:
    """The peak a run's matmuls reach: 16-bit tensor cores, or for fp32 training TF32 where it is allowed
    and the GPU has it (a V100 has not), else IEEE fp32."""
    if precision != "fp32":
        return precision
    return "tf32" if tf32 and "tf32" in hw.peak_tflops else "fp32"


class _Machine:
    """Seconds of FLOPs and bytes on one GPU under the assumptions."""

    def __init__(self, hw, matmul: str, assume: Assumptions):
        if matmul not in hw.peak_tflops:
            raise ValueError(f"{hw.name} has no {matmul} peak (known: {', '.join(hw.peak_tflops)})")
        self.peak = hw.peak_tflops[matmul] * 1e12
        self.fp32 = hw.peak_tflops["fp32"] * 1e12
        self.bandwidth = hw.hbm_gbps * 1e9 * assume.bandwidth_efficiency
        self.gemm = assume.gemm_efficiency
        self.attention = assume.attention_efficiency.get(hw.name, assume.default_attention_efficiency)

    def gemm_s(self, flops: float) -> float:
        return flops / (self.peak * self.gemm)

    def fused_s(self, flops: float, moved: float) -> float:
        """A flash-like fused kernel: its matmuls at the attention efficiency, or its bytes, the larger."""
        return max(flops / (self.peak * self.attention), moved / self.bandwidth)

    def bytes_s(self, moved: float) -> float:
        return moved / self.bandwidth


# Matmuls of a flash-class attention backward, per forward's 2 (QKᵀ, PV): FlashAttention-2's one kernel
# recomputes the scores (5); megakd's Triton kernel for relative positions with dropout splits dK/dV from
# dQ without atomics, each recomputing QKᵀ and dO·Vᵀ (7: kernels/attention_triton.py).
BACKWARD_MATMULS = {"triton": 7}
FLASH_BACKWARD_MATMULS = 5


def _encoder_parts(m: _Machine, enc: EncoderConfig, sequences: int, seq_len: int, elem: int,
                   kernel: str, checkpointing: bool) -> dict[str, float]:
    tokens = sequences * seq_len
    h = enc.hidden_size
    passes = 4 if checkpointing else 3  # forward + two gradients (+ the recomputed forward)
    projections = tokens * (enc.num_layers * projection_flops_per_token(enc)
                            + embedding_projection_flops_per_token(enc))
    scores = tokens * enc.num_layers * attention_flops_per_token(enc, seq_len)  # QKᵀ and PV, forward
    backward = BACKWARD_MATMULS.get(kernel, FLASH_BACKWARD_MATMULS)
    attention_passes = (2 + backward) / 2 + (1 if checkpointing else 0)  # in forwards' worth of QKᵀ and PV
    moved = (ELEMENTWISE_PASSES * elem + MASK_BYTES_PER_HIDDEN) * tokens * h * enc.num_layers
    parts = {
        "encoder matmuls": m.gemm_s(passes * projections),
        "attention": m.fused_s(attention_passes * scores, 4 * tokens * h * elem * enc.num_layers),
        "elementwise": m.bytes_s(moved),
    }
    if kernel == "sdpa" and enc.position_encoding == "t5_relative":
        # the [B, heads, L, L] bias: written (masked), read in forward and backward, gradient written, reduced
        parts["relative bias"] = m.bytes_s(5 * sequences * enc.num_heads * seq_len**2 * elem * enc.num_layers)
    return parts


def vocabulary_head_seconds(m: _Machine, hw, cfg: Config, rows: int, matmul: str, assume: Assumptions,
                            elem: int) -> dict[str, float]:
    """The fused vocabulary loss at `rows` masked positions: forward, with the replacements sampled in the
    same pass (Gumbel noise per (row, token) pair at the fp32 rate), and the configured backward
    (`kernels.head_backward`, timed by megakd/bench/roofline.py at the assumed efficiencies; the atomic
    one with its atomics at their worst)."""
    gen = cfg.model.generator
    logits = 2.0 * rows * gen.vocab_size * gen.embed_dim
    inputs = (rows + gen.vocab_size) * gen.embed_dim * elem
    noise = rows * gen.vocab_size * SAMPLER_OPS_PER_PAIR / m.fp32
    variant = cfg.kernels.head_backward
    if variant == "auto":
        variant = DEFAULT_HEAD_BACKWARD  # the roofline's choice (tests/kernels/test_head_backward.py holds it)
    backward = head_backward_roofline(hw, rows, gen.embed_dim, gen.vocab_size, matmul, assume.gemm_efficiency,
                                      assume.bandwidth_efficiency)[variant]["seconds"][1]
    return {"vocabulary forward + sampling": m.fused_s(logits, inputs) + noise, "vocabulary backward": backward}


def micro_batch_parts(cfg: Config, hw, sequences: int, matmul: str, assume: Assumptions | None = None,
                      checkpointing: bool | None = None) -> dict[str, float]:
    """Seconds of each part of one micro-batch of `sequences` sequences on one GPU (`checkpointing`:
    every encoder's, instead of each model's `activation_checkpointing`)."""
    assume = assume or Assumptions()
    m = _Machine(hw, matmul, assume)
    seq_len = cfg.data.seq_len
    elem = 2 if matmul in ("bf16", "fp16") else 4
    models = [cfg.model.generator] + ([cfg.model.discriminator] if cfg.model.objective == "electra" else [])
    parts: dict[str, float] = {}
    for enc in models:
        kernel = attention_kernel(enc, training=True, flex_compiles=True)  # what a CUDA training step runs
        recompute = enc.activation_checkpointing if checkpointing is None else checkpointing
        for name, seconds in _encoder_parts(m, enc, sequences, seq_len, elem, kernel, recompute).items():
            parts[name] = parts.get(name, 0.0) + seconds
    flops = step_flops(cfg, sequences).parts  # the heads: forward FLOPs as megakd runs them
    masked = round(cfg.data.mask_prob * sequences * seq_len)
    parts["generator head"] = m.gemm_s(3 * flops["generator_head"]["forward"])
    parts.update(vocabulary_head_seconds(m, hw, cfg, masked, matmul, assume, elem))
    if "discriminator_head" in flops:
        parts["discriminator head"] = m.gemm_s(3 * flops["discriminator_head"]["forward"])
    return parts


def optimizer_seconds(cfg: Config, hw, params_local: float, assume: Assumptions | None = None) -> float:
    """Fused AdamW over `params_local` parameters (the rank's optimizer partition): bytes at the bandwidth."""
    adam = ADAM_BYTES["fp32" if cfg.train.precision == "fp32" else "mixed"]
    return params_local * adam / (hw.hbm_gbps * 1e9 * (assume or Assumptions()).bandwidth_efficiency)


def predict_step(cfg: Config, hw, micro_batch: int, accumulation: int, params_local: float,
                 comm_s: float = 0.0, overlap: float = 0.0, tf32: bool = True,
                 assume: Assumptions | None = None) -> StepPrediction:
    """One optimizer step on one GPU: `accumulation` micro-batches of `micro_batch` sequences, AdamW over
    `params_local` parameters (its optimizer partition), and `comm_s` of collectives, `overlap` hidden."""
    assume = assume or Assumptions()
    matmul = matmul_class(cfg.train.precision, tf32, hw)
    micro = micro_batch_parts(cfg, hw, micro_batch, matmul, assume)
    parts = {name: accumulation * s for name, s in micro.items()}
    parts["optimizer"] = optimizer_seconds(cfg, hw, params_local, assume)
    parts["communication (exposed)"] = (1 - overlap) * comm_s
    flops = step_flops(cfg, micro_batch).model * accumulation
    return StepPrediction(parts, sum(micro.values()), sum(parts.values()), flops, hw.peak_tflops[matmul], matmul)


def prediction_table(predictions: dict[str, StepPrediction], measured: dict[str, float] | None = None) -> str:
    """Markdown: one row per part, one column per prediction (ms per step), then the step and its MFU;
    `measured` (column name -> seconds per step) adds a measured row beside the computed one."""
    names = list(predictions)
    parts = list(dict.fromkeys(p for pred in predictions.values() for p in pred.parts))
    lines = ["| part | " + " | ".join(f"{n} ms" for n in names) + " |", "|---|" + "---|" * len(names)]
    for part in parts:
        lines.append(f"| {part} | " + " | ".join(f"{predictions[n].parts.get(part, 0.0) * 1e3:,.1f}"
                                                 for n in names) + " |")
    lines.append("| **step (computed)** | " + " | ".join(f"**{predictions[n].step_s * 1e3:,.0f}**" for n in names)
                 + " |")
    lines.append("| MFU (computed) | " + " | ".join(f"{predictions[n].mfu:.0%} of {predictions[n].peak_tflops:g} "
                                                    f"{predictions[n].matmul}" for n in names) + " |")
    if measured:
        lines.append("| step (measured) | " + " | ".join(
            f"{measured[n] * 1e3:,.0f}" if n in measured else "not measured" for n in names) + " |")
    return "\n".join(lines)
