"""Per-device memory of an ELECTRA job: model states (both models, both optimizers) and activations.

Parameter counts come from the real megakd models built on the meta device, so they cannot drift
from the code (no tensor is allocated, even for the 665M-parameter large pair). Model-state bytes
use DeepSpeed's own accounting, so they agree with `estimate_zero2/3_model_states_mem_needs`
(tests check this on real models). With 16-bit training (bf16/fp16) every parameter carries:

    16-bit weights 2 B, 16-bit gradients 2 B, fp32 gradient partition 4 B,
    fp32 master weights + Adam m + v 12 B.

ZeRO-1 partitions the optimizer side (fp32 gradients, master weights, m, v) over the N
data-parallel ranks, ZeRO-2 also the 16-bit gradients, ZeRO-3 also the 16-bit weights (plus the
largest module gathered whole, weights and gradients). fp32 training has no master copy or
separate gradient partition: 4 B weights, 4 B gradients, 8 B Adam states.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from megakd.config import Config
from megakd.models.electra import Discriminator, MaskedLM
from megakd.models.encoder import FLEX_BLOCK, EncoderConfig, attention_kernel

GiB = 1024**3

# Elements of one [rows x vocab] chunk in the fused vocabulary loss (kernels/linear_head.py).
FUSED_CHUNK_ELEMS = 2**25


@dataclass
class Block:
    """A contiguous piece of one model, the unit pipeline stages are cut from."""

    model: str  # generator | discriminator
    kind: str  # embeddings | layer | head
    params: int
    largest_module: int  # parameters held directly by its largest module (ZeRO-3 gathers it whole)


def build_meta_models(cfg: Config) -> dict[str, nn.Module]:
    """The config's real generator (and discriminator) with parameters on the meta device."""
    with torch.device("meta"):
        models: dict[str, nn.Module] = {"generator": MaskedLM(cfg.model.generator)}
        if cfg.model.objective == "electra":
            models["discriminator"] = Discriminator(cfg.model.discriminator)
    return models


def model_blocks(cfg: Config) -> list[Block]:
    """Generator then discriminator, each as embeddings, layers and head, with real parameter counts.

    Parameters are grouped by name (`encoder.layers.<i>.` → layer i; the rest of the encoder →
    embeddings, including the shared relative-position table; everything else → head). A tied
    matrix is counted once, with the embeddings that own it.
    """
    blocks: list[Block] = []
    for name, model in build_meta_models(cfg).items():
        groups: dict[str, list[nn.Parameter]] = {}
        for pname, p in model.named_parameters():
            m = re.match(r"encoder\.layers\.(\d+)\.", pname)
            key = f"layer{m.group(1)}" if m else ("embeddings" if pname.startswith("encoder.") else "head")
            groups.setdefault(key, []).append(p)
        largest = {id(p): 0 for p in model.parameters()}
        for module in model.modules():
            own = sum(p.numel() for p in module.parameters(recurse=False))
            for p in module.parameters(recurse=False):
                largest[id(p)] = max(largest[id(p)], own)
        n_layers = model.config.num_layers
        for key in ["embeddings", *(f"layer{i}" for i in range(n_layers)), "head"]:
            params = groups.get(key, [])
            blocks.append(Block(name, "layer" if key.startswith("layer") else key,
                                sum(p.numel() for p in params), max((largest[id(p)] for p in params), default=0)))
    return blocks


def parameter_counts(cfg: Config) -> dict[str, int]:
    """Trainable parameters per model (and the total), from the meta-device models."""
    counts: dict[str, int] = {}
    for b in model_blocks(cfg):
        counts[b.model] = counts.get(b.model, 0) + b.params
    counts["total"] = sum(counts.values())
    return counts


def model_state_bytes(params: int, largest_module: int, zero_stage: int, dp: int, precision: str) -> dict[str, float]:
    """Bytes per device of weights, gradients and optimizer states for `params` parameters."""
    mixed = precision != "fp32"
    weights = 2 if mixed else 4  # working copy
    grads = 2 if mixed else 4  # gradients in the working precision
    grad_fp32 = 4 if mixed else 0  # the fp32 gradient partition the optimizer reads (fp32: the grads themselves)
    optim = 12 if mixed else 8  # (fp32 master +) Adam m and v
    p, n = float(params), dp
    if zero_stage == 0:
        return {"params": weights * p, "grads": (grads + grad_fp32) * p, "optimizer": optim * p}
    if zero_stage == 1:
        return {"params": weights * p, "grads": grads * p + grad_fp32 * p / n, "optimizer": optim * p / n}
    if zero_stage == 2:
        return {"params": weights * p, "grads": (grads + grad_fp32) * p / n, "optimizer": optim * p / n}
    if zero_stage == 3:
        return {"params": weights * (p / n + largest_module),
                "grads": (grad_fp32 or grads) * p / n + grads * largest_module,
                "optimizer": optim * p / n}
    raise ValueError(f"zero_stage: expected 0, 1, 2 or 3, got {zero_stage}")


def layer_activation_bytes(cfg: EncoderConfig, seq_len: int, micro_batch: int, elem: int,
                           mask_bytes: int = 1, zero3: bool = False) -> float:
    """Bytes one encoder layer keeps for backward for one micro-batch (no checkpointing).

    Counted tensor by tensor for this layer with fused attention (no [L x L] probabilities
    kept; the fused kernels regenerate attention dropout from the RNG state): attention input,
    Q, K, V, attention output (a view of the output projection's input), log-sum-exp, residual
    sums and statistics of both LayerNorms, FFN input, GELU input and output, and the two
    hidden-dropout masks (`mask_bytes`: 1 for CUDA's bool masks; CPU dropout keeps a mask in the
    activation dtype). The attention kernel is the one a CUDA training step runs (`attention_kernel`):
    SDPA keeps the key mask as an additive bias, and a relative-position bias masked by padding as
    [B, heads, L, L]; flex keeps the unmasked [1, heads, L', L'] bias in fp32 (L' = L padded to
    FLEX_BLOCK), the key-mask row [B, L'] and its BlockMask (4 block counts [B, 1, n] and 4 block
    index tables [B, 1, n, n] in int32, n = L'/FLEX_BLOCK; packed rows keep [B, L', L'] bool in
    place of the key row). Those are made once per forward and shared by the layers in
    `Encoder.forward`, once per layer on pipeline stages; counted per layer here (an upper bound
    outside pipelines).
    With `fused_qkv` the concatenated [3H, H] projection weight is kept too (a copy, not a parameter).
    Under ZeRO-3 (`zero3`) DeepSpeed runs every linear layer through its own memory-efficient linear,
    which keeps the bias as well: with `fused_qkv` that is the concatenated [3H] bias, a copy (torch's
    linear adds the bias inside the matmul and keeps none; the other layers' biases are parameters).
    """
    s, b, h, i, a = seq_len, micro_batch, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads
    sbh = s * b * h
    mask = mask_bytes if cfg.dropout > 0 else 0
    attention = 5 * elem * sbh + 4 * b * a * s + mask * sbh
    if attention_kernel(cfg, training=True, flex_compiles=True) == "flex":
        padded = s + -s % FLEX_BLOCK
        blocks = padded // FLEX_BLOCK
        attention += b * padded + 4 * 4 * b * blocks * (1 + blocks)
        if cfg.position_encoding == "t5_relative":
            attention += 4 * a * padded * padded
    else:
        attention += elem * b * s
        if cfg.position_encoding == "t5_relative":
            attention += elem * b * a * s * s
    if cfg.fused_qkv:
        attention += elem * 3 * h * (h + 1 if zero3 else h)
    ffn = elem * sbh + 2 * elem * s * b * i + mask * sbh  # input, GELU input and output, dropout mask
    norms = 2 * elem * sbh + 2 * 2 * 4 * s * b  # the two residual sums, LayerNorm mean/rstd (fp32)
    return attention + ffn + norms


def mlm_head_bytes(cfg: EncoderConfig, masked: float, tokens: float, elem: int) -> dict[str, float]:
    """The generator's vocabulary projection: what each design keeps for backward.

    `dense`: logits over all positions materialised (fp32 logits + log-softmax, BERT-style);
    `sparse`: the same at masked positions only; `sparse_fused` (what megakd runs): the fused loss
    keeps only its input/weight gradients and one [chunk x vocab] temporary.
    """
    v, e = cfg.vocab_size, cfg.embed_dim
    fused = 4 * masked * e + 4 * v * e + 4 * min(FUSED_CHUNK_ELEMS, masked * v)
    return {"dense": 8 * tokens * v, "sparse": 8 * masked * v, "sparse_fused": fused}


def block_activation_bytes(block: Block, enc: EncoderConfig, seq_len: int, micro_batch: int, elem: int,
                           mask_prob: float, checkpointing: bool, zero3: bool = False) -> float:
    """Bytes a block keeps for backward for one micro-batch (`zero3`: under DeepSpeed's ZeRO-3 linear)."""
    tokens = seq_len * micro_batch
    if block.kind == "layer":
        full = layer_activation_bytes(enc, seq_len, micro_batch, elem, zero3=zero3)
        # Checkpointed: only the layer input stays; the recomputed layer is added once per stage.
        return elem * tokens * enc.hidden_size if checkpointing else full
    if block.kind == "embeddings":
        width = enc.embed_dim
        project = elem * tokens * width if enc.embed_dim != enc.hidden_size else 0
        return 2 * elem * tokens * width + tokens * (1 if enc.dropout > 0 else 0) * width + project
    if block.model == "generator":
        masked = mask_prob * tokens
        transform = elem * masked * (enc.hidden_size + 3 * enc.embed_dim)
        return transform + mlm_head_bytes(enc, masked, tokens, elem)["sparse_fused"]
    return 2 * elem * tokens * enc.hidden_size + 4 * tokens * enc.hidden_size  # dense, GELU; RTD grad (fp32)
