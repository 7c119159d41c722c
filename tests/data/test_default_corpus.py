import gzip

import pytest

import megakd.data.default_corpus as dc
from megakd.data.shards import read_manifest
from megakd.data.stream import PretrainingLoader
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
