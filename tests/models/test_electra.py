"""Heads and the generator/discriminator pair: sparse MLM path, RTD split, parameter partition."""

import pytest
import torch
import torch.nn.functional as F

from megakd.models.electra import Discriminator, ElectraPair, MaskedLM, SequenceClassifier
from megakd.models.encoder import EncoderConfig
from tests.helpers import mlm_logits


def config(hidden: int, embedding_size: int | None = 16, **overrides) -> EncoderConfig:
    return EncoderConfig(vocab_size=53, hidden_size=hidden, num_layers=2, num_heads=4, intermediate_size=2 * hidden,
                         embedding_size=embedding_size, max_position_embeddings=32, **overrides)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, 53, (2, 10), generator=g)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0
    return input_ids, mask


def test_sparse_mlm_path_equals_dense_logits_at_masked_positions() -> None:
    torch.manual_seed(0)
    model = MaskedLM(config(32)).eval()
    with torch.no_grad():
        model.head.bias.normal_()
    input_ids, mask = batch()
    mlm_mask = torch.zeros(2, 10, dtype=torch.bool)
    mlm_mask[0, [1, 4]] = True
    mlm_mask[1, 2] = True
    with torch.no_grad():
        hidden = model(input_ids, mask)
        features = model.masked_hidden(hidden, mlm_mask)
        sparse = F.linear(features, model.head.decoder_weight, model.head.bias)
        dense = mlm_logits(model, input_ids, mask)
    assert features.shape == (3, 16)
    torch.testing.assert_close(sparse, dense[mlm_mask], atol=1e-6, rtol=1e-6)
    assert model.head.decoder_weight is model.encoder.embeddings.word_embeddings.weight
    assert model.head.decoder_weight.shape == (53, 16)


def test_mlm_output_matrix_is_trained_through_the_embedding() -> None:
    model = MaskedLM(config(32))
    input_ids, mask = batch()
    mlm_logits(model, input_ids, mask).sum().backward()
    names = [n for n, _ in model.named_parameters()]
    assert "head.tied_embedding.weight" not in names  # listed once, under the encoder
    assert model.encoder.embeddings.word_embeddings.weight.grad is not None


def test_rtd_transform_and_prediction_equal_forward() -> None:
    torch.manual_seed(0)
    model = Discriminator(config(32)).eval()
    input_ids, mask = batch()
    with torch.no_grad():
        hidden = model(input_ids, mask)
        split = model.head.transform(hidden) @ model.head.prediction.weight[0] + model.head.prediction.bias[0]
        logits = model.rtd_logits(hidden)
    assert logits.shape == (2, 10)
    torch.testing.assert_close(split, logits, atol=1e-6, rtol=1e-6)


def test_sequence_classifier_uses_cls_token() -> None:
    torch.manual_seed(0)
    model = SequenceClassifier(config(32), num_labels=3).eval()
    input_ids, mask = batch()
    with torch.no_grad():
        logits = model(input_ids, mask)
        changed = input_ids.clone()
        changed[:, 0] = (changed[:, 0] + 1) % 53
        assert logits.shape == (2, 3)
        assert not torch.allclose(model(changed, mask), logits)
    with pytest.raises(ValueError, match="num_labels"):
        SequenceClassifier(config(32), num_labels=0)


@pytest.mark.parametrize("share", [False, True])
def test_pair_partitions_every_parameter_exactly_once(share: bool) -> None:
    pair = ElectraPair(MaskedLM(config(32)), Discriminator(config(48)), share_embeddings=share)
    gen = list(pair.generator.parameters())
    owned = {id(p) for p in gen}
    disc = [p for p in pair.discriminator.parameters() if id(p) not in owned]
    gen_ids, disc_ids = {id(p) for p in gen}, {id(p) for p in disc}
    assert len(gen_ids) == len(gen) and len(disc_ids) == len(disc)
    assert not gen_ids & disc_ids
    assert gen_ids | disc_ids == {id(p) for p in pair.parameters()}
    d_embeddings = pair.discriminator.encoder.embeddings
    g_embeddings = pair.generator.encoder.embeddings
    for name in ("word_embeddings", "position_embeddings", "token_type_embeddings", "layer_norm"):
        shared = getattr(d_embeddings, name).weight is getattr(g_embeddings, name).weight
        assert shared == share, name
        assert id(getattr(d_embeddings, name).weight) in (gen_ids if share else disc_ids)
    assert id(d_embeddings.embeddings_project.weight) in disc_ids  # projections are never shared


def test_shared_embeddings_receive_both_losses() -> None:
    pair = ElectraPair(MaskedLM(config(32)), Discriminator(config(48)), share_embeddings=True)
    input_ids, mask = batch()
    pair.discriminator.rtd_logits(pair.discriminator(input_ids, mask)).sum().backward()
    assert pair.generator.encoder.embeddings.word_embeddings.weight.grad is not None


def test_sharing_needs_equal_embedding_size() -> None:
    with pytest.raises(ValueError, match="model.embedding_size"):
        ElectraPair(MaskedLM(config(32, 16)), Discriminator(config(48, 24)), share_embeddings=True)
    ElectraPair(MaskedLM(config(32, 16)), Discriminator(config(48, 24)), share_embeddings=False)
