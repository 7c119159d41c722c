"""`write_shards(pack=True)`: short documents share samples, in order, deterministically; the loader
hands out their segment ids."""

from __future__ import annotations

import filecmp

import numpy as np
import pytest

import megakd.data.shards as shards_module
from megakd.data.loader import PretrainingLoader
from megakd.data.shards import read_manifest, write_shards
from megakd.data.sources import iter_documents

from .conftest import corpus_docs, write_jsonl
from .test_shards import all_samples

SEQ = 128


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """Sentences as documents (a short-document corpus), plus two documents longer than SEQ."""
    text = " ".join(corpus_docs(2, 10))
    docs = [s.strip() + "." for s in text.split(".") if s.strip()][:300]
    docs[10], docs[200] = " ".join(docs[:12]), " ".join(docs[100:115])
    return write_jsonl(tmp_path_factory.mktemp("short") / "short.jsonl", docs)


@pytest.fixture(scope="module")
def packed_shards(tokenizer, short_docs, tmp_path_factory):
    out = tmp_path_factory.mktemp("packed") / "p1"
    return out, write_shards([short_docs], tokenizer, SEQ, out, samples_per_shard=11, min_tokens=1, pack=True)


def _pieces(sample: np.ndarray, cls_id: int) -> list[list[int]]:
    starts = [*np.flatnonzero(sample == cls_id), len(sample)]
    return [sample[a:b].tolist() for a, b in zip(starts, starts[1:])]


def test_packed_samples_hold_every_document_in_order(packed_shards, tokenizer, short_docs):
    out, manifest = packed_shards
    samples = all_samples(out)
    expected = []  # [CLS] chunk [SEP] of every document, cut at seq_len - 2 as unpacked shards cut it
    for doc in iter_documents(short_docs):
        ids = tokenizer.encode(doc)
        expected += [[tokenizer.cls_id, *ids[i : i + SEQ - 2], tokenizer.sep_id] for i in range(0, len(ids), SEQ - 2)]
    got = [p for s in samples for p in _pieces(s, tokenizer.cls_id)]
    assert got == expected
    assert any(len(p) == SEQ for p in expected)  # long documents were cut at sample boundaries
    # Next-fit: every sample is within seq_len, and the next sample's first piece did not fit.
    for s, nxt in zip(samples, samples[1:]):
        assert len(s) <= SEQ < len(s) + len(_pieces(nxt, tokenizer.cls_id)[0])
    assert manifest["packed"] is True and manifest["pieces"] == len(expected) > 1.5 * manifest["num_samples"]
    unpacked_fill = sum(map(len, expected)) / (SEQ * len(expected))  # one piece per sample
    assert manifest["mean_fill"] == round(sum(map(len, samples)) / (SEQ * len(samples)), 6) > 1.5 * unpacked_fill


def test_literal_cls_text_never_becomes_a_segment_start(tokenizer):
    assert tokenizer.cls_id not in tokenizer.encode("[CLS] text [CLS][SEP] <s> more")


@pytest.mark.parametrize(("workers", "task_chars"), [(1, 2_000), (3, 1 << 20), (3, 3_000)])
def test_packing_is_byte_identical_for_any_workers(packed_shards, tokenizer, short_docs, tmp_path, monkeypatch,
                                                   workers, task_chars):
    """Workers tokenize batches of documents; packing must not depend on the batches' boundaries."""
    out, manifest = packed_shards
    monkeypatch.setattr(shards_module, "_TASK_CHARS", task_chars)
    other = tmp_path / "other"
    assert write_shards([short_docs], tokenizer, SEQ, other, samples_per_shard=11, min_tokens=1, pack=True,
                        num_workers=workers) == {**manifest, "sources": manifest["sources"]}
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(p.name for p in other.iterdir())
    assert filecmp.cmpfiles(out, other, files, shallow=False)[0] == files


def test_loader_carries_segment_ids_only_for_packed_shards(packed_shards, small_shards, tokenizer):
    out, _ = packed_shards
    loader = PretrainingLoader(out, tokenizer, micro_batch_size=4, num_workers=2, seed=3)
    batches = iter(loader)
    for _ in range(3):
        batch = next(batches)
        ids, seg, attn = batch["input_ids"].numpy(), batch["segment_ids"].numpy(), batch["attention_mask"].numpy()
        for row in range(len(ids)):
            n = int(attn[row].sum())
            starts = np.flatnonzero(ids[row] == tokenizer.cls_id)
            assert seg[row, :n].tolist() == np.repeat(np.arange(1, len(starts) + 1),
                                                      np.diff([*starts, n])).tolist()
            assert (seg[row, n:] == 0).all()
    assert "segment_ids" not in next(iter(PretrainingLoader(small_shards, tokenizer, micro_batch_size=4)))
    assert read_manifest(out)["packed"] and not read_manifest(small_shards)["packed"]
