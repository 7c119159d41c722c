"""Labelled examples for fine-tuning and the pretraining probe: built-in tasks from the bundled corpus, and GLUE-style files.

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
import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from megakd.config import ConfigError, TaskConfig
from megakd.data.default_corpus import CORPUS_DIR, PRETRAINING_FILES, SENTIMENT_FILE
from megakd.data.sources import open_text
from megakd.data.tokenizer import Tokenizer

DEV_BYTE_THRESHOLD = 26  # of 256: ≈ 10% dev
# After . ! ? that ends a word, except the titles Austen abbreviates (Mr. Knightley, Mrs. Weston).
_SENTENCE_END = re.compile(r"(?<!\bMr\.)(?<!\bMrs\.)(?<!\bDr\.)(?<!\bSt\.)(?<=[a-z0-9\"')][.!?])\s+(?=[\"'A-Z])")


@dataclass(frozen=True)
class Example:
    index: int
    text_a: str
    text_b: str | None
    label: float | int


def in_dev(text: str) -> bool:
    """The fixed split rule: sha256 of the text, first byte below DEV_BYTE_THRESHOLD."""
    return hashlib.sha256(text.encode("utf-8")).digest()[0] < DEV_BYTE_THRESHOLD


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


def _read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    name = path.name.removesuffix(".gz")
    with open_text(path) as f:
        if name.endswith(".jsonl"):
            rows = []
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        raise ConfigError(f"{path}:{n}: not valid JSON") from None
            return rows
        if name.endswith(".tsv"):
            return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    raise ConfigError(f"{path}: expected a .tsv, .tsv.gz, .jsonl or .jsonl.gz file")


def _file_examples(path: Path, task: TaskConfig, start: int) -> list[Example]:
    out = []
    for n, row in enumerate(_read_rows(path)):
        for key in filter(None, (task.text_a, task.text_b, task.label)):
            if key not in row:
                raise ConfigError(f"{path}: row {n + 1} has no field {key!r} (task.text_a / text_b / label)")
        raw = row[task.label]
        try:
            if task.num_labels == 1:
                label: float | int = float(raw)
            elif task.labels:
                label = task.labels.index(str(raw))
            else:
                label = int(raw)
                if not 0 <= label < task.num_labels:
                    raise ValueError
        except ValueError:
            expected = task.labels or f"an integer in [0, {task.num_labels})" if task.num_labels > 1 else "a number"
            raise ConfigError(f"{path}: row {n + 1}: label {raw!r}: expected {expected} (task.labels / "
                              "task.num_labels)") from None
        out.append(Example(start + n, str(row[task.text_a]), str(row[task.text_b]) if task.text_b else None, label))
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


def load_task(task: TaskConfig) -> tuple[list[Example], list[Example]]:
    """(train, dev) examples for the configured task (see `load_split`)."""
    return load_split(task, "train"), load_split(task, "dev")


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
