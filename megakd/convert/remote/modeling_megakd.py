"""HF model classes around megakd's own encoder and heads (T5-relative positions, Admin ω).

`megakd_dropout.py`, `megakd_encoder.py` and `megakd_heads.py` beside this file are copies of
megakd/models/dropout.py, encoder.py and heads.py (only their imports of each other are made
relative), written by `megakd convert to-hf`. Shipping megakd's source instead of a re-implementation means
there is one definition of the model to trust, and the state-dict keys are megakd's own.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.modeling_outputs import (
    BaseModelOutput,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)

from .configuration_megakd import ENCODER_FIELDS, MegakdConfig
from .megakd_encoder import Encoder, EncoderConfig, init_weights
from .megakd_heads import ClassificationHead, MLMHead, RTDHead


def encoder_config(config):
    """The exported model's encoder; on SDPA, so that an HF user's GPU never compiles flex_attention."""
    return EncoderConfig(**{name: getattr(config, name) for name in ENCODER_FIELDS}, attention_kernel="sdpa")


def attention_probabilities(attention, x, key_mask, position_bias):
    """softmax(QKᵀ/√d + bias + mask) of one megakd `SelfAttention` [B, heads, L, L], before dropout.

    megakd attends through `scaled_dot_product_attention`, which returns no weights; this computes
    the same scores explicitly for `output_attentions` (tests check probs·V against the layer).
    """
    q, k, _ = attention.project(x)
    scores = q @ k.transpose(-1, -2) / math.sqrt(attention.head_dim)
    if position_bias is not None:
        scores = scores + position_bias.to(scores.dtype)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask, torch.finfo(scores.dtype).min)
    return scores.softmax(dim=-1)


class MegakdPreTrainedModel(PreTrainedModel):
    config_class = MegakdConfig
    base_model_prefix = "encoder"
    supports_gradient_checkpointing = True

    def _init_weights(self, module):
        init_weights(module, self.config.initializer_range)

    def _set_gradient_checkpointing(self, enable=True, gradient_checkpointing_func=None, every_n_layers=1):
        """HF's switch drives megakd's own per-layer activation checkpointing (non-reentrant)."""
        self.encoder.config.activation_checkpointing = enable
        self.gradient_checkpointing = enable

    def get_input_embeddings(self):
        return self.encoder.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.encoder.embeddings.word_embeddings = value

    def encode(self, input_ids, attention_mask, token_type_ids, inputs_embeds, output_hidden_states=None,
               output_attentions=None):
        """(last hidden state, all hidden states or None, attention maps or None), HF's conventions.

        Without the extra outputs this is exactly `Encoder.forward`; with them the layers are run
        one by one here, the same way, collecting each layer's input and attention map.
        """
        output_hidden_states = output_hidden_states if output_hidden_states is not None else \
            self.config.output_hidden_states
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        encoder = self.encoder
        if not (output_hidden_states or output_attentions):
            return encoder(input_ids, attention_mask, token_type_ids, inputs_embeds), None, None
        x, key_mask, position_bias = encoder.prepare(input_ids, attention_mask, token_type_ids, inputs_embeds)
        recompute = encoder.config.activation_checkpointing and self.training and torch.is_grad_enabled()
        hidden, attentions = [], []
        for layer in encoder.layers:
            hidden.append(x)
            if output_attentions:
                attentions.append(attention_probabilities(layer.attention, x, key_mask, position_bias))
            x = checkpoint(layer, x, key_mask, position_bias, use_reentrant=False) if recompute else \
                layer(x, key_mask, position_bias)
        hidden.append(x)
        return (x, tuple(hidden) if output_hidden_states else None,
                tuple(attentions) if output_attentions else None)


class MegakdModel(MegakdPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.encoder = Encoder(encoder_config(config))
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None,
                output_hidden_states=None, output_attentions=None, **kwargs):
        last, hidden, attentions = self.encode(input_ids, attention_mask, token_type_ids, inputs_embeds,
                                               output_hidden_states, output_attentions)
        return BaseModelOutput(last_hidden_state=last, hidden_states=hidden, attentions=attentions)


class MegakdForPreTraining(MegakdPreTrainedModel):
    """ELECTRA discriminator: one logit per token, positive = replaced (as ElectraForPreTraining)."""

    def __init__(self, config):
        super().__init__(config)
        cfg = encoder_config(config)
        self.encoder = Encoder(cfg)
        self.head = RTDHead(cfg)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None, labels=None,
                output_hidden_states=None, output_attentions=None, **kwargs):
        last, hidden, attentions = self.encode(input_ids, attention_mask, token_type_ids, inputs_embeds,
                                               output_hidden_states, output_attentions)
        logits = self.head(last)
        loss = None
        if labels is not None:
            active = attention_mask.bool() if attention_mask is not None else torch.ones_like(labels, dtype=torch.bool)
            loss = F.binary_cross_entropy_with_logits(logits[active], labels[active].float())
        return TokenClassifierOutput(loss=loss, logits=logits, hidden_states=hidden, attentions=attentions)


class MegakdForMaskedLM(MegakdPreTrainedModel):
    """Generator / BERT-MLM: the output matrix is the word-embedding matrix."""

    _tied_weights_keys = {"head.tied_embedding.weight": "encoder.embeddings.word_embeddings.weight"}

    def __init__(self, config):
        super().__init__(config)
        cfg = encoder_config(config)
        self.encoder = Encoder(cfg)
        self.head = MLMHead(cfg, self.encoder.embeddings.word_embeddings)
        self.post_init()

    def get_output_embeddings(self):
        return None  # tied by sharing the module itself; nothing for HF to re-tie

    def set_input_embeddings(self, value):
        """`resize_token_embeddings`: the head keeps sharing the new table; its bias follows (new rows 0)."""
        super().set_input_embeddings(value)
        self.head.tied_embedding = value
        old = self.head.bias.data
        bias = old.new_zeros(value.num_embeddings)
        keep = min(old.numel(), bias.numel())
        bias[:keep] = old[:keep]
        self.head.bias = nn.Parameter(bias)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None, labels=None,
                output_hidden_states=None, output_attentions=None, **kwargs):
        last, hidden, attentions = self.encode(input_ids, attention_mask, token_type_ids, inputs_embeds,
                                               output_hidden_states, output_attentions)
        logits = self.head(last)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=hidden, attentions=attentions)


class MegakdForSequenceClassification(MegakdPreTrainedModel):
    """Fine-tuning: HF's ELECTRA classification head on [CLS]; regression when num_labels == 1."""

    def __init__(self, config):
        super().__init__(config)
        cfg = encoder_config(config)
        self.num_labels = config.num_labels
        self.encoder = Encoder(cfg)
        self.head = ClassificationHead(cfg, config.num_labels, config.classifier_dropout)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None, labels=None,
                output_hidden_states=None, output_attentions=None, **kwargs):
        last, hidden, attentions = self.encode(input_ids, attention_mask, token_type_ids, inputs_embeds,
                                               output_hidden_states, output_attentions)
        logits = self.head(last)
        loss = None
        if labels is not None:
            if self.num_labels == 1:
                loss = F.mse_loss(logits.squeeze(-1), labels.float())
            else:
                loss = F.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=hidden, attentions=attentions)


class MegakdForTokenClassification(MegakdPreTrainedModel):
    """Per-token labels (NER, POS): dropout then a linear layer on every hidden state, as
    ElectraForTokenClassification."""

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.encoder = Encoder(encoder_config(config))
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.dropout
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None, labels=None,
                output_hidden_states=None, output_attentions=None, **kwargs):
        last, hidden, attentions = self.encode(input_ids, attention_mask, token_type_ids, inputs_embeds,
                                               output_hidden_states, output_attentions)
        logits = self.classifier(self.dropout(last))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1), ignore_index=-100)
        return TokenClassifierOutput(loss=loss, logits=logits, hidden_states=hidden, attentions=attentions)


class MegakdForQuestionAnswering(MegakdPreTrainedModel):
    """Extractive QA: start/end logits per token, loss as BertForQuestionAnswering (out-of-range ignored)."""

    def __init__(self, config):
        super().__init__(config)
        self.encoder = Encoder(encoder_config(config))
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None,
                start_positions=None, end_positions=None, output_hidden_states=None, output_attentions=None,
                **kwargs):
        last, hidden, attentions = self.encode(input_ids, attention_mask, token_type_ids, inputs_embeds,
                                               output_hidden_states, output_attentions)
        start_logits, end_logits = self.qa_outputs(last).unbind(dim=-1)
        loss = None
        if start_positions is not None and end_positions is not None:
            ignored = start_logits.shape[1]  # positions outside the input are clamped here and ignored
            start = start_positions.view(-1).clamp(0, ignored)
            end = end_positions.view(-1).clamp(0, ignored)
            loss = (F.cross_entropy(start_logits, start, ignore_index=ignored)
                    + F.cross_entropy(end_logits, end, ignore_index=ignored)) / 2
        return QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits.contiguous(),
                                            end_logits=end_logits.contiguous(), hidden_states=hidden,
                                            attentions=attentions)
