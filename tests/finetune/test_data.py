"""Built-in tasks: fixed, documented splits; stable indices; [CLS] a [SEP] b [SEP] encoding; bad files."""

from __future__ import annotations

import csv
import gzip
import hashlib

import pytest

from megakd.config import ConfigError
from megakd.data.default_corpus import SENTIMENT_FILE
from megakd.data.tasks import EncodedTask, Example, encode_examples, load_split
from megakd.data.tokenizer import Tokenizer
from megakd.finetune.config import TaskConfig


def test_rt_split_is_the_documented_hash_rule_with_file_row_indices():
    rt = TaskConfig(name="rt")
    train, dev = load_split(rt, "train"), load_split(rt, "dev")
    with gzip.open(SENTIMENT_FILE, "rt", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    assert len(train) + len(dev) == len(rows) == 10072
    for ex in train + dev:
        assert ex.text_a == rows[ex.index]["sentence"] and ex.label == int(rows[ex.index]["label"])
    for split, want in ((dev, True), (train, False)):
        assert all((hashlib.sha256(e.text_a.encode()).digest()[0] < 26) == want for e in split)
    assert not {e.text_a for e in train} & {e.text_a for e in dev}
    assert 0.08 < len(dev) / len(rows) < 0.12
    assert (load_split(rt, "train"), load_split(rt, "dev")) == (train, dev)
    reg_train = load_split(TaskConfig(name="rt_score", num_labels=1), "train")
    assert [e.index for e in reg_train] == [e.index for e in train]
    assert all(e.label == float(rows[e.index]["score"]) for e in reg_train[:50])


def test_corpus_pairs_are_deterministic_and_balanced():
    pairs = TaskConfig(name="corpus_pairs")
    train, dev = load_split(pairs, "train"), load_split(pairs, "dev")
    assert (load_split(pairs, "train"), load_split(pairs, "dev")) == (train, dev)
    everything = train + dev
    assert sorted(e.index for e in everything) == list(range(len(everything)))
    share = sum(e.label for e in everything) / len(everything)
    assert 0.45 < share < 0.55
    # Split by document: only sentences that recur verbatim in several documents appear on both sides.
    shared = {e.text_a for e in train} & {e.text_a for e in dev}
    assert len(shared) < 0.01 * len(dev)
    assert 0.05 < len(dev) / len(everything) < 0.15


def test_max_examples_spreads_over_the_split():
    full = load_split(TaskConfig(name="rt"), "train")
    limited = TaskConfig(name="rt", max_train_examples=10, max_dev_examples=5)
    small, dev = load_split(limited, "train"), load_split(limited, "dev")
    assert len(small) == 10 and len(dev) == 5
    assert small == [full[i * len(full) // 10] for i in range(10)]


def test_pair_encoding_and_truncation(tiny_data):
    tok = Tokenizer.load(tiny_data[0])
    a, b = "It is a truth universally acknowledged.", "In the beginning"
    (ids, first), = encode_examples([Example(0, a, b, 1)], tok, 256)
    ea, eb = tok.encode(a), tok.encode(b)
    assert ids == [tok.cls_id, *ea, tok.sep_id, *eb, tok.sep_id] and first == len(ea) + 2
    (cut, cut_first), = encode_examples([Example(0, a, b, 1)], tok, 8)
    assert len(cut) == 8 and cut[0] == tok.cls_id and cut.count(tok.sep_id) == 2
    task = EncodedTask([Example(7, a, b, 1), Example(9, "Short.", None, 0)], tok, 256, regression=False)
    batch = task.batch([0, 1])
    assert batch["index"].tolist() == [7, 9]
    assert batch["token_type_ids"][0].tolist() == [0] * first + [1] * (len(eb) + 1)
    assert batch["attention_mask"][1].sum() == len(tok.encode("Short.")) + 2
    assert batch["input_ids"][1, batch["attention_mask"][1].sum():].eq(tok.pad_id).all()


def test_files_task_and_bad_input(tmp_path):
    (tmp_path / "train.tsv").write_text("s1\ts2\ty\nA b c.\tD e.\tpos\nF g.\tH i.\tneg\n")
    (tmp_path / "dev.jsonl").write_text('{"s1": "X y.", "s2": "Z.", "y": "neg"}\n')
    task = TaskConfig(name="files", train=str(tmp_path / "train.tsv"), dev=str(tmp_path / "dev.jsonl"),
                      text_a="s1", text_b="s2", label="y", labels=["neg", "pos"])
    train, dev = load_split(task, "train"), load_split(task, "dev")
    assert [(e.index, e.label) for e in train + dev] == [(0, 1), (1, 0), (2, 0)]
    assert dev[0].text_b == "Z."
    (tmp_path / "bad.tsv").write_text("s1\ts2\ty\nA.\tB.\tmaybe\n")
    task.train = str(tmp_path / "bad.tsv")
    with pytest.raises(ConfigError, match=r"bad.tsv: row 1: label 'maybe'"):
        load_split(task, "train")
    task.train, task.text_a = str(tmp_path / "train.tsv"), "sentence"
    with pytest.raises(ConfigError, match="has no field 'sentence'"):
        load_split(task, "train")
