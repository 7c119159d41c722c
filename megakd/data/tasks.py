"""Labelled examples for fine-tuning and the pretraining probe: built-in tasks from the bundled corpus,
and GLUE-style files.

Every example carries a stable `index` (its position in the task's full example list, before any
split or truncation), which SoTeacher's consistency store is keyed by.

Built-in tasks (fixed splits: the same on every machine and run, independent of seeds):

- ``rt``: the 10,072 Rotten Tomatoes sentences of `megakd/data/corpus/rt_sentences.tsv.gz`,
  binary sentiment (label column). An example is in dev when the first byte of
  sha256(sentence) is < 26 (26/256 ≈ 10.2%), else in train; a split by content keeps duplicate
  sentences on one side.
- ``rt_score``: the same sentences and split, regressing the crowd score in [−4, 4] (Spearman).
- ``corpus_pairs``: sentence-pair classification from the pretraining corpus (Austen + KJV):
  label 1 = b is the sentence that follows a in the same document, 0 = b is a sentence drawn
  from another document. Sentences are KJV verses and Austen sentences (split after . ! ? at the
  end of a word, not after Mr./Mrs./Dr./St.); for each document, pairs start at every second sentence, and a seeded RNG
  (seed 0) chooses the label and the random sentence. Documents go to dev when the first byte of
  sha256(document text) is < 26, so no sentence is shared across the split.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import random
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from megakd.config import ConfigError, TaskConfig
from megakd.data.default_corpus import CORPUS_DIR, PRETRAINING_FILES, SENTIMENT_FILE, in_dev
from megakd.data.sources import open_text
from megakd.data.tokenizer import Tokenizer

# After . ! ? that ends a word, except the titles Austen abbreviates (Mr. Knightley, Mrs. Weston).
_SENTENCE_END = re.compile(r"(?<!\bMr\.)(?<!\bMrs\.)(?<!\bDr\.)(?<!\bSt\.)(?<=[a-z0-9\"')][.!?])\s+(?=[\"'A-Z])")


@dataclass(frozen=True)
class Example:
    index: int
    text_a: str
    text_b: str | None
    label: float | int


def _rt_examples(regression: bool) -> tuple[list[Example], list[Example]]:
    train, dev = [], []
    with open_text(SENTIMENT_FILE) as f:
        for i, row in enumerate(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)):
            label = float(row["score"]) if regression else int(row["label"])
            ex = Example(i, row["sentence"], None, label)
            (dev if in_dev(ex.text_a) else train).append(ex)
    return train, dev


def _sentences(document: str, verses: bool) -> list[str]:
    if verses:
        return [ln.strip() for ln in document.split("\n") if ln.strip()]
    flat = " ".join(document.split())
    return [s for s in _SENTENCE_END.split(flat) if len(s.split()) >= 3]


def _corpus_pair_examples() -> tuple[list[Example], list[Example]]:
    documents: list[tuple[str, list[str]]] = []
    for name in PRETRAINING_FILES:
        with open_text(CORPUS_DIR / name) as f:
            for line in f:
                text = json.loads(line)["text"]
                documents.append((text, _sentences(text, verses=name.startswith("kjv"))))
    rng = random.Random(0)
    train, dev = [], []
    index = 0
    for d, (text, sentences) in enumerate(documents):
        side = dev if in_dev(text) else train
        for i in range(0, len(sentences) - 1, 2):
            if rng.random() < 0.5:
                b, label = sentences[i + 1], 1
            else:
                other = rng.randrange(len(documents) - 1)
                other += other >= d  # any document but this one
                pool = documents[other][1] or [documents[other][0]]
                b, label = pool[rng.randrange(len(pool))], 0
            side.append(Example(index, sentences[i], b, label))
            index += 1
    return train, dev


MAX_FIELD_BYTES = 128 * 1024  # a text or label field of a task file, in UTF-8 bytes
MAX_LINE_CHARS = 8 * 1024 * 1024  # a whole line of a task file (its unused columns or fields included)
_DECIMAL = re.compile(r"[0-9]{1,18}")  # a class id in a TSV cell: digits only (no sign, space, 1.0 or 1_0)
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,4})?")  # a regression target in a TSV cell
GZIP_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)  # a truncated or damaged .gz
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


@dataclass(frozen=True)
class _Row:
    line: int  # 1-based line of the file (a TSV header is line 1)
    fields: dict


def _bad(path: Path, n: int, line: int, subject: str, expected: str, where: str = "") -> ConfigError:
    """One line: the file, the data row, what is wrong in it, its line (and column or field), what was expected."""
    return ConfigError(f"{path}: row {n}: {subject} (line {line}{where}): expected {expected}")


def _lines(path: Path):
    """(line number, line without its newline) of a UTF-8 text file, gzip-compressed if it ends in .gz;
    a line over MAX_LINE_CHARS, bytes that are not UTF-8 or a damaged gzip stream are refused in one line."""
    n = 0
    try:
        with open_text(path) as f:
            while line := f.readline(MAX_LINE_CHARS + 2):
                n += 1
                line = line.removesuffix("\n")
                if len(line) > MAX_LINE_CHARS:
                    raise ConfigError(f"{path}: line {n} is longer than {MAX_LINE_CHARS // 2**20} MiB "
                                      f"(expected task rows with fields of at most {MAX_FIELD_BYTES // 1024} KiB)")
                yield n, line
    except UnicodeDecodeError:
        try:
            where = _not_utf8(path)
        except GZIP_ERRORS:
            where = f"{path}: not UTF-8 text: expected a UTF-8 text file"
        raise ConfigError(where) from None
    except GZIP_ERRORS as err:
        raise ConfigError(f"{path}: not a readable gzip file ({err}); expected a .gz task file "
                          "written whole") from None


def _not_utf8(path: Path) -> str:
    """Where the first byte that is not UTF-8 is: the row, line, byte and (in a TSV) column; the text
    decoder reports only a position in its buffer."""
    tsv = path.name.removesuffix(".gz").endswith(".tsv")
    header: list[str] = []
    rows = 0
    with (gzip.open if path.name.endswith(".gz") else open)(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as err:
                where = f"line {n}, byte {err.start + 1}"
                if tsv and n > 1:
                    col = raw[:err.start].count(b"\t")
                    where += f", column {header[col]!r}" if col < len(header) else f", cell {col + 1}"
                subject = "header" if tsv and n == 1 else f"row {rows + 1}"
                return (f"{path}: {subject}: byte {raw[err.start:err.start + 1]!r} is not UTF-8 ({where}): "
                        "expected a UTF-8 text file")
            if tsv and n == 1:
                header = line.split("\t")
            elif line.strip() if not tsv else line:
                rows += 1
    return f"{path}: not UTF-8 text: expected a UTF-8 text file"


def _read_rows(path: Path) -> list[_Row]:
    """The data rows of a task file: a .tsv (header row, tab-separated, no quoting) or .jsonl (one JSON
    object per line), each optionally .gz. Blank lines are skipped. Values are checked by `_file_examples`."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    name = path.name.removesuffix(".gz")
    if name.endswith(".jsonl"):
        rows = []
        for n, line in _lines(path):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except (ValueError, RecursionError) as err:  # ValueError: also an integer of > 4300 digits
                raise _bad(path, len(rows) + 1, n, f"not valid JSON ({' '.join(str(err).split())[:200]})",
                           "one JSON object per line") from None
            if not isinstance(value, dict):
                raise _bad(path, len(rows) + 1, n, _JSON_TYPES.get(type(value), type(value).__name__),
                           "a JSON object with the task's fields")
            rows.append(_Row(n, value))
        return rows
    if name.endswith(".tsv"):
        # As csv.DictReader(delimiter="\t", quoting=csv.QUOTE_NONE) reads it (empty lines skipped; a
        # repeated column name: the later column), but a row must have the header's number of columns.
        rows, header = [], None
        for n, line in _lines(path):
            if header is None:
                header = line.split("\t") if line else []
                continue
            if not line:
                continue
            cells = line.split("\t")
            if len(cells) != len(header):
                problem = (f"no cell for column {header[len(cells)]!r}" if len(cells) < len(header) else
                           f"a cell after the last column {header[-1] if header else ''!r} (a tab inside a text?)")
                raise _bad(path, len(rows) + 1, n, f"{len(cells)} tab-separated cells",
                           f"the header's {len(header)} columns; {problem}")
            rows.append(_Row(n, dict(zip(header, cells))))
        return rows
    raise ConfigError(f"{path}: expected a .tsv, .tsv.gz, .jsonl or .jsonl.gz file")


def _shown(value, tsv: bool) -> str:
    text = repr(value) if tsv else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else f"{text[:18]}...{text[-18:]}"


def _check_size(path: Path, n: int, row: _Row, kind: str, key: str, value: str) -> None:
    if len(value) > MAX_FIELD_BYTES // 4 and len(value.encode("utf-8")) > MAX_FIELD_BYTES:
        raise _bad(path, n, row.line, f"{kind} {key!r} of {len(value.encode('utf-8'))} bytes",
                   f"at most {MAX_FIELD_BYTES // 1024} KiB ({MAX_FIELD_BYTES} bytes) of UTF-8 per field")


def _label(path: Path, n: int, row: _Row, task: TaskConfig, tsv: bool) -> float | int:
    """The label of one row, strictly typed: a TSV cell is text, a JSONL value has its JSON type."""
    raw = row.fields[task.label]
    if tsv:
        _check_size(path, n, row, "column", task.label, raw)
    elif isinstance(raw, str):
        _check_size(path, n, row, "field", task.label, raw)
    label: float | int | None = None
    if task.num_labels == 1:
        expected, keys = "a finite number" if tsv else "a finite JSON number", "task.num_labels=1: regression"
        if tsv and _NUMBER.fullmatch(raw):
            label = float(raw)
        elif not tsv and isinstance(raw, (int, float)) and not isinstance(raw, bool):
            label = float(raw)
        if label is not None and not math.isfinite(label):
            label = None
    elif task.labels:
        expected, keys = f"one of {', '.join(map(repr, task.labels))}", "task.labels"
        expected += "" if tsv else " as a JSON string"
        if isinstance(raw, str) and raw in task.labels:
            label = task.labels.index(raw)
    else:
        expected, keys = f"{'an' if tsv else 'a JSON'} integer in [0, {task.num_labels})", "task.num_labels"
        if tsv and _DECIMAL.fullmatch(raw):
            label = int(raw)
        elif not tsv and type(raw) is int:
            label = raw
        if label is not None and not 0 <= label < task.num_labels:
            label = None
    if label is None:
        where = f"column {task.label!r}" if tsv else f"field {task.label!r}"
        raise _bad(path, n, row.line, f"label {_shown(raw, tsv)}", f"{expected} ({keys})", f", {where}")
    return label


def _text(path: Path, n: int, row: _Row, key: str, config_key: str, tsv: bool) -> str:
    value = row.fields[key]
    kind = "column" if tsv else "field"
    if not isinstance(value, str):
        raise _bad(path, n, row.line, f"text {_shown(value, tsv)}", f"a JSON string ({config_key})",
                   f", {kind} {key!r}")
    _check_size(path, n, row, kind, key, value)
    return value


def _file_examples(path: Path, task: TaskConfig, start: int) -> list[Example]:
    out = []
    tsv = path.name.removesuffix(".gz").endswith(".tsv")
    keys = {"task.text_a": task.text_a, "task.text_b": task.text_b, "task.label": task.label}
    for n, row in enumerate(_read_rows(path), 1):
        for config_key, key in keys.items():
            if key and key not in row.fields:
                if tsv:
                    raise ConfigError(f"{path}: the header (line 1) has no field {key!r} ({config_key}); its "
                                      f"columns: {_shown(', '.join(row.fields), True)}")
                raise _bad(path, n, row.line, f"no field {key!r}", f"the field {config_key} names")
        label = _label(path, n, row, task, tsv)
        text_a = _text(path, n, row, task.text_a, "task.text_a", tsv)
        text_b = _text(path, n, row, task.text_b, "task.text_b", tsv) if task.text_b else None
        out.append(Example(start + n - 1, text_a, text_b, label))
    return out


def load_split(task: TaskConfig, split: str) -> list[Example]:
    """The `train` or `dev` examples of the configured task, truncated by `max_*_examples` if set.

    Loading one split never parses the other's file (a `files` task's dev indices start after the
    train rows, so dev counts the train file's rows), which lets fine-tuning choose its learning
    rate before dev is read at all.
    """
    if task.name in ("rt", "rt_score"):
        expected = 1 if task.name == "rt_score" else 2
        if task.num_labels != expected:
            raise ConfigError(f"task.num_labels: task {task.name} has {expected}, got {task.num_labels}")
        train, dev = _rt_examples(regression=task.name == "rt_score")
    elif task.name == "corpus_pairs":
        if task.num_labels != 2:
            raise ConfigError(f"task.num_labels: task corpus_pairs has 2, got {task.num_labels}")
        train, dev = _corpus_pair_examples()
    elif split == "train":
        train, dev = _file_examples(Path(task.train), task, 0), []
    else:
        train, dev = [], _file_examples(Path(task.dev), task, len(_read_rows(Path(task.train))))
    examples = train if split == "train" else dev
    limit = task.max_train_examples if split == "train" else task.max_dev_examples
    if limit:
        examples = _spread(examples, limit)
    if not examples:
        raise ConfigError(f"task {task.name}: the {split} split is empty")
    return examples


def _spread(examples: list[Example], n: int) -> list[Example]:
    """A deterministic subset of `n` examples spread over the whole list (not its head: files are often sorted)."""
    if n >= len(examples):
        return examples
    return [examples[i * len(examples) // n] for i in range(n)]


def encode_examples(examples: list[Example], tokenizer: Tokenizer, max_seq_len: int) -> list[tuple[list[int], int]]:
    """[CLS] a [SEP] (b [SEP]) ids and the length of the first segment (with [CLS] and its [SEP]).

    Pairs longer than `max_seq_len` are cut longest-first, as HF's `truncation=True` does.
    """
    a_ids = tokenizer.encode_batch([e.text_a for e in examples])
    b_ids = tokenizer.encode_batch([e.text_b or "" for e in examples])
    out = []
    for e, a, b in zip(examples, a_ids, b_ids):
        if e.text_b is None:
            a = a[: max_seq_len - 2]
            out.append(([tokenizer.cls_id, *a, tokenizer.sep_id], len(a) + 2))
            continue
        a, b = list(a), list(b)
        while len(a) + len(b) > max_seq_len - 3:
            (a if len(a) >= len(b) else b).pop()
        out.append(([tokenizer.cls_id, *a, tokenizer.sep_id, *b, tokenizer.sep_id], len(a) + 2))
    return out


class EncodedTask:
    """Token ids, segment lengths, labels and stable indices of one split, batched on demand."""

    def __init__(self, examples: list[Example], tokenizer: Tokenizer, max_seq_len: int, regression: bool):
        self.examples = examples
        self.encoded = encode_examples(examples, tokenizer, max_seq_len)
        self.labels = torch.tensor([e.label for e in examples], dtype=torch.float32 if regression else torch.long)
        self.indices = torch.tensor([e.index for e in examples], dtype=torch.long)
        self.pad_id = tokenizer.pad_id

    def __len__(self) -> int:
        return len(self.examples)

    def subset(self, rows: list[int]) -> EncodedTask:
        """The examples at `rows`, in that order (sharing the encoding: nothing is re-tokenized)."""
        out = object.__new__(EncodedTask)
        out.examples = [self.examples[r] for r in rows]
        out.encoded = [self.encoded[r] for r in rows]
        out.labels, out.indices, out.pad_id = self.labels[rows], self.indices[rows], self.pad_id
        return out

    def batch(self, rows: list[int] | torch.Tensor) -> dict[str, torch.Tensor]:
        """Padded to the longest row of the batch: input_ids, attention_mask, token_type_ids, labels, index."""
        rows = [int(r) for r in rows]
        length = max(len(self.encoded[r][0]) for r in rows)
        ids = torch.full((len(rows), length), self.pad_id, dtype=torch.long)
        types = torch.zeros((len(rows), length), dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        for b, r in enumerate(rows):
            seq, first = self.encoded[r]
            ids[b, : len(seq)] = torch.tensor(seq)
            mask[b, : len(seq)] = 1
            types[b, first: len(seq)] = 1
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types,
                "labels": self.labels[rows], "index": self.indices[rows]}
