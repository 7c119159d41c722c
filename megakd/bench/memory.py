"""Per-device memory of an ELECTRA job: model states (both models, both optimizers) and activations.

Parameter counts come from the real megakd models built on the meta device, so they cannot drift
from the code (no tensor is allocated, even for the 665M-parameter large pair). Model states are
counted per DeepSpeed engine (one per optimized unit: two under DecoupledOptim) as the optimizer
DeepSpeed 0.19 builds for megakd's derived config holds them (`engine_state_bytes`), checked tensor
by tensor against real engines on CPU (tests/bench/test_memory.py). With n data-parallel ranks, p
parameters and 16-bit training (w = 2; fp32 training w = 4):

- ZeRO-0: the 16-bit weights and gradients, fp32 master weights and Adam m, v in full (fp32: no
  master copy);
- ZeRO-1 + bf16 (fp32 accumulation: BF16_Optimizer): the bf16 weights and gradients, an fp32
  gradient buffer of the whole model (4 B per parameter, not partitioned), and 1/n of the fp32
  master weights and Adam states;
- ZeRO-1/2 otherwise (DeepSpeedZeroOptimizer): the 16-bit weights and 1/n of fp32 gradients, master
  weights and states (fp32 training: also the gradients of the parameters that straddle the partition's
  edges, up to one parameter per group, not counted); ZeRO-1 + fp16 also keeps an fp32 accumulator per
  parameter (read from its code: DeepSpeed's CPU accelerator builds no fp16 engine to measure); ZeRO-2's
  reduce buckets
  (`reduce_bucket_size` elements, twice with `overlap_comm`) exist while backward runs;
- ZeRO-3: 1/n of everything, plus the parameters of at most `param_persistence_threshold` elements
  kept whole on every rank, a `reduce_bucket_size` bucket in the communication dtype held for the
  whole run, and while forward and backward run the gathered weights: the whole model while it is
  below `max_live_parameters` and `max_reuse_distance` (DeepSpeed's defaults, 1e9: nothing is
  released between forward and backward), else the largest module.

Flat buffers are padded per parameter group to a multiple of 2n elements (ZeRO-3: each parameter to
a multiple of n). Transients of the optimizer step itself are not counted: activations are freed
by then.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from megakd.config import Config
from megakd.engine.optim import param_groups
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
    groups: tuple[int, ...] = ()  # elements per optimizer parameter group (megakd.engine.optim.param_groups)
    sizes: tuple[int, ...] = ()  # elements of each parameter (ZeRO-3 partitions each one)


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
            optim_groups = tuple(sum(p.numel() for p in g["params"])
                                 for g in param_groups(((str(i), p) for i, p in enumerate(params)), 0.0))
            blocks.append(Block(name, "layer" if key.startswith("layer") else key,
                                sum(p.numel() for p in params), max((largest[id(p)] for p in params), default=0),
                                optim_groups, tuple(p.numel() for p in params)))
    return blocks


def parameter_counts(cfg: Config) -> dict[str, int]:
    """Trainable parameters per model (and the total), from the meta-device models."""
    counts: dict[str, int] = {}
    for b in model_blocks(cfg):
        counts[b.model] = counts.get(b.model, 0) + b.params
    counts["total"] = sum(counts.values())
    return counts


# DeepSpeed 0.19's values for the `zero_optimization` keys that size buffers and collectives, where the
# engine's config leaves them out (tests/bench/test_memory.py checks them against DeepSpeedZeroConfig).
DEEPSPEED_ZERO_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "contiguous_gradients": True,
    "use_multi_rank_bucket_allreduce": True,
    "param_persistence_threshold": 100_000,
    "max_live_parameters": 1_000_000_000,
    "max_reuse_distance": 1_000_000_000,
}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ZeroSettings:
    """What an engine's DeepSpeed config decides about its buffers and gradient collectives."""

    reduce_bucket_size: int
    overlap_comm: bool
    contiguous_gradients: bool
    multi_rank_allreduce: bool  # ZeRO-2 all-reduces each bucket (DeepSpeed's default) instead of reducing to owners
    param_persistence_threshold: int
    max_live_parameters: int
    max_reuse_distance: int
    comm_bytes: int  # bytes per element of the gradient collectives (communication_data_type)

    @classmethod
    def from_config(cls, ds: dict, precision: str) -> ZeroSettings:
        """From a DeepSpeed config dict (DeepSpeed's defaults for what it leaves out: overlap_comm is on
        at ZeRO-3 only, and gradients travel in the model's dtype)."""
        zero = {**DEEPSPEED_ZERO_DEFAULTS, **ds.get("zero_optimization", {})}
        comm = ds.get("communication_data_type") or precision
        if comm not in DTYPE_BYTES:
            raise ValueError(f"communication_data_type: expected one of {', '.join(DTYPE_BYTES)}, got {comm!r}")
        return cls(int(zero["reduce_bucket_size"]), bool(zero.get("overlap_comm", zero.get("stage") == 3)),
                   bool(zero["contiguous_gradients"]), bool(zero["use_multi_rank_bucket_allreduce"]),
                   int(zero["param_persistence_threshold"]), int(zero["max_live_parameters"]),
                   int(zero["max_reuse_distance"]), DTYPE_BYTES[comm])

    def keeps_gathered(self, elements: int) -> bool:
        """Whether ZeRO-3 keeps `elements` partitioned parameters gathered from forward into backward: it
        releases none while the live ones fit `max_live_parameters` and their next use is within
        `max_reuse_distance` elements (at most the model away)."""
        return elements <= min(self.max_live_parameters, self.max_reuse_distance)


@dataclass(frozen=True)
class EngineShape:
    """The parameters one DeepSpeed engine's optimizer is built over."""

    groups: tuple[int, ...]  # elements per non-empty parameter group
    sizes: tuple[int, ...]  # elements of each parameter
    largest_module: int

    @classmethod
    def of(cls, blocks: list[Block]) -> EngineShape:
        """The engine over `blocks` (their parameter groups merged group by group, as one optimizer holds them)."""
        width = max((len(b.groups) for b in blocks), default=0)
        groups = tuple(sum(b.groups[i] for b in blocks if i < len(b.groups)) for i in range(width))
        return cls(tuple(g for g in groups if g), tuple(s for b in blocks for s in b.sizes),
                   max((b.largest_module for b in blocks), default=0))

    @property
    def params(self) -> int:
        return sum(self.sizes)

    def flat(self, dp: int) -> int:
        """Elements of the flat 16-bit buffer ZeRO-1/2 and BF16_Optimizer build: each group padded to a
        multiple of 2 x dp (a 4-byte aligned partition per rank)."""
        return sum(-(-g // (2 * dp)) * 2 * dp for g in self.groups)

    def partition(self, dp: int) -> int:
        """Elements of one rank's ZeRO-3 partitions: every parameter split into dp equal, padded parts."""
        return sum(-(-s // dp) for s in self.sizes)

    def persistent(self, dp: int, threshold: int) -> tuple[int, int]:
        """ZeRO-3's parameters kept whole on every rank (at most `threshold` elements): (elements, elements
        as gathered, each padded to a multiple of dp)."""
        small = [s for s in self.sizes if s <= threshold]
        return sum(small), sum(-(-s // dp) * dp for s in small)


def engine_state_bytes(shape: EngineShape, zero_stage: int, dp: int, precision: str,
                       zero: ZeroSettings) -> dict[str, float]:
    """Bytes per rank one engine holds (module docstring), by lifetime: `params`, `grads`, `optimizer` and
    `buffers` for the whole step; `transient` only while forward and backward run (ZeRO-2's reduce buckets,
    ZeRO-3's gathered weights and the largest module's 16-bit gradients)."""
    w = DTYPE_BYTES[precision]
    p, n, c = shape.params, dp, zero.comm_bytes
    steps = 4 * len(shape.groups)  # Adam's step counter per flat tensor it updates
    if zero_stage == 0:  # the engine's own DDP-style path: every tensor whole, one Adam step per parameter
        master = 4 * p if w == 2 else 0
        return {"params": w * p, "grads": w * p, "optimizer": master + 8 * p + 4 * len(shape.sizes),
                "buffers": 0.0, "transient": 0.0}
    if zero_stage in (1, 2):
        flat = shape.flat(n)
        part = flat / n
        out = {"params": w * flat, "grads": 4 * part, "optimizer": 12 * part + steps, "buffers": 0.0,
               "transient": 0.0}
        if zero_stage == 1 and precision == "bf16":  # BF16_Optimizer: bf16 grads + a whole fp32 buffer
            out["grads"] = 2 * p + 4 * flat
        elif zero_stage == 1 and precision == "fp16":  # fp32 accumulators beside the partition
            out["grads"] += 4 * p
        if zero_stage == 2 and zero.contiguous_gradients:
            bucket = zero.reduce_bucket_size
            out["transient"] = (2 if zero.overlap_comm else 1) * bucket * w + (bucket * c if c != w else 0)
        return out
    if zero_stage == 3:
        part = shape.partition(n)
        small, small_gathered = shape.persistent(n, zero.param_persistence_threshold)
        rest = p - small
        gathered = rest if zero.keeps_gathered(rest) else max(min(zero.max_live_parameters, rest),
                                                               shape.largest_module)
        return {"params": w * (part + small_gathered), "grads": 4 * part, "optimizer": 12 * part + steps,
                "buffers": zero.reduce_bucket_size * c if zero.contiguous_gradients else 0.0,
                "transient": w * gathered + w * shape.largest_module}
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
    outside pipelines). The triton kernel (megakd/kernels/attention.py) keeps q, k, v, its output and
    the log-sum-exp like the others, plus the key row [B, L] (bool), and for T5 relative positions the
    bias of each offset [heads, 2L - 1] (the table's dtype, taken as the activations') and the offsets'
    buckets [2L - 1] (int32): nothing of [L x L].
    With `fused_qkv` the concatenated [3H, H] projection weight is kept too (a copy, not a parameter).
    Under ZeRO-3 (`zero3`) DeepSpeed runs every linear layer through its own memory-efficient linear,
    which keeps the bias as well: with `fused_qkv` that is the concatenated [3H] bias, a copy (torch's
    linear adds the bias inside the matmul and keeps none; the other layers' biases are parameters).
    """
    s, b, h, i, a = seq_len, micro_batch, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads
    sbh = s * b * h
    mask = mask_bytes if cfg.dropout > 0 else 0
    attention = 5 * elem * sbh + 4 * b * a * s + mask * sbh
    kernel = attention_kernel(cfg, training=True, flex_compiles=True)
    if kernel == "triton":
        attention += b * s
        if cfg.position_encoding == "t5_relative":
            attention += (elem * a + 4) * (2 * s - 1)
    elif kernel == "flex":
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
