"""Parameter remapping: depth by repeat-last, Net2Wider exactness where it is claimed, zero padding, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megakd.models.electra import MaskedLM
from megakd.models.encoder import EncoderConfig
from megakd.models.remap import IN, OUT, cyclic_map, net2wider, remap_masked_lm
from tests.helpers import mlm_logits

V = 41


def _mlm(hidden: int, layers: int, heads: int = 2, ffn: int | None = None, embedding_size: int | None = None,
         seed: int = 0, **extra) -> MaskedLM:
    torch.manual_seed(seed)
    cfg = EncoderConfig(vocab_size=V, hidden_size=hidden, num_layers=layers, num_heads=heads,
                        intermediate_size=ffn or 2 * hidden, embedding_size=embedding_size,
                        max_position_embeddings=16, dropout=0.0, attention_dropout=0.0, **extra)
    model = MaskedLM(cfg).double().eval()
    with torch.no_grad():  # non-trivial LayerNorm affines, biases and ω so nothing matches by accident
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def test_depth_only_remap_repeats_the_last_layer():
    teacher, student = _mlm(16, 3), _mlm(16, 6, seed=1)
    remap_masked_lm(teacher, student)
    t, s = teacher.state_dict(), student.state_dict()
    for i in range(6):
        j = min(i, 2)
        for key in t:
            if key.startswith(f"encoder.layers.{j}."):
                rest = key[len(f"encoder.layers.{j}."):]
                assert torch.equal(s[f"encoder.layers.{i}.{rest}"], t[key]), (i, rest)
    for key in t:
        if not key.startswith("encoder.layers."):
            assert torch.equal(s[key], t[key]), key  # embeddings and head copied as they are
    assert student.head.decoder_weight is student.encoder.embeddings.word_embeddings.weight  # still tied


@pytest.mark.parametrize("widths", [(5, 13), (4, 8), (7, 7)])
def test_net2wider_preserves_linear_gelu_linear_exactly(widths):
    n_t, n_s = widths
    g = torch.Generator().manual_seed(0)
    w1, b1 = torch.randn(n_t, 6, dtype=torch.float64, generator=g), torch.randn(n_t, dtype=torch.float64, generator=g)
    w2, b2 = torch.randn(3, n_t, dtype=torch.float64, generator=g), torch.randn(3, dtype=torch.float64, generator=g)
    index = cyclic_map(n_t, n_s)
    w1s, b1s = net2wider(w1, ((index, OUT), None)), net2wider(b1, ((index, OUT),))
    w2s = net2wider(w2, (None, (index, IN)))
    assert w1s.shape == (n_s, 6) and w2s.shape == (3, n_s)
    x = torch.randn(10, 6, dtype=torch.float64, generator=g)
    teacher_out = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    student_out = F.linear(F.gelu(F.linear(x, w1s, b1s)), w2s, b2)
    torch.testing.assert_close(student_out, teacher_out, rtol=1e-13, atol=1e-13)
    # the copies of unit i carry w2[:, i] split evenly between them
    counts = torch.bincount(index, minlength=n_t)
    for j in range(n_s):
        torch.testing.assert_close(w2s[:, j], w2[:, index[j]] / counts[index[j]])


@pytest.mark.parametrize("variant", [
    dict(),
    dict(embedding_size=(8, 16)),
    dict(init="admin", position_encoding="t5_relative"),
])
def test_net2wider_doubling_preserves_the_masked_lm(variant):
    """Exact when every width is a multiple and head_dim is equal (module doc); FFN width is free."""
    emb = variant.pop("embedding_size", (None, None))
    teacher = _mlm(16, 2, heads=2, ffn=24, embedding_size=emb[0], **variant)
    student = _mlm(32, 2, heads=4, ffn=71, embedding_size=emb[1], seed=1, **variant)
    remap_masked_lm(teacher, student)
    ids = torch.randint(0, V, (3, 16), generator=torch.Generator().manual_seed(1))
    attn = torch.ones(3, 16, dtype=torch.long)
    attn[0, 9:] = 0
    torch.testing.assert_close(mlm_logits(student, ids, attn), mlm_logits(teacher, ids, attn), rtol=1e-12, atol=1e-12)


def test_embeddings_widened_by_copy_and_head_layer_norm_split():
    teacher, student = _mlm(16, 1, embedding_size=6), _mlm(32, 1, heads=4, embedding_size=15, seed=1)
    remap_masked_lm(teacher, student)
    te, se = teacher.encoder.embeddings, student.encoder.embeddings
    cols = [j % 6 for j in range(15)]
    assert torch.equal(se.word_embeddings.weight, te.word_embeddings.weight[:, cols])
    assert torch.equal(se.position_embeddings.weight, te.position_embeddings.weight[:, cols])
    assert torch.equal(se.layer_norm.weight, te.layer_norm.weight[cols])
    counts = torch.tensor([cols.count(c) for c in cols], dtype=torch.float64)  # 15 = 3+3+3+2+2+2 copies
    torch.testing.assert_close(student.head.layer_norm.weight, teacher.head.layer_norm.weight[cols] / counts)
    torch.testing.assert_close(student.head.layer_norm.bias, teacher.head.layer_norm.bias[cols] / counts)
    assert torch.equal(student.head.bias, teacher.head.bias)


def test_zero_padding_keeps_teacher_block_and_cuts_new_inputs():
    teacher, student = _mlm(16, 1, ffn=20), _mlm(24, 2, heads=3, ffn=40, seed=1)
    init = {k: v.clone() for k, v in student.state_dict().items()}
    remap_masked_lm(teacher, student, "zero")
    t, s = teacher.state_dict(), student.state_dict()
    fc_in, fc_out = "encoder.layers.1.ffn.fc_in.weight", "encoder.layers.1.ffn.fc_out.weight"
    assert torch.equal(s[fc_in][:20, :16], t["encoder.layers.0.ffn.fc_in.weight"])
    assert torch.equal(s[fc_in][:20, 16:], torch.zeros(20, 8, dtype=torch.float64))  # new inputs → old units: 0
    assert torch.equal(s[fc_in][20:, :], init[fc_in][20:, :])  # new units keep the random init
    assert torch.equal(s[fc_out][:16, 20:], torch.zeros(16, 20, dtype=torch.float64))
    assert torch.equal(s["encoder.embeddings.word_embeddings.weight"][:, :16],
                       t["encoder.embeddings.word_embeddings.weight"])


def test_remap_errors_name_the_field():
    with pytest.raises(ValueError, match="model.hidden_size .* smaller than the teacher's"):
        remap_masked_lm(_mlm(32, 1), _mlm(16, 1))
    with pytest.raises(ValueError, match="model.position_encoding"):
        remap_masked_lm(_mlm(16, 1), _mlm(16, 1, position_encoding="t5_relative"))
    with pytest.raises(ValueError, match="embeddings_project"):
        remap_masked_lm(_mlm(16, 1), _mlm(32, 1, embedding_size=16))
    with pytest.raises(ValueError, match="distill.remap_width"):
        remap_masked_lm(_mlm(16, 1), _mlm(16, 1), "random")
