"""Task models over the encoder: MLM (ELECTRA generator or BERT student), discriminator, classifier,
and the generator/discriminator pair with optional embedding sharing.

`forward` returns hidden states, not logits: the objectives apply the heads sparsely (masked
positions only) or through fused kernels.
"""

from __future__ import annotations

from torch import Tensor, nn

from megakd.models.encoder import Encoder, EncoderConfig
from megakd.models.heads import ClassificationHead, MLMHead, RTDHead


class MaskedLM(nn.Module):
    """Encoder + tied MLM head. The HF flavour (ELECTRA generator or BERT) is chosen at export."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.head = MLMHead(config, self.encoder.embeddings.word_embeddings)

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        segment_ids: Tensor | None = None,
    ) -> Tensor:
        return self.encoder(input_ids, attention_mask, token_type_ids, inputs_embeds, segment_ids)

    def masked_hidden(self, hidden: Tensor, mlm_mask: Tensor) -> Tensor:
        """Head features [N, E] at the N masked positions (row-major order of `mlm_mask`)."""
        return self.head.transform(hidden[mlm_mask.bool()])

    def hidden_at(self, hidden: Tensor, positions: Tensor) -> Tensor:
        """`masked_hidden` at flat row-major `positions` of [B, L]: a gather, no host-device sync."""
        return self.head.transform(hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions))


class Discriminator(nn.Module):
    """Encoder + replaced-token-detection head."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.head = RTDHead(config)

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        segment_ids: Tensor | None = None,
    ) -> Tensor:
        return self.encoder(input_ids, attention_mask, token_type_ids, inputs_embeds, segment_ids)

    def rtd_logits(self, hidden: Tensor) -> Tensor:
        """[B, L] logits; positive means "replaced"."""
        return self.head(hidden)


class SequenceClassifier(nn.Module):
    """Encoder + classification head on [CLS]; `forward` returns [B, num_labels] logits."""

    def __init__(self, config: EncoderConfig, num_labels: int, classifier_dropout: float | None = None):
        super().__init__()
        self.config = config
        self.num_labels = num_labels
        self.encoder = Encoder(config)
        self.head = ClassificationHead(config, num_labels, classifier_dropout)

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
    ) -> Tensor:
        return self.head(self.encoder(input_ids, attention_mask, token_type_ids, inputs_embeds))


SHARED_EMBEDDINGS = ("word_embeddings", "position_embeddings", "token_type_embeddings", "layer_norm")


class ElectraPair(nn.Module):
    """Generator and discriminator in one module.

    share_embeddings=True is original ELECTRA: the discriminator uses the generator's word,
    position and token-type tables and embedding LayerNorm (module objects, not copies); each
    model keeps its own `embeddings_project`. False (DecoupledOptim) keeps them separate.
    """

    def __init__(self, generator: MaskedLM, discriminator: Discriminator, share_embeddings: bool):
        super().__init__()
        self.generator = generator
        self.discriminator = discriminator
        self.share_embeddings = share_embeddings
        if share_embeddings:
            g, d = generator.config, discriminator.config
            for field in ("embed_dim", "vocab_size", "max_position_embeddings", "type_vocab_size",
                          "position_encoding", "pad_token_id"):
                if getattr(g, field) != getattr(d, field):
                    name = "embedding_size" if field == "embed_dim" else field
                    raise ValueError(f"share_embeddings: generator and discriminator must have equal model.{name}, "
                                     f"got {getattr(g, field)} and {getattr(d, field)}")
            for name in SHARED_EMBEDDINGS:
                setattr(discriminator.encoder.embeddings, name, getattr(generator.encoder.embeddings, name))
