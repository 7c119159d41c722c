"""A BERT/ELECTRA encoder: post-LN Transformer layers over word + position + token-type embeddings.

The layout and the initialisation follow HuggingFace BERT/ELECTRA exactly so that absolute-position
models map 1:1 onto `ElectraModel`/`BertModel` (see `hf_mapping.py`). Two options go beyond HF:
T5 relative position buckets (one bias table shared by all layers), Admin initialisation
(Liu et al. 2020), whose residual scales ω are set by a profiling pass in `admin_initialize`, and
packed samples: with `segment_ids` (several documents per row, 0 = padding) every document gets
its own positions from 0 and attends only to itself, so it computes exactly what it would alone.

Attention runs through one of three kernels (`attention_kernel`). SDPA takes the relative bias and the
key mask as one additive [B, heads, L, L] `attn_mask`, which needs a gradient: no flash kernel takes it,
and that tensor and its gradient are materialised. flex_attention (torch.nn.attention.flex_attention)
adds the [1, heads, L, L] bias inside its fused kernel (`score_mod`) and skips masked blocks
(`BlockMask`), keeping only the log-sum-exp; it has no attention dropout, so `auto` uses it only
while that dropout is off (docs/performance.md). "triton" is megakd's flash kernel
(`megakd.kernels.attention.relative_attention`): it reads the [buckets, heads] table through the
[2L - 1] offset buckets, takes the key mask as a [B, L] row or packed rows as segment labels, and has
attention dropout, so `auto` uses it for T5 relative positions while that dropout is on.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils._triton import has_triton
from torch.utils.checkpoint import checkpoint

from megakd.models.dropout import Dropout, attention

POSITION_ENCODINGS = ("absolute", "t5_relative")
RELATIVE_INITS = ("normal", "local")
INITS = ("normal", "admin")
ADMIN_PROFILES = ("reference", "bert")
ATTENTION_KERNELS = ("auto", "sdpa", "flex", "triton")
FLEX_BLOCK = 128  # flex_attention's BlockMask block (and its kernels' largest tile) along queries and keys

# EncoderConfig fields that say how to compute, not what: left out of exported model configs
COMPUTE_FIELDS = ("activation_checkpointing", "fused_qkv", "attention_kernel")


# The largest size a config may give each field: far above any model trained today (a 1,024-layer,
# 65,536-wide encoder), so that a config read from a file (a model directory, an export, an HF
# config.json) cannot make megakd build millions of layers or a table of 10**12 rows before its
# weights are checked against it.
SIZE_LIMITS = {"vocab_size": 1 << 24, "hidden_size": 1 << 16, "num_layers": 1 << 10, "num_heads": 1 << 10,
               "intermediate_size": 1 << 18, "max_position_embeddings": 1 << 20, "type_vocab_size": 1 << 10,
               "embedding_size": 1 << 16}


@dataclass
class EncoderConfig:
    vocab_size: int | str = 30522  # pretraining configs also take "auto": the tokenizer's size, set before building
    hidden_size: int = 256  # width of every layer
    num_layers: int = 12  # Transformer layers
    num_heads: int = 4  # attention heads per layer (hidden_size must be a multiple)
    intermediate_size: int = 1024  # FFN width (4×hidden by convention; explicit here)
    embedding_size: int | None = None  # null = hidden_size; smaller → ELECTRA-style embeddings_project
    max_position_embeddings: int = 512  # longest sequence (and size of the absolute position table)
    type_vocab_size: int = 2  # token types (segments A and B of a sentence pair)
    position_encoding: str = "absolute"  # "absolute" (learned table) | "t5_relative" (bucketed bias per head)
    relative_buckets: int = 32  # t5_relative: distance buckets (even, >= 4), half per direction
    relative_max_distance: int = 128  # t5_relative: distances from here on share the last bucket
    # "normal" (N(0, initializer_range)) | "local" (each head starts biased to nearby tokens)
    relative_init: str = "normal"
    dropout: float = 0.1  # hidden dropout
    attention_dropout: float = 0.1  # dropout on the attention probabilities
    layer_norm_eps: float = 1e-12  # ε of every LayerNorm
    initializer_range: float = 0.02  # std of the normal init of weights and embeddings
    init: str = "normal"  # "normal" (BERT/HF init) | "admin"
    # init=admin: "reference" (Xavier layers, profiled in train mode, as the Admin authors' code) | "bert"
    # (BERT's N(0, 0.02) layers, profiled in eval mode on real tokens); models/admin.py
    admin_profile: str = "reference"
    activation_checkpointing: bool = False  # recompute each layer in backward: less memory, more compute
    fused_qkv: bool = True  # one [H → 3H] matmul for query, key and value (same parameters; SelfAttention)
    pad_token_id: int = 0  # the padding id, whose embedding row never trains (pretraining: the tokenizer's)
    # "auto" (on CUDA for t5_relative: flex while attention dropout is off: eval, or attention_dropout 0; triton
    # while it is on; else sdpa) | "sdpa" | "flex" (torch flex_attention: no [B, heads, L, L] bias; needs
    # attention_dropout 0) | "triton" (megakd's flash kernel: no [B, heads, L, L] bias, with attention dropout;
    # on CPU only under TRITON_INTERPRET=1)
    attention_kernel: str = "auto"

    @property
    def embed_dim(self) -> int:
        """Width of the embedding tables (and of the tied MLM output matrix)."""
        return self.hidden_size if self.embedding_size is None else self.embedding_size

    def validate(self, *, allow_auto_vocab: bool = False) -> EncoderConfig:
        """Raise ValueError naming the first bad field; return self so calls can be chained.

        `allow_auto_vocab` accepts vocab_size "auto" in a config that is not built yet (the
        pretraining command replaces it with the tokenizer's size); a model needs the number.
        """
        if self.vocab_size == "auto" and allow_auto_vocab:
            return self._validate_fields(check_vocab=False)
        if isinstance(self.vocab_size, str):
            raise ValueError(f"model.vocab_size: expected a positive integer"
                             f"{' or auto' if allow_auto_vocab else ''}, got {self.vocab_size!r}")
        return self._validate_fields(check_vocab=True)

    def _validate_fields(self, *, check_vocab: bool) -> EncoderConfig:
        for name, limit in SIZE_LIMITS.items():
            if name == "vocab_size" and not check_vocab or name == "embedding_size" and self.embedding_size is None:
                continue
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
                raise ValueError(f"model.{name}: expected a positive integer up to {limit}"
                                 f"{' or None' if name == 'embedding_size' else ''}, got {value!r:.100}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size: expected a multiple of num_heads={self.num_heads}, "
                             f"got {self.hidden_size}")
        if self.position_encoding not in POSITION_ENCODINGS:
            raise ValueError(f"model.position_encoding: expected one of {POSITION_ENCODINGS}, "
                             f"got {self.position_encoding!r}")
        if self.position_encoding == "t5_relative":
            if self.relative_buckets < 4 or self.relative_buckets % 2:
                raise ValueError(f"model.relative_buckets: expected an even integer >= 4, got {self.relative_buckets}")
            if self.relative_max_distance <= self.relative_buckets // 4:
                raise ValueError(f"model.relative_max_distance: expected > relative_buckets/4 "
                                 f"= {self.relative_buckets // 4}, got {self.relative_max_distance}")
        if self.relative_init not in RELATIVE_INITS:
            raise ValueError(f"model.relative_init: expected one of {RELATIVE_INITS}, got {self.relative_init!r}")
        if self.init not in INITS:
            raise ValueError(f"model.init: expected one of {INITS}, got {self.init!r}")
        if self.admin_profile not in ADMIN_PROFILES:
            raise ValueError(f"model.admin_profile: expected one of {ADMIN_PROFILES}, got {self.admin_profile!r}")
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"model.{name}: expected a probability in [0, 1), got {getattr(self, name)}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"model.attention_kernel: expected one of {ATTENTION_KERNELS}, "
                             f"got {self.attention_kernel!r}")
        if self.attention_kernel == "flex" and self.attention_dropout > 0:
            raise ValueError(f"model.attention_kernel: flex has no attention dropout, so it expects "
                             f"model.attention_dropout 0, got {self.attention_dropout} (auto: flex only while "
                             f"the dropout is off)")
        if self.pad_token_id < 0 or (check_vocab and self.pad_token_id >= self.vocab_size):
            raise ValueError(f"model.pad_token_id: expected an id in [0, vocab_size={self.vocab_size}), "
                             f"got {self.pad_token_id}")
        return self


def init_weights(module: nn.Module, std: float) -> None:
    """HF `_init_weights` for one module: N(0, std) weights, zero biases, identity LayerNorm."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def xavier_init_layer(layer: nn.Module) -> None:
    """The Admin reference's (fairseq) layer init: Xavier-uniform weights, zero biases.

    fairseq holds query, key and value in one [3H, H] matrix initialised as a whole, so each of
    the three gets the bound sqrt(6 / (H + 3H)); the attention output and the FFN matrices are
    Xavier-uniform on their own shapes.
    """
    attention = layer.attention
    for linear in (attention.query, attention.key, attention.value):
        bound = math.sqrt(6.0 / (linear.in_features + 3 * linear.out_features))
        nn.init.uniform_(linear.weight, -bound, bound)
    for linear in (attention.output, layer.ffn.fc_in, layer.ffn.fc_out):
        nn.init.xavier_uniform_(linear.weight)
    for linear in (attention.query, attention.key, attention.value, attention.output, layer.ffn.fc_in,
                   layer.ffn.fc_out):
        nn.init.zeros_(linear.bias)


class Embeddings(nn.Module):
    """word + (absolute position) + token type → LayerNorm → dropout → optional projection to hidden."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        dim = config.embed_dim
        self.word_embeddings = nn.Embedding(config.vocab_size, dim, padding_idx=config.pad_token_id)
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, dim) if config.position_encoding == "absolute" else None
        )
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, dim)
        self.layer_norm = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.dropout)
        # ELECTRA-small style: narrow embeddings projected up to the hidden width.
        self.embeddings_project = nn.Linear(dim, config.hidden_size) if dim != config.hidden_size else None

    def forward(self, word_vectors: Tensor, token_type_ids: Tensor | None = None,
                position_ids: Tensor | None = None) -> Tensor:
        """`word_vectors` [B, L, E] is the word-embedding lookup, or TGT's perturbed replacement of it;
        `position_ids` [B, L] default to 0..L-1 in every row."""
        seq_len = word_vectors.shape[1]
        if token_type_ids is None:
            token_type_ids = torch.zeros(word_vectors.shape[:2], dtype=torch.long, device=word_vectors.device)
        x = word_vectors + self.token_type_embeddings(token_type_ids)
        if self.position_embeddings is not None:
            if seq_len > self.position_embeddings.num_embeddings:
                raise ValueError(f"input length {seq_len} exceeds model.max_position_embeddings="
                                 f"{self.position_embeddings.num_embeddings}")
            positions = torch.arange(seq_len, device=word_vectors.device) if position_ids is None else position_ids
            x = x + self.position_embeddings(positions)
        x = self.dropout(self.layer_norm(x))
        if self.embeddings_project is not None:
            x = self.embeddings_project(x)
        return x


def segment_positions(segment_ids: Tensor) -> Tensor:
    """Position of every token inside its run of equal segment ids: 0, 1, ... restarting per document."""
    index = torch.arange(segment_ids.shape[1], device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def segment_mask(segment_ids: Tensor) -> Tensor:
    """Block-diagonal key mask [B, 1, L, L]: a query sees the keys of its own segment only.

    Padding (segment 0) forms one more block, so no row is fully masked (no NaN from SDPA) and no
    real token ever sees padding."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def relative_position_bucket(relative_position: Tensor, num_buckets: int, max_distance: int) -> Tensor:
    """T5's bidirectional bucketing of (key − query) offsets.

    Half the buckets hold positive offsets, half the rest (zero included); within each half, the
    first half of the buckets are exact small distances and the rest are log-spaced up to
    `max_distance`, beyond which everything shares the last bucket. Computed in float64 so that
    distances on a bucket boundary (e.g. 16, 32, 64 with 32 buckets) round the same everywhere.
    """
    half = num_buckets // 2
    bucket = (relative_position > 0).long() * half
    distance = relative_position.abs()
    max_exact = half // 2
    log_ratio = torch.log(distance.double().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    far = max_exact + (log_ratio * (half - max_exact)).long()
    far = far.clamp(max=half - 1)
    return bucket + torch.where(distance < max_exact, distance, far)


class RelativePositionBias(nn.Module):
    """One learned [buckets, heads] table shared by every layer, turned into a [1, heads, L, L] bias."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.num_buckets = config.relative_buckets
        self.max_distance = config.relative_max_distance
        self.relative_attention_bias = nn.Embedding(config.relative_buckets, config.num_heads)

    @torch.no_grad()
    def init_local(self) -> None:
        """ALiBi-like start: head h's bias is −2^−h · |offset| (offsets of a bucket: its smallest).

        With the usual N(0, 0.02) table every head starts attending uniformly, so its output is
        the same bag of words at every position; starting head 0 on the token and its neighbours
        and later heads ever broader gives each position its own context from step 0. At CPU
        scale it is what lets a small masked LM leave the unigram plateau within a few hundred
        steps (docs/recipes.md).
        """
        offsets = torch.arange(-self.max_distance, self.max_distance + 1)
        buckets = relative_position_bucket(offsets, self.num_buckets, self.max_distance)
        nearest = torch.full((self.num_buckets,), float(self.max_distance))
        nearest.scatter_reduce_(0, buckets, offsets.abs().float(), reduce="amin")
        slopes = 2.0 ** -torch.arange(self.relative_attention_bias.embedding_dim, dtype=torch.float)
        self.relative_attention_bias.weight.copy_(-nearest[:, None] * slopes[None, :])

    def table(self) -> Tensor:
        """The [buckets, heads] table as the Triton kernel reads it: a lookup of every row (through the embedding's
        forward, so the table is read inside this module, as ZeRO-3 gathers it, and its gradient flows back)."""
        weight = self.relative_attention_bias.weight
        return self.relative_attention_bias(torch.arange(self.num_buckets, device=weight.device))

    def forward(self, seq_len: int) -> Tensor:
        device = self.relative_attention_bias.weight.device
        positions = torch.arange(seq_len, device=device)
        relative = positions[None, :] - positions[:, None]  # [query, key] = key − query
        buckets = relative_position_bucket(relative, self.num_buckets, self.max_distance)
        return self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)


def attention_bias(key_mask: Tensor | None, position_bias: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The `attn_mask` SDPA takes: the bool key mask alone, or the relative bias in `dtype` with the
    masked keys at the dtype's minimum ([B, heads, L, L] when both are given)."""
    if position_bias is None:
        return key_mask
    bias = position_bias.to(dtype)
    return bias if key_mask is None else bias.masked_fill(~key_mask, torch.finfo(dtype).min)


def attention_kernel(config: EncoderConfig, training: bool, flex_compiles: bool) -> str:
    """"flex", "triton" or "sdpa": the config's choice, or under "auto" for T5 relative positions where Triton
    kernels compile (`flex_compiles`: CUDA with Triton) flex while attention dropout is off and megakd's triton
    kernel while it is on (training with attention_dropout > 0: flex_attention has no dropout); sdpa otherwise.
    The memory and step-time models (megakd/bench/) ask with flex_compiles=True."""
    if config.attention_kernel != "auto":
        return config.attention_kernel
    if not flex_compiles or config.position_encoding != "t5_relative":
        return "sdpa"
    return "triton" if training and config.attention_dropout > 0 else "flex"


def runs_flex(config: EncoderConfig, x: Tensor, training: bool) -> bool:
    """Whether attention over `x` runs through flex_attention on this device."""
    return attention_kernel(config, training, x.device.type == "cuda" and has_triton()) == "flex"


def runs_triton(config: EncoderConfig, x: Tensor, training: bool) -> bool:
    """Whether attention over `x` runs through megakd's Triton kernel (`triton_relative_attention`)."""
    return attention_kernel(config, training, x.device.type == "cuda" and has_triton()) == "triton"


@functools.lru_cache(maxsize=16)
def offset_buckets(seq_len: int, num_buckets: int, max_distance: int, device: torch.device) -> Tensor:
    """The bucket of every offset k − q as the Triton kernel reads it: [2L − 1] int32, offset o at o + L − 1.
    Cached per device (one copy per length); T5's buckets are intervals of offsets, as the kernel's backward needs
    (`relative_attention` checks buckets on the CPU)."""
    buckets = relative_position_bucket(torch.arange(1 - seq_len, seq_len), num_buckets, max_distance)
    return buckets.to(device=device, dtype=torch.int32)


def triton_masks(key_mask: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """(key row [B, L], segment labels [B, L]) for the Triton kernel from the bool key mask [B, 1, 1 or L, L]:
    a [B, 1, 1, L] mask is its row; a per-query one (`segment_mask`: block-diagonal) becomes each query's first
    visible key, equal exactly for the queries of one block."""
    if key_mask is None:
        return None, None
    if key_mask.shape[2] == 1:
        return key_mask[:, 0, 0], None
    return None, key_mask[:, 0].to(torch.uint8).argmax(-1).to(torch.int32)


def triton_relative_attention(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, table: Tensor | None,
                              config: EncoderConfig, dropout_p: float) -> Tensor:
    """softmax(q·kᵀ/√d + table[bucket(k − q)], masked)·v with attention dropout `dropout_p`, through megakd's
    flash kernel: `table` is the [buckets, heads] relative table (`RelativePositionBias.table`) or None."""
    from megakd.kernels.attention import relative_attention

    buckets = None
    if table is not None:
        buckets = offset_buckets(q.shape[2], config.relative_buckets, config.relative_max_distance, q.device)
    key_row, segments = triton_masks(key_mask)
    return relative_attention(q, k, v, table, buckets, key_row, segments, dropout_p)


@functools.cache
def compiled_flex_attention():
    """flex_attention under torch.compile, built at the first flex call; torch.compile compiles it at the first
    call with each new shape (dynamic in the length after the first change). Eager flex_attention is a
    reference that materialises the [B, heads, L, L] scores, and it has no backward on CPU in torch 2.13."""
    return torch.compile(flex_attention)


def flex_padded(t: Tensor, dims: int) -> Tensor:
    """`t` padded with zeros (False) in its last `dims` dimensions, of the sequence length, to a multiple of
    FLEX_BLOCK: flex_attention's compiled kernels may index what score_mod and mask_mod capture for every lane
    of the last block, past the length, before masking it (and write the bias gradient there), so that every
    such index stays inside the tensor."""
    pad = -t.shape[-1] % FLEX_BLOCK
    return F.pad(t, (0, pad) * dims) if pad else t


def flex_block_mask(key_mask: Tensor) -> BlockMask:
    """The bool key mask [B, 1, 1 or L, L] (True = attend) as flex_attention's BlockMask: blocks of 128×128
    with no visible key are skipped (padding; other documents of a packed row), the rest masked exactly."""
    batch, _, rows, seq_len = key_mask.shape
    visible = flex_padded(key_mask[:, 0], 1 if rows == 1 else 2)  # [B, 1 or L', L']
    visible = visible.expand(batch, visible.shape[-1], visible.shape[-1])

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return visible[b, q_idx, kv_idx]

    return create_block_mask(mask_mod, batch, None, seq_len, seq_len, device=key_mask.device)


def flex_bias(position_bias: Tensor, dtype: torch.dtype) -> Tensor:
    """The relative bias [1, heads, L, L] as flex_attention's score_mod reads it: padded (`flex_padded`), in at
    least float32 (the kernel's scores are fp32, and the bias gradient is summed over the batch in that dtype).
    Idempotent: `Encoder.forward` prepares it once for all layers."""
    return flex_padded(position_bias, 2).to(torch.promote_types(dtype, torch.float32))


def flex_relative_attention(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask | None,
                            position_bias: Tensor | None) -> Tensor:
    """softmax(q·kᵀ/√d + position_bias, masked by `block_mask`)·v through compiled flex_attention: the bias
    [1, heads, L, L] is read inside the kernel per (head, query, key), and its gradient summed there."""
    score_mod = None
    if position_bias is not None:
        bias = flex_bias(position_bias, q.dtype)

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score + bias[0, h, q_idx, kv_idx]

    return compiled_flex_attention()(q, k, v, score_mod=score_mod, block_mask=block_mask)


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the layers' projections of `x` come out in (autocast's, when it is on)."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class SelfAttention(nn.Module):
    """Multi-head self-attention through `scaled_dot_product_attention` or flex_attention (`runs_flex`).

    query, key and value stay three Linears, so the parameters and state-dict keys are HF's
    (checkpoints of any age, the HF mapping, parameter remapping and per-Linear regularisers see
    the same tensors either way). With `fused_qkv` the three weights are concatenated at each call
    and x is projected in one [H → 3H] matmul instead of three: one GEMM (and one each for the
    input and weight gradients) reading x once. The concatenation copies 3H² weights, small next
    to the 3·tokens·H² multiply-adds. DeepSpeed ZeRO-3 gathers weights read outside their own
    module's forward by itself (it registers them as external parameters of this module).
    """

    def __init__(self, config: EncoderConfig):
        super().__init__()
        hidden = config.hidden_size
        self.config = config
        self.num_heads = config.num_heads
        self.head_dim = hidden // config.num_heads
        self.dropout_p = config.attention_dropout
        self.fused_qkv = config.fused_qkv
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.output = nn.Linear(hidden, hidden)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v of `x` [B, L, H], each [B, heads, L, head_dim]."""
        batch, seq_len, _ = x.shape
        if self.fused_qkv:
            linears = (self.query, self.key, self.value)
            weight = torch.cat([linear.weight for linear in linears])
            bias = torch.cat([linear.bias for linear in linears])
            qkv = F.linear(x, weight, bias).view(batch, seq_len, 3, self.num_heads, self.head_dim)
            return qkv.permute(2, 0, 3, 1, 4).unbind(0)

        def heads(t: Tensor) -> Tensor:
            return t.view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)

        return heads(self.query(x)), heads(self.key(x)), heads(self.value(x))

    def forward(self, x: Tensor, key_mask: Tensor | BlockMask | None, position_bias: Tensor | None) -> Tensor:
        """`key_mask` [B, 1, 1 or L, L] is True where a query may attend; `position_bias` [1, heads, L, L] or None,
        or [B, heads, L, L] with the key mask already applied (`attention_bias`, as `Encoder.forward` passes it
        to SDPA). A BlockMask key mask (`Encoder.forward` on the flex path) means flex with that mask; a tensor
        one is made a BlockMask here when flex runs (once per layer: pipeline stages pass tensors). On the
        triton path `position_bias` is the [buckets, heads] table (`Encoder.prepare` gives it there)."""
        batch, seq_len, hidden = x.shape
        q, k, v = self.project(x)
        if runs_triton(self.config, x, self.training):
            if position_bias is not None and position_bias.dim() != 2:
                raise ValueError(f"SelfAttention: the triton kernel takes the [buckets, heads] relative table "
                                 f"(Encoder.prepare), got a position bias of shape {tuple(position_bias.shape)}")
            out = triton_relative_attention(q, k, v, key_mask, position_bias, self.config,
                                            self.dropout_p if self.training else 0.0)
        elif isinstance(key_mask, BlockMask) or runs_flex(self.config, x, self.training):
            if isinstance(key_mask, Tensor):
                key_mask = flex_block_mask(key_mask)
            out = flex_relative_attention(q, k, v, key_mask, position_bias)
        else:
            out = attention(q, k, v, attention_bias(key_mask, position_bias, q.dtype), self.dropout_p,
                            self.training)
        return self.output(out.transpose(1, 2).reshape(batch, seq_len, hidden))


class FeedForward(nn.Module):
    """Position-wise FFN with exact (erf) GELU, as HF's "gelu"."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.fc_in = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc_out = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class EncoderLayer(nn.Module):
    """Post-LN BERT layer: x = LN(ω·x + Dropout(Attn(x))); x = LN(ω·x + Dropout(FFN(x))).

    ω exists only under Admin init (a learnable per-channel residual scale set by
    `admin_initialize`); without it the layer is exactly HF's and ω is implicitly 1.
    """

    def __init__(self, config: EncoderConfig):
        super().__init__()
        hidden = config.hidden_size
        self.attention = SelfAttention(config)
        self.attention_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.ffn = FeedForward(config)
        self.ffn_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.dropout)
        admin = config.init == "admin"
        self.attention_omega = nn.Parameter(torch.ones(hidden)) if admin else None
        self.ffn_omega = nn.Parameter(torch.ones(hidden)) if admin else None

    def attention_branch(self, x: Tensor, key_mask: Tensor | None, position_bias: Tensor | None) -> Tensor:
        return self.dropout(self.attention(x, key_mask, position_bias))

    def ffn_branch(self, x: Tensor) -> Tensor:
        return self.dropout(self.ffn(x))

    @staticmethod
    def residual(x: Tensor, omega: Tensor | None) -> Tensor:
        return x if omega is None else x * omega

    def forward(self, x: Tensor, key_mask: Tensor | None = None, position_bias: Tensor | None = None) -> Tensor:
        attended = self.attention_branch(x, key_mask, position_bias)
        x = self.attention_norm(self.residual(x, self.attention_omega) + attended)
        x = self.ffn_norm(self.residual(x, self.ffn_omega) + self.ffn_branch(x))
        return x


class Encoder(nn.Module):
    """Embeddings followed by `num_layers` post-LN layers; returns the last hidden states [B, L, H]."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config.validate()
        self.embeddings = Embeddings(config)
        self.relative_bias = RelativePositionBias(config) if config.position_encoding == "t5_relative" else None
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))
        for module in self.modules():
            init_weights(module, config.initializer_range)
        if config.init == "admin" and config.admin_profile == "reference":
            for layer in self.layers:
                xavier_init_layer(layer)
        if self.relative_bias is not None and config.relative_init == "local":
            self.relative_bias.init_local()

    def embed(self, input_ids: Tensor) -> Tensor:
        """Word-embedding lookup [B, L, E]: what `forward(inputs_embeds=...)` expects (HF semantics)."""
        return self.embeddings.word_embeddings(input_ids)

    def prepare(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        segment_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Embedding output plus the key mask and relative bias every layer takes (computed once).

        With `segment_ids` (packed samples) the mask is block-diagonal and absolute positions restart
        per segment; T5 relative offsets need no change, since inside a segment they are the same
        wherever the segment sits in the row.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Encoder.forward: expected exactly one of input_ids or inputs_embeds")
        word_vectors = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if segment_ids is None:
            x = self.embeddings(word_vectors, token_type_ids)
            key_mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        else:
            x = self.embeddings(word_vectors, token_type_ids, segment_positions(segment_ids))
            key_mask = segment_mask(segment_ids)
        if self.relative_bias is None:
            position_bias = None
        elif runs_triton(self.config, x, self.training):
            position_bias = self.relative_bias.table()  # [buckets, heads]: the kernel gathers it per offset
        else:
            position_bias = self.relative_bias(x.shape[1])
        return x, key_mask, position_bias

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        segment_ids: Tensor | None = None,
    ) -> Tensor:
        x, key_mask, position_bias = self.prepare(input_ids, attention_mask, token_type_ids, inputs_embeds,
                                                  segment_ids)
        if runs_flex(self.config, x, self.training):
            # Once for all layers: the BlockMask, and the bias in the dtype flex reads (shared, as below).
            key_mask = None if key_mask is None else flex_block_mask(key_mask)
            position_bias = None if position_bias is None else flex_bias(position_bias, compute_dtype(x))
        elif position_bias is not None and key_mask is not None and not runs_triton(self.config, x, self.training):
            # Every layer would mask the same relative bias the same way: do it once, shared by all
            # (one [B, heads, L, L] tensor per forward instead of one per layer, and one backward).
            position_bias, key_mask = attention_bias(key_mask, position_bias, compute_dtype(x)), None
        for layer in self.layers:
            x = run_layer(layer, x, key_mask, position_bias, self.config.activation_checkpointing)
        return x


def run_layer(layer: EncoderLayer, x: Tensor, key_mask: Tensor | None, position_bias: Tensor | None,
              activation_checkpointing: bool) -> Tensor:
    """One encoder layer, recomputed in backward under `activation_checkpointing` while it trains with
    gradients; `Encoder.forward` and the pipeline's layer stages (megakd/engine/pipeline.py) both run it."""
    if activation_checkpointing and layer.training and torch.is_grad_enabled():
        return checkpoint(layer, x, key_mask, position_bias, use_reentrant=False)
    return layer(x, key_mask, position_bias)
