"""HF tokenizer directories as megakd tokenizers: their own ids and special layout everywhere.

Built locally: a WordPiece `vocab.txt` trained on the corpus slice (BERT's layout: [PAD] 0,
[UNK] 4, [CLS] 5, [SEP] 6, [MASK] 7) and a `tokenizers` byte-level BPE `tokenizer.json` whose
specials are RoBERTa's (<s> 0, <pad> 1, </s> 2, <unk> 3, <mask> 4). No hub.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, BertTokenizerFast

from megakd.cli import main
from megakd.config import TaskConfig
from megakd.data.loader import PretrainingLoader
from megakd.data.shards import read_manifest, write_shards
from megakd.data.tasks import encode_examples, load_split
from megakd.data.tokenizer import Tokenizer
from megakd.errors import UserError

from .conftest import corpus_docs, write_jsonl

BERT_LAYOUT = {"pad_id": 0, "cls_id": 5, "sep_id": 6, "unk_id": 4, "mask_id": 7}


def _bpe_dir(path, docs, specials=("<s>", "<pad>", "</s>", "<unk>", "<mask>"), lowercase=False):
    """A byte-level BPE tokenizer.json (no tokenizer_config.json: the roles come from the token names)."""
    from tokenizers import normalizers

    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    if lowercase:
        raw.normalizer = normalizers.Lowercase()
    raw.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=500, special_tokens=list(specials),
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    path.mkdir(parents=True)
    raw.save(str(path / "tokenizer.json"))
    return path


def test_wordpiece_dir_keeps_its_layout_and_encodes_like_transformers(wordpiece_data):
    tokenizer_dir, _ = wordpiece_data
    tok = Tokenizer.load(tokenizer_dir)
    assert tok.kind == "hf" and tok.special_layout() == BERT_LAYOUT and tok.vocab_size == 403
    assert tok.special_ids == frozenset(BERT_LAYOUT.values())
    hf = BertTokenizerFast.from_pretrained(tokenizer_dir)
    docs = corpus_docs(3, 3)
    assert tok.encode_batch(docs) == [hf(d, add_special_tokens=False)["input_ids"] for d in docs]
    # literal special-token text is ordinary text, as for megakd's SentencePiece model
    ids = tok.encode("a [MASK] b [CLS] [SEP] [PAD]")
    assert not set(ids) & tok.special_ids - {tok.unk_id}


def test_tokenizer_json_roles_come_from_its_own_special_tokens(tmp_path):
    docs = corpus_docs(2, 4)
    tok = Tokenizer.load(_bpe_dir(tmp_path / "bpe", docs))
    assert tok.special_layout() == {"pad_id": 1, "cls_id": 0, "sep_id": 2, "unk_id": 3, "mask_id": 4}
    raw = RawTokenizer.from_file(str(tmp_path / "bpe" / "tokenizer.json"))
    assert tok.encode_batch(docs) == [e.ids for e in raw.encode_batch(docs, add_special_tokens=False)]
    assert tok.decode(tok.encode(docs[0])) == docs[0]  # byte-level BPE round-trips exactly


def test_vocab_hash_is_the_encoding_identity(wordpiece_data, tmp_path):
    tokenizer_dir, _ = wordpiece_data
    tok = Tokenizer.load(tokenizer_dir)
    # the same tokenizer saved by transformers as tokenizer.json (+ tokenizer_config.json): same hash
    BertTokenizerFast.from_pretrained(tokenizer_dir).save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved" / "vocab.txt").exists()
    assert Tokenizer.load(tmp_path / "saved").vocab_hash == tok.vocab_hash
    # cased (do_lower_case: false) encodes other ids for the same vocab: another hash
    shutil.copytree(tokenizer_dir, tmp_path / "cased")
    (tmp_path / "cased" / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False}))
    assert Tokenizer.load(tmp_path / "cased").vocab_hash != tok.vocab_hash
    docs = corpus_docs(2, 4)
    assert Tokenizer.load(_bpe_dir(tmp_path / "a", docs)).vocab_hash != \
        Tokenizer.load(_bpe_dir(tmp_path / "b", docs, lowercase=True)).vocab_hash


def test_shards_record_the_tokenizer_and_use_its_ids(wordpiece_data, tiny_data):
    tokenizer_dir, shards_dir = wordpiece_data
    tok = Tokenizer.load(tokenizer_dir)
    manifest = read_manifest(shards_dir)
    assert manifest["tokenizer"] == {"kind": "hf", "vocab_hash": tok.vocab_hash, "vocab_size": 403, **BERT_LAYOUT}
    first_doc = json.loads((tiny_data[0].parent / "slice.jsonl").read_text().splitlines()[0])["text"]
    loader = PretrainingLoader(shards_dir, tok, micro_batch_size=16, seed=3)
    batch = next(iter(loader))
    ids, attn, mask = (batch[k].numpy() for k in ("input_ids", "attention_mask", "mlm_mask"))
    # every sample is [CLS] chunk [SEP] in the tokenizer's ids; sample 0 is the first document's head
    lengths = attn.sum(1)
    assert (ids[:, 0] == 5).all() and (ids[np.arange(len(ids)), lengths - 1] == 6).all()
    assert (ids[~attn] == 0).all()
    order = batch["index"].numpy()
    if 0 in order:
        row = int(np.flatnonzero(order == 0)[0])
        assert ids[row, :lengths[row]].tolist() == [5, *tok.encode(first_doc)[:62], 6]
    # masking: only non-special tokens, replaced by this tokenizer's [MASK] (7), round(0.15 n) each
    assert not np.isin(ids[mask], list(tok.special_ids)).any()
    assert (batch["masked_input_ids"].numpy()[mask] == 7).all()
    maskable = attn & ~np.isin(ids, list(tok.special_ids))
    assert (mask.sum(1) == np.maximum(np.floor(0.15 * maskable.sum(1) + 0.5), 1)).all()


def test_finetuning_inputs_use_the_tokenizer_ids(wordpiece_data):
    tok = Tokenizer.load(wordpiece_data[0])
    pairs = load_split(TaskConfig(name="corpus_pairs", max_train_examples=4), "train")
    for (ids, first), example in zip(encode_examples(pairs, tok, 64), pairs):
        a = tok.encode(example.text_a)
        assert ids[0] == 5 and ids[first - 1] == 6 and ids[-1] == 6 and ids[1:first - 1] == a[:len(ids[1:first - 1])]


def test_tokenizer_without_specials_is_refused_in_one_line(tmp_path, capsys):
    src = write_jsonl(tmp_path / "docs.jsonl", corpus_docs(1, 2))
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "vocab.txt").write_text("\n".join(["a", "b", "c", "##s"]) + "\n")
    bare = _bpe_dir(tmp_path / "bare", corpus_docs(1, 2), specials=("<|endoftext|>",))
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "tokenizer.json").write_text("{not json")
    (tmp_path / "empty").mkdir()
    for tokenizer_dir, expected in ((tmp_path / "plain", "pad_token '[PAD]' is not in its vocabulary (vocab.txt)"),
                                    (bare, "no pad_token, cls_token, sep_token, mask_token"),
                                    (tmp_path / "garbage", "cannot load it as an HF tokenizer"),
                                    (tmp_path / "empty", "no spm.model, tokenizer.json or vocab.txt")):
        out = tmp_path / f"shards-{tokenizer_dir.name}"
        capsys.readouterr()
        assert main(["data", "shards", "--input", str(src), "--tokenizer", str(tokenizer_dir), "--seq-len", "32",
                     "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(tokenizer_dir) in err[0] and expected in err[0], err
        assert not out.exists()
    with pytest.raises(UserError, match="no such directory"):
        Tokenizer.load(tmp_path / "missing")


def test_bpe_tokenizer_json_pads_and_builds_models_with_its_pad_id(tmp_path):
    docs = corpus_docs(4, 10)
    tokenizer_dir = _bpe_dir(tmp_path / "bpe", docs)
    tok = Tokenizer.load(tokenizer_dir)
    write_shards([write_jsonl(tmp_path / "docs.jsonl", docs)], tok, 32, tmp_path / "shards", samples_per_shard=50)
    batch = next(iter(PretrainingLoader(tmp_path / "shards", tok, micro_batch_size=8, seed=0)))
    ids, attn = batch["input_ids"].numpy(), batch["attention_mask"].numpy()
    assert (ids[~attn] == 1).all() and (ids[:, 0] == 0).all()
    from megakd.config import load_config
    from megakd.finish import finish_config

    cfg = finish_config(load_config("configs/electra-tiny.yaml", [f"data.tokenizer={tokenizer_dir}",
                                                                    f"data.shards={tmp_path / 'shards'}"]))
    assert cfg.model.generator.pad_token_id == cfg.model.discriminator.pad_token_id == 1
    assert cfg.model.generator.vocab_size == tok.vocab_size


def test_exported_run_loads_with_autotokenizer_and_the_same_ids(wordpiece_electra_run, wordpiece_data):
    tok = Tokenizer.load(wordpiece_data[0])
    docs = corpus_docs(2, 2)
    for sub in ("discriminator", "generator"):
        hf = AutoTokenizer.from_pretrained(wordpiece_electra_run / "hf" / sub)
        assert [hf(d, add_special_tokens=False)["input_ids"] for d in docs] == tok.encode_batch(docs)
        assert (hf.pad_token_id, hf.cls_token_id, hf.sep_token_id, hf.unk_token_id, hf.mask_token_id) == (0, 5, 6, 4, 7)
        config = json.loads((wordpiece_electra_run / "hf" / sub / "config.json").read_text())
        assert config["pad_token_id"] == 0 and config["vocab_size"] == 403
    # the checkpoint carries the tokenizer files only, and they are the same tokenizer
    step = sorted((wordpiece_electra_run / "checkpoints").iterdir())[-1]
    assert sorted(p.name for p in (step / "tokenizer").iterdir()) == ["vocab.txt"]
    assert Tokenizer.load(step / "tokenizer").vocab_hash == tok.vocab_hash
