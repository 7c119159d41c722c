"""HF config for megakd encoders that native BERT/ELECTRA classes cannot express.

Written by `megakd convert to-hf` next to the weights; depends only on transformers. Every
megakd `EncoderConfig` field is stored under its own name, so the modeling file rebuilds the exact
encoder.
"""

from transformers import PretrainedConfig

ENCODER_FIELDS = (
    "vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "embedding_size",
    "max_position_embeddings", "type_vocab_size", "position_encoding", "relative_buckets",
    "relative_max_distance", "relative_init", "dropout", "attention_dropout", "layer_norm_eps",
    "initializer_range", "init", "admin_profile", "pad_token_id",
)


class MegakdConfig(PretrainedConfig):
    model_type = "megakd"

    def __init__(
        self,
        vocab_size=30522,
        hidden_size=256,
        num_layers=12,
        num_heads=4,
        intermediate_size=1024,
        embedding_size=None,
        max_position_embeddings=512,
        type_vocab_size=2,
        position_encoding="t5_relative",
        relative_buckets=32,
        relative_max_distance=128,
        relative_init="normal",
        dropout=0.1,
        attention_dropout=0.1,
        layer_norm_eps=1e-12,
        initializer_range=0.02,
        init="normal",
        admin_profile="reference",
        pad_token_id=0,
        classifier_dropout=None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.intermediate_size = intermediate_size
        self.embedding_size = embedding_size
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        self.position_encoding = position_encoding
        self.relative_buckets = relative_buckets
        self.relative_max_distance = relative_max_distance
        self.relative_init = relative_init
        self.dropout = dropout
        self.attention_dropout = attention_dropout
        self.layer_norm_eps = layer_norm_eps
        self.initializer_range = initializer_range
        self.init = init
        self.admin_profile = admin_profile
        self.classifier_dropout = classifier_dropout
        # Names HF utilities look for (pipelines, Trainer, generation of attention masks).
        self.num_hidden_layers = num_layers
        self.num_attention_heads = num_heads
        super().__init__(pad_token_id=pad_token_id, **kwargs)
