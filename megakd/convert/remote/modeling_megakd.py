"""HF model classes around megakd's own encoder and heads (T5-relative positions, Admin ω).

`megakd_encoder.py` and `megakd_heads.py` beside this file are verbatim copies of
megakd/models/encoder.py and heads.py (only the heads' import of the encoder is made relative),
written by `megakd convert to-hf`. Shipping megakd's source instead of a re-implementation means
there is one definition of the model to trust, and the state-dict keys are megakd's own.
"""

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.modeling_outputs import (
    BaseModelOutput,
    MaskedLMOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)

from .configuration_megakd import ENCODER_FIELDS, MegakdConfig
from .megakd_encoder import Encoder, EncoderConfig, init_weights
from .megakd_heads import ClassificationHead, MLMHead, RTDHead


def encoder_config(config):
    return EncoderConfig(**{name: getattr(config, name) for name in ENCODER_FIELDS})


class MegakdPreTrainedModel(PreTrainedModel):
    config_class = MegakdConfig
    base_model_prefix = "encoder"
    supports_gradient_checkpointing = False

    def _init_weights(self, module):
        init_weights(module, self.config.initializer_range)

    def get_input_embeddings(self):
        return self.encoder.embeddings.word_embeddings


class MegakdModel(MegakdPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.encoder = Encoder(encoder_config(config))
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None, **kwargs):
        return BaseModelOutput(last_hidden_state=self.encoder(input_ids, attention_mask, token_type_ids,
                                                              inputs_embeds))


class MegakdForPreTraining(MegakdPreTrainedModel):
    """ELECTRA discriminator: one logit per token, positive = replaced (as ElectraForPreTraining)."""

    def __init__(self, config):
        super().__init__(config)
        cfg = encoder_config(config)
        self.encoder = Encoder(cfg)
        self.head = RTDHead(cfg)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None, labels=None,
                **kwargs):
        logits = self.head(self.encoder(input_ids, attention_mask, token_type_ids, inputs_embeds))
        loss = None
        if labels is not None:
            active = attention_mask.bool() if attention_mask is not None else torch.ones_like(labels, dtype=torch.bool)
            loss = F.binary_cross_entropy_with_logits(logits[active], labels[active].float())
        return TokenClassifierOutput(loss=loss, logits=logits)


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

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None, labels=None,
                **kwargs):
        logits = self.head(self.encoder(input_ids, attention_mask, token_type_ids, inputs_embeds))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits)


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
                **kwargs):
        logits = self.head(self.encoder(input_ids, attention_mask, token_type_ids, inputs_embeds))
        loss = None
        if labels is not None:
            if self.num_labels == 1:
                loss = F.mse_loss(logits.squeeze(-1), labels.float())
            else:
                loss = F.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)
