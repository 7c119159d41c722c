"""Output heads with HF ELECTRA/BERT shapes: MLM (tied, sparse-friendly), RTD and classification."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megakd.models.dropout import Dropout
from megakd.models.encoder import EncoderConfig, init_weights


class MLMHead(nn.Module):
    """transform (dense H→E, GELU, LayerNorm) then logits = transform(h) @ Wᵀ + bias, W tied to the words.

    One class serves the ELECTRA generator (E = embedding_size) and BERT's MLM head (E = H). The
    objective calls `transform` on masked positions only and hands `decoder_weight`/`bias` to a fused
    linear-cross-entropy kernel, so [tokens × vocab] logits are never materialised during training.
    """

    def __init__(self, config: EncoderConfig, word_embeddings: nn.Embedding):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.embed_dim)
        self.layer_norm = nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        # The embedding module itself is shared (not a copy of its weight), so the tie survives
        # anything that swaps Parameter objects; parameters() lists the matrix once.
        self.tied_embedding = word_embeddings
        for module in (self.dense, self.layer_norm):
            init_weights(module, config.initializer_range)

    @property
    def decoder_weight(self) -> Tensor:
        """The output projection [V, E]: the word-embedding matrix."""
        return self.tied_embedding.weight

    def transform(self, hidden: Tensor) -> Tensor:
        return self.layer_norm(F.gelu(self.dense(hidden)))

    def forward(self, hidden: Tensor) -> Tensor:
        return F.linear(self.transform(hidden), self.decoder_weight, self.bias)


class RTDHead(nn.Module):
    """Replaced-token detection: dense H→H, GELU, then one logit per token (1 = replaced)."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.prediction = nn.Linear(config.hidden_size, 1)
        for module in (self.dense, self.prediction):
            init_weights(module, config.initializer_range)

    def transform(self, hidden: Tensor) -> Tensor:
        """Features the fused RTD kernel projects with `prediction.weight[0]` and `prediction.bias[0]`."""
        return F.gelu(self.dense(hidden))

    def forward(self, hidden: Tensor) -> Tensor:
        return self.prediction(self.transform(hidden)).squeeze(-1)


class ClassificationHead(nn.Module):
    """HF ElectraClassificationHead: [CLS] → dropout → dense → GELU → dropout → out_proj."""

    def __init__(self, config: EncoderConfig, num_labels: int, dropout: float | None = None):
        super().__init__()
        if num_labels < 1:
            raise ValueError(f"num_labels: expected a positive integer, got {num_labels}")
        self.dropout = Dropout(config.dropout if dropout is None else dropout)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, num_labels)
        for module in (self.dense, self.out_proj):
            init_weights(module, config.initializer_range)

    def forward(self, hidden: Tensor) -> Tensor:
        x = self.dropout(hidden[:, 0])
        x = self.dropout(F.gelu(self.dense(x)))
        return self.out_proj(x)
