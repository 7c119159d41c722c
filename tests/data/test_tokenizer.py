import json

import pytest

from megakd.data.tokenizer import META_FILE, Tokenizer, train_tokenizer

from .conftest import corpus_docs


def test_special_layout_matches_deberta_v3(tokenizer):
    pieces = [tokenizer.sp.id_to_piece(i) for i in range(5)]
    assert pieces == ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]
    assert (tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id, tokenizer.unk_id,
            tokenizer.mask_id) == (0, 1, 2, 3, 4)
    assert tokenizer.special_ids == frozenset(range(5))
    assert tokenizer.vocab_size == 600
    meta = json.loads((tokenizer.path / META_FILE).read_text())
    assert meta["vocab_hash"] == tokenizer.vocab_hash and meta["special_ids"]["mask"] == 4


def test_literal_mask_text_is_not_the_mask_token(tokenizer):
    assert tokenizer.mask_id not in tokenizer.encode("a [MASK] b [CLS] [SEP] [PAD]")


def test_training_is_deterministic(corpus_jsonl, tokenizer, tmp_path):
    again = train_tokenizer([corpus_jsonl], 600, tmp_path / "again")
    assert again.vocab_hash == tokenizer.vocab_hash
    assert (again.path / "spm.model").read_bytes() == (tokenizer.path / "spm.model").read_bytes()
    other = train_tokenizer([corpus_jsonl], 700, tmp_path / "other")
    assert other.vocab_hash != tokenizer.vocab_hash


def test_encode_decode_round_trip_on_corpus(tokenizer):
    # nmt_nfkc normalisation folds runs of whitespace (line breaks) into one space; nothing else changes.
    for doc in corpus_docs(3, 3):
        ids = tokenizer.encode(doc)
        assert tokenizer.unk_id not in ids
        assert tokenizer.decode(ids) == " ".join(doc.split())


def test_byte_fallback_round_trips_unseen_characters(tokenizer):
    text = "naïve café — 日本語 🙂"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_streams_text_gz_and_directories(tmp_path):
    import gzip

    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    docs = corpus_docs(1, 4)
    with gzip.open(d / "sub" / "a.txt.gz", "wt") as f:
        f.write(docs[0])
    (d / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[1:]))
    tok = train_tokenizer([d], 400, tmp_path / "tok")
    assert tok.vocab_size == 400 and Tokenizer.load(tmp_path / "tok").vocab_hash == tok.vocab_hash


def test_refuses_to_overwrite(corpus_jsonl, tokenizer):
    with pytest.raises(FileExistsError, match=str(tokenizer.path)):
        train_tokenizer([corpus_jsonl], 600, tokenizer.path)


def test_tampered_metadata_is_caught(tokenizer, tmp_path):
    import shutil

    copy = tmp_path / "tok"
    shutil.copytree(tokenizer.path, copy)
    meta = json.loads((copy / META_FILE).read_text())
    meta["vocab_hash"] = "0" * 16
    (copy / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="vocab_hash 0000000000000000 does not match"):
        Tokenizer.load(copy)


def test_hf_fast_tokenizer_matches(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tokenizer.to_hf().save_pretrained(tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (hf.pad_token_id, hf.cls_token_id, hf.sep_token_id, hf.unk_token_id, hf.mask_token_id) == (0, 1, 2, 3, 4)
    for doc in corpus_docs(6, 10) + ["naïve café — 日本語 🙂", "a  b\n\n c "]:
        ids = tokenizer.encode(doc)
        assert hf(doc, add_special_tokens=False)["input_ids"] == ids
        assert hf(doc)["input_ids"] == [1, *ids, 2]
        assert hf.decode(ids) == tokenizer.decode(ids)
