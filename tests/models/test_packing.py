"""A packed sample computes, per document, exactly what the document computes alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megakd.data.masking import collate
from megakd.models.electra import Discriminator, MaskedLM
from megakd.models.encoder import EncoderConfig, segment_positions

CLS, SEP, PAD, MASK = 1, 2, 0, 4


def _documents(lengths: list[int], vocab: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.array([CLS, *rng.integers(5, vocab, n - 2), SEP]) for n in lengths]


@pytest.mark.parametrize("position_encoding", ["absolute", "t5_relative"])
@pytest.mark.parametrize("model_class", [MaskedLM, Discriminator])
def test_packed_documents_equal_documents_alone(position_encoding, model_class):
    cfg = EncoderConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                        embedding_size=16, max_position_embeddings=40, position_encoding=position_encoding,
                        relative_buckets=8, relative_max_distance=12)
    torch.manual_seed(0)
    model = model_class(cfg).double().eval()
    # Row 0 is full; row 1 ends in padding. Lengths cross the T5 buckets' exact/log boundary.
    rows = [_documents([7, 20, 13], cfg.vocab_size, 1), _documents([3, 25], cfg.vocab_size, 2)]
    # The loader's own collation derives the segment ids from each document's [CLS].
    batch = collate([np.concatenate(r) for r in rows], [0, 0], [0, 1], pad_id=PAD, mask_id=MASK,
                    special_ids=(PAD, CLS, SEP, 3, MASK), seed=0, mask_prob=0.15, segment_start_id=CLS)
    assert batch["segment_ids"].tolist()[1] == [1] * 3 + [2] * 25 + [0] * 12
    with torch.no_grad():
        packed = model(batch["input_ids"], batch["attention_mask"], segment_ids=batch["segment_ids"])
        for b, docs in enumerate(rows):
            start = 0
            for doc in docs:
                alone = model(torch.from_numpy(doc)[None])[0]
                torch.testing.assert_close(packed[b, start : start + len(doc)], alone, rtol=0, atol=1e-10)
                start += len(doc)
        # Without segment ids the same row is one sequence: documents do see each other.
        unpacked = model(batch["input_ids"], batch["attention_mask"])
        assert (unpacked[0, 7:27] - packed[0, 7:27]).abs().max() > 1e-3


def test_segment_positions_restart_per_document():
    segments = torch.tensor([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    assert segment_positions(segments).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]
