"""Hostile fine-tuning task files (`task.name=files`): bytes that are not UTF-8, rows missing a label,
JSONL rows that are not objects, labels and texts of the wrong type, non-finite regression targets,
fields over 128 KiB, damaged gzip.

Each row runs `megakd finetune` in a fresh process (tests/faults/harness.py) and checks exit code 2,
one error line naming the file, the row and its line (and the column or field) and what was
expected, no traceback, nothing outside the run directory changed, and the run directory left
unused (no `config.yaml`), so the corrected command starts there without `run.overwrite`.
"""

from __future__ import annotations

import csv
import gzip
import json
import re
from pathlib import Path

import pytest

from megakd.cli import main
from megakd.data import tasks
from megakd.data.default_corpus import SENTIMENT_FILE
from megakd.finetune import trainer
from megakd.finetune.config import TaskConfig
from megakd.store.rundir import used_entries
from tests.faults.harness import megakd, snapshot
from tests.finetune.test_distributed import tiny_finetune

GOOD_TSV = b"sentence\tlabel\nA fine film.\t1\nA dull film.\t0\n"
HEADER = b"sentence\tlabel\n"
BIG = "x" * (128 * 1024 + 1)  # one byte over the limit
BIG_UTF8 = "\u00e9" * (64 * 1024 + 1)  # 65,537 characters, 131,074 bytes of UTF-8


def jsonl(*rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


OK = {"sentence": "A fine film.", "label": 1}
REGRESSION = ("task.num_labels=1", "task.label=score")

# (id, file name, its bytes, where it goes: train or dev, extra overrides, error-line pattern after "<file>: ")
ROWS = [
    ("tsv-not-utf8", "train.tsv", HEADER + b"A fine film.\t1\nA \xff film.\t0\n", "train", (),
     r"row 2: byte b'\\xff' is not UTF-8 \(line 3, byte 3, column 'sentence'\): expected a UTF-8 text file$"),
    ("jsonl-gz-not-utf8", "train.jsonl.gz", gzip.compress(jsonl(OK, b'{"sentence": "\xc3(", "label": 0}')),
     "train", (), r"row 2: byte b'\\xc3' is not UTF-8 \(line 2, byte 15\): expected a UTF-8 text file$"),
    ("tsv-row-missing-its-label", "train.tsv", HEADER + b"A fine film.\t1\nA film without a label\n", "train", (),
     r"row 2: 1 tab-separated cells \(line 3\): expected the header's 2 columns; no cell for column 'label'$"),
    ("tsv-row-with-an-extra-cell", "train.tsv", HEADER + b"A fine\tfilm.\t1\n", "train", (),
     r"row 1: 3 tab-separated cells \(line 2\): expected the header's 2 columns; a cell after the last column "
     r"'label' \(a tab inside a text\?\)$"),
    ("jsonl-row-missing-its-label", "train.jsonl", jsonl(OK, {"sentence": "No label."}), "train", (),
     r"row 2: no field 'label' \(line 2\): expected the field task.label names$"),
    ("jsonl-row-is-a-string", "train.jsonl", jsonl(OK, "A fine film."), "train", (),
     r"row 2: a string \(line 2\): expected a JSON object with the task's fields$"),
    ("jsonl-row-is-a-number", "train.jsonl", jsonl(OK, b"", 42), "train", (),
     r"row 2: a number \(line 3\): expected a JSON object with the task's fields$"),
    ("jsonl-row-not-json", "train.jsonl", jsonl(OK, b'{"sentence": "A", '), "train", (),
     r"row 2: not valid JSON \(Expecting property name .*\) \(line 2\): expected one JSON object per line$"),
    ("tsv-label-1.9", "train.tsv", HEADER + b"A fine film.\t1.9\n", "train", (),
     r"row 1: label '1.9' \(line 2, column 'label'\): expected an integer in \[0, 2\) \(task.num_labels\)$"),
    ("tsv-label-true", "train.tsv", HEADER + b"A fine film.\ttrue\n", "train", (),
     r"row 1: label 'true' \(line 2, column 'label'\): expected an integer in \[0, 2\) \(task.num_labels\)$"),
    ("tsv-label-yes", "train.tsv", HEADER + b"A fine film.\tyes\n", "train", (),
     r"row 1: label 'yes' \(line 2, column 'label'\): expected an integer in \[0, 2\)"),
    ("tsv-label-out-of-range", "train.tsv", HEADER + b"A fine film.\t2\n", "train", (),
     r"row 1: label '2' \(line 2, column 'label'\): expected an integer in \[0, 2\)"),
    ("jsonl-label-true", "train.jsonl", jsonl({"sentence": "A.", "label": True}), "train", (),
     r"row 1: label true \(line 1, field 'label'\): expected a JSON integer in \[0, 2\) \(task.num_labels\)$"),
    ("jsonl-label-1.9", "train.jsonl", jsonl({"sentence": "A.", "label": 1.9}), "train", (),
     r"row 1: label 1.9 \(line 1, field 'label'\): expected a JSON integer in \[0, 2\)"),
    ("jsonl-label-string-1", "train.jsonl", jsonl({"sentence": "A.", "label": "1"}), "train", (),
     r"row 1: label \"1\" \(line 1, field 'label'\): expected a JSON integer in \[0, 2\)"),
    ("jsonl-label-not-a-class-name", "train.jsonl", jsonl({"sentence": "A.", "label": 1}), "train",
     ("task.labels=[neg,pos]",),
     r"row 1: label 1 \(line 1, field 'label'\): expected one of 'neg', 'pos' as a JSON string \(task.labels\)$"),
    ("jsonl-text-null", "train.jsonl", jsonl(OK, {"sentence": None, "label": 0}), "train", (),
     r"row 2: text null \(line 2, field 'sentence'\): expected a JSON string \(task.text_a\)$"),
    ("jsonl-text-number", "train.jsonl", jsonl({"sentence": 5, "label": 0}), "train", (),
     r"row 1: text 5 \(line 1, field 'sentence'\): expected a JSON string \(task.text_a\)$"),
    ("tsv-target-nan", "train.tsv", b"sentence\tscore\nA fine film.\t0.5\nA dull film.\tnan\n", "train", REGRESSION,
     r"row 2: label 'nan' \(line 3, column 'score'\): expected a finite number \(task.num_labels=1: regression\)$"),
    ("tsv-target-1e999", "train.tsv", b"sentence\tscore\nA fine film.\t1e999\n", "train", REGRESSION,
     r"row 1: label '1e999' \(line 2, column 'score'\): expected a finite number"),
    ("jsonl-target-Infinity", "train.jsonl", b'{"sentence": "A.", "score": -Infinity}\n', "train", REGRESSION,
     r"row 1: label -Infinity \(line 1, field 'score'\): expected a finite JSON number"),
    ("tsv-field-over-128KiB", "train.tsv", HEADER + BIG.encode() + b"\t1\n", "train", (),
     r"row 1: column 'sentence' of 131073 bytes \(line 2\): expected at most 128 KiB \(131072 bytes\) of UTF-8 "
     r"per field$"),
    ("jsonl-field-over-128KiB", "train.jsonl", jsonl({"sentence": BIG_UTF8, "label": 0}), "train", (),
     r"row 1: field 'sentence' of 131074 bytes \(line 1\): expected at most 128 KiB"),
    ("truncated-gzip", "train.tsv.gz",
     gzip.compress(HEADER + b"".join(b"Film %d.\t1\n" % i for i in range(4000)))[:600],
     "train", (), r"not a readable gzip file \(Compressed file ended .*\); expected a .gz task file written whole$"),
    ("dev-label-true", "dev.tsv", HEADER + b"A fine film.\ttrue\n", "dev", (),
     r"row 1: label 'true' \(line 2, column 'label'\): expected an integer in \[0, 2\)"),
]


def files_task(train: Path, dev: Path, *extra: str) -> tuple[str, ...]:
    return ("task.name=files", f"task.train={train}", f"task.dev={dev}", "task.max_train_examples=0",
            "task.max_dev_examples=0", *extra)


@pytest.mark.parametrize(("name", "data", "split", "extra", "pattern"), [r[1:] for r in ROWS],
                         ids=[r[0] for r in ROWS])
def test_hostile_task_file_is_one_line(tiny_data, tmp_path, name, data, split, extra, pattern):
    data_dir, run = tmp_path / "data", tmp_path / "run"
    data_dir.mkdir()
    bad = data_dir / name
    bad.write_bytes(data)
    good = data_dir / ("good.jsonl" if "jsonl" in name else "good.tsv")
    good.write_bytes(jsonl(OK, {**OK, "label": 0}) if "jsonl" in name else GOOD_TSV)
    if "score" in " ".join(extra):
        good.write_bytes(b"sentence\tscore\nA fine film.\t0.5\n" if "tsv" in name else
                         jsonl({"sentence": "A fine film.", "score": 0.5}))
    train, dev = (bad, good) if split == "train" else (good, bad)
    before = snapshot(data_dir)
    # One rate: dev is read before the first step too (a list of rates reads it after the selection trials).
    out = megakd(*tiny_finetune(tiny_data[0], run, "finetune.lr=1e-3", *files_task(train, dev, *extra)),
                 timeout=300)
    assert out.code == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("megakd: error:")]
    assert len(errors) == 1 and errors[0] == out.error_line(), out.stderr[-3000:]
    assert re.search("^megakd: error: " + re.escape(str(bad)) + ": " + pattern, errors[0]), errors[0][:2000]
    assert len(errors[0]) < 400
    assert snapshot(data_dir) == before
    assert used_entries(run) == []  # no config.yaml left behind: the corrected command may start here


def test_run_that_failed_before_its_first_step_leaves_the_run_dir_reusable(tiny_data, tmp_path, monkeypatch,
                                                                            capsys):
    """A refused task file, then a traceback before the first step, then the corrected command: no run.overwrite."""
    train, dev, run = tmp_path / "train.tsv", tmp_path / "dev.tsv", tmp_path / "run"
    rows = [f"Film number {i} was {'good' if i % 2 else 'bad'}.\t{i % 2}\n" for i in range(12)]
    dev.write_text("sentence\tlabel\n" + "".join(rows[:4]))
    train.write_text("sentence\tlabel\n" + "".join(rows[:5]) + "A film.\ttrue\n")
    args = tiny_finetune(tiny_data[0], run, "finetune.lr=1e-3", "finetune.epochs=1", *files_task(train, dev))
    assert main(args) == 2
    assert "row 6: label 'true' (line 7, column 'label')" in capsys.readouterr().err
    assert used_entries(run) == []

    def crash(*_args):
        raise RuntimeError("a bug while reading the task")

    train.write_text("sentence\tlabel\n" + "".join(rows))
    with monkeypatch.context() as patch:
        patch.setattr(trainer, "load_split", crash)
        with pytest.raises(RuntimeError, match="a bug while reading the task"):
            main(args)
    assert used_entries(run) == []
    assert main(args) == 0  # the corrected command, without run.overwrite
    assert (run / "summary.json").is_file() and (run / "config.yaml").is_file()
    assert main(args) == 2  # a run that trained still owns its directory
    assert "already holds a run" in capsys.readouterr().err


def test_strict_reader_loads_valid_files_as_before(tmp_path):
    """The bundled RT file read as a `files` task equals what csv.DictReader reads; TSV cells are text."""
    with gzip.open(SENTIMENT_FILE, "rt", encoding="utf-8") as f:
        want = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    task = TaskConfig(name="files", train=str(SENTIMENT_FILE), dev=str(SENTIMENT_FILE), label="score", num_labels=1)
    got = tasks.load_split(task, "train")
    assert [(e.index, e.text_a, e.label) for e in got] == [(i, r["sentence"], float(r["score"]))
                                                           for i, r in enumerate(want)]
    task.label, task.num_labels = "label", 2
    assert [e.label for e in tasks.load_split(task, "train")] == [int(r["label"]) for r in want]
    # "1" in a TSV is the integer 1 and "null" is the text "null"; CRLF and blank lines as csv reads them.
    (tmp_path / "t.tsv").write_bytes(b"sentence\tlabel\r\nnull\t1\r\n\r\nSay \"hi\".\t0\r\n")
    (tmp_path / "t.jsonl").write_bytes(b'{"sentence": "null", "label": 1, "extra": [1]}\n\n'
                                       b'{"sentence": "B", "label": 0}')
    for name in ("t.tsv", "t.jsonl"):
        task = TaskConfig(name="files", train=str(tmp_path / name), dev=str(tmp_path / name))
        assert [(e.index, e.text_a, e.label) for e in tasks.load_split(task, "dev")][:1] == [(2, "null", 1)]
