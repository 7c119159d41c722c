import gzip
import hashlib
import json

import pytest

import megakd.data.default_corpus as dc
from megakd.config import TaskConfig
from megakd.data.loader import PretrainingLoader
from megakd.data.shards import read_manifest
from megakd.data.tasks import load_split
from megakd.data.tokenizer import Tokenizer


def test_builds_once_and_reuses(tmp_path):
    tok_dir, shards_dir = dc.prepare_default_data(tmp_path, vocab_size=1000, seq_len=128)
    tok = Tokenizer.load(tok_dir)
    m = read_manifest(shards_dir)
    assert tok.vocab_size == 1000 and m["seq_len"] == 128 and m["tokenizer"]["vocab_hash"] == tok.vocab_hash
    assert m["documents"] == 269 + 778 and m["mean_fill"] > 0.95
    stamp = (shards_dir / "manifest.json").stat().st_mtime_ns
    assert dc.prepare_default_data(tmp_path, vocab_size=1000, seq_len=128) == (tok_dir, shards_dir)
    assert (shards_dir / "manifest.json").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [tok_dir.parent.name]
    batch = next(iter(PretrainingLoader(shards_dir, tok, micro_batch_size=4)))
    assert batch["input_ids"].shape[0] == 4


def test_interrupted_build_leaves_no_cache_entry(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dc, "write_shards", boom)
    with pytest.raises(KeyboardInterrupt):
        dc.prepare_default_data(tmp_path, vocab_size=1000, seq_len=64)
    assert list(tmp_path.iterdir()) == []


def test_sentiment_file_is_bundled():
    with gzip.open(dc.SENTIMENT_FILE, "rt", encoding="utf-8") as f:
        header, first = f.readline(), f.readline()
        rows = 2 + sum(1 for _ in f)
    assert header.rstrip("\n").split("\t") == ["sentence", "score", "label"]
    assert first.rstrip("\n").split("\t")[2] in {"0", "1"} and rows == 10_073


def test_classic_corpus_key_is_unchanged_by_the_mixed_set():
    """electra-tiny's cache entry (and so its data) is the Austen + KJV build of earlier versions."""
    h = hashlib.sha256(b"v1")
    for name in ("austen.jsonl.gz", "kjv.jsonl.gz"):
        h.update((dc.CORPUS_DIR / name).read_bytes())
    assert dc._corpus_digest("classic") == h.hexdigest()[:12]
    assert dc._corpus_digest("mixed") != dc._corpus_digest("classic")
    assert [p.name for p in dc.bundled_corpus_files("classic")] == ["austen.jsonl.gz", "kjv.jsonl.gz"]
    with pytest.raises(ValueError, match="data.corpus"):
        dc.bundled_corpus_files("wiki")


def test_rt_training_text_holds_every_train_sentence_and_no_dev_sentence(tmp_path):
    rt = TaskConfig(name="rt")
    train, dev = load_split(rt, "train"), load_split(rt, "dev")
    path = tmp_path / "rt_train.jsonl"
    assert dc.write_rt_train_documents(path, repeats=2) == len(train)
    docs = [json.loads(line)["text"].split("\n") for line in path.read_text(encoding="utf-8").splitlines()]
    sentences = [s for d in docs for s in d]
    assert len(sentences) == 2 * len(train)
    assert sorted(sentences) == sorted(2 * [ex.text_a for ex in train])
    assert not set(sentences) & {ex.text_a for ex in dev}
    per_repeat = len(docs) // 2
    assert docs[:per_repeat] != docs[per_repeat:]  # each repeat is its own shuffle
    assert max(len(d) for d in docs) == dc.RT_TRAIN_SENTENCES_PER_DOCUMENT


@pytest.mark.slow
def test_mixed_corpus_builds_with_every_source(tmp_path):
    tok_dir, shards_dir = dc.prepare_default_data(tmp_path, vocab_size=1000, seq_len=64, corpus="mixed")
    m = read_manifest(shards_dir)
    rt_documents = 4 * -(-9071 // dc.RT_TRAIN_SENTENCES_PER_DOCUMENT)
    assert m["documents"] == 269 + 778 + 656 + 713 + rt_documents and m["mean_fill"] > 0.95
    assert tok_dir.parent.name.startswith("mixed-v1000-L64-")
    assert Tokenizer.load(tok_dir).vocab_size == 1000
