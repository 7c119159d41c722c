"""Analytic FLOPs of one ELECTRA (or BERT-MLM) training step, counted as matmul FLOPs (2·m·n·k).

Model FLOPs utilization needs the work a step *must* do, independent of how fast the code is, so
it is counted from the architecture, not timed. Only matrix products are counted (as
`torch.utils.flop_counter` does); layer norms, softmax and GELU are a few percent at these sizes.
The counts follow what megakd actually runs (docs/decisions.md):

* every encoder processes all `seq_len` positions (padding included: the kernels are dense);
* the generator's vocabulary projection runs only at the masked positions (sparse MLM head),
  once for the loss and its two gradients (the fused loss computes them in its forward pass); the
  replacements are sampled from the same logits, with no projection of their own;
* the discriminator runs forward and backward over every position, its RTD head included.

Backward costs two forward matmuls per matmul (input and weight gradients). Activation
checkpointing recomputes each encoder layer's forward once more: that is hardware work, not
model work, so it is counted separately (`recompute`) and left out of MFU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megakd.config import Config
from megakd.models.encoder import EncoderConfig


def projection_flops_per_token(cfg: EncoderConfig) -> float:
    """Forward FLOPs of one encoder layer's weight matmuls per position: Q/K/V/output projections, FFN."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return 8 * h * h + 4 * h * i


def attention_flops_per_token(cfg: EncoderConfig, seq_len: int) -> float:
    """Forward FLOPs of one encoder layer's QKᵀ and PV per position."""
    return 4 * seq_len * cfg.hidden_size


def layer_flops_per_token(cfg: EncoderConfig, seq_len: int) -> float:
    """Forward FLOPs of one encoder layer per position: Q/K/V/output projections, QKᵀ and PV, FFN."""
    return projection_flops_per_token(cfg) + attention_flops_per_token(cfg, seq_len)


def embedding_projection_flops_per_token(cfg: EncoderConfig) -> float:
    """Forward FLOPs of the embedding-to-hidden projection per position (0 when the widths agree)."""
    return 2 * cfg.embed_dim * cfg.hidden_size if cfg.embed_dim != cfg.hidden_size else 0


def encoder_flops_per_token(cfg: EncoderConfig, seq_len: int) -> float:
    """Forward FLOPs of the whole encoder per position (the embedding projection included)."""
    return embedding_projection_flops_per_token(cfg) + cfg.num_layers * layer_flops_per_token(cfg, seq_len)


@dataclass
class StepFlops:
    """FLOPs of one optimizer step for `sequences` sequences, split by where they are spent.

    `forward` and `backward` are model FLOPs (what MFU divides); `recompute` is the extra forward
    that activation checkpointing adds (hardware FLOPs = model + recompute).
    """

    sequences: int
    seq_len: int
    parts: dict[str, dict[str, float]] = field(default_factory=dict)  # part -> {"forward", "backward"}
    recompute: float = 0.0

    @property
    def forward(self) -> float:
        return sum(p["forward"] for p in self.parts.values())

    @property
    def backward(self) -> float:
        return sum(p["backward"] for p in self.parts.values())

    @property
    def model(self) -> float:
        return self.forward + self.backward

    @property
    def hardware(self) -> float:
        return self.model + self.recompute

    @property
    def per_token(self) -> float:
        return self.model / (self.sequences * self.seq_len)

    def to_dict(self) -> dict:
        return {"sequences": self.sequences, "seq_len": self.seq_len, "parts": self.parts,
                "forward": self.forward, "backward": self.backward, "recompute": self.recompute,
                "model": self.model, "hardware": self.hardware}


def generator_head_flops(cfg: EncoderConfig, masked: float) -> dict[str, dict[str, float]]:
    """The sparse MLM head at `masked` positions: transform and vocabulary projection."""
    e, h, v = cfg.embed_dim, cfg.hidden_size, cfg.vocab_size
    transform = 2 * h * e * masked
    projection = 2 * e * v * masked
    return {
        "generator_head": {"forward": transform, "backward": 2 * transform},
        "generator_mlm_projection": {"forward": projection, "backward": 2 * projection},
    }


def step_flops(cfg: Config, sequences: int, seq_len: int | None = None, masked: float | None = None) -> StepFlops:
    """FLOPs of one step over `sequences` sequences of `seq_len` (default: the config's data.seq_len).

    `masked` is the number of masked positions (default: data.mask_prob of all positions).
    """
    seq_len = seq_len or cfg.data.seq_len
    tokens = float(sequences * seq_len)
    masked = cfg.data.mask_prob * tokens if masked is None else float(masked)
    out = StepFlops(sequences=sequences, seq_len=seq_len)
    models = [("generator", cfg.model.generator)]
    if cfg.model.objective == "electra":
        models.append(("discriminator", cfg.model.discriminator))
    for name, enc in models:
        fwd = encoder_flops_per_token(enc, seq_len) * tokens
        out.parts[f"{name}_encoder"] = {"forward": fwd, "backward": 2 * fwd}
        if enc.activation_checkpointing:
            out.recompute += enc.num_layers * layer_flops_per_token(enc, seq_len) * tokens
    out.parts.update(generator_head_flops(cfg.model.generator, masked))
    if cfg.model.objective == "electra":
        h = cfg.model.discriminator.hidden_size
        head = (2 * h * h + 2 * h) * tokens  # dense H→H, then the H→1 RTD projection
        out.parts["discriminator_head"] = {"forward": head, "backward": 2 * head}
    return out
