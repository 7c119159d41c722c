"""The nine GLUE tasks and their files, read offline in three layouts (docs/glue.md § Data).

- `glue`: the directory the GLUE download script writes (`glue_data/CoLA/train.tsv`, ...): tab-separated,
  no quoting, a header row (CoLA's train and dev have none: four columns, source, label, original label,
  sentence), columns found by their header names; MNLI has `dev_matched`/`dev_mismatched` and
  `test_matched`/`test_mismatched`; test files carry an `index` (QQP: `id`) column and no label.
- `disk`: `DIR/<task>/` written by `datasets`' `save_to_disk` (a DatasetDict: train, validation, test;
  MNLI validation_matched, ...), integer class labels in HF's order, -1 on test.
- `parquet`: the hub's layout of the GLUE dataset, `DIR/<task>/<split>-NNNNN-of-NNNNN.parquet`.

Class ids follow HF's order in every layout, so a label read from any layout means the same class;
`GlueTask.labels` holds the strings the GLUE files (and the submission server) use for those ids.
A test example's `index` is the file's id column (what the submission names), a labelled example's
its row (0-based); test labels are 0 (unused).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from megakd.configio import ConfigError
from megakd.data.tasks import Example, _bad, _lines, _read_rows, _Row

LABEL_SPLITS = ("train", "dev", "dev_matched", "dev_mismatched")


@dataclass(frozen=True)
class GlueTask:
    name: str  # megakd's and HF's name: cola, sst2, ...
    glue_dir: str  # its folder in glue_data/
    text_a: str  # the GLUE file's column of the first text
    text_b: str | None  # ... of the second (None: single-sentence task)
    label: str  # ... of the label (CoLA: the second of its four headerless columns)
    labels: tuple[str, ...]  # the GLUE files' label strings in class-id order; () = regression (STS-B)
    metrics: tuple[str, ...]  # the official dev metrics; the task's score is their mean
    hf_text: tuple[str, str | None]  # the datasets columns of the two texts
    submission: tuple[str, ...]  # the server's file stem per test split (MNLI-m, MNLI-mm)
    string_predictions: bool = False  # the server takes label strings (MNLI, QNLI, RTE), not class ids
    test_id: str = "index"  # the test file's id column

    @property
    def num_labels(self) -> int:
        return len(self.labels) or 1

    @property
    def regression(self) -> bool:
        return not self.labels

    @property
    def dev_splits(self) -> tuple[str, ...]:
        return ("dev_matched", "dev_mismatched") if self.name == "mnli" else ("dev",)

    @property
    def test_splits(self) -> tuple[str, ...]:
        return ("test_matched", "test_mismatched") if self.name == "mnli" else ("test",)


BINARY = ("0", "1")
NLI2 = ("entailment", "not_entailment")
TASKS: dict[str, GlueTask] = {t.name: t for t in (
    GlueTask("cola", "CoLA", "sentence", None, "label", BINARY, ("mcc",), ("sentence", None), ("CoLA",)),
    GlueTask("sst2", "SST-2", "sentence", None, "label", BINARY, ("accuracy",), ("sentence", None), ("SST-2",)),
    GlueTask("mrpc", "MRPC", "#1 String", "#2 String", "Quality", BINARY, ("f1", "accuracy"),
             ("sentence1", "sentence2"), ("MRPC",)),
    GlueTask("stsb", "STS-B", "sentence1", "sentence2", "score", (), ("pearson", "spearman"),
             ("sentence1", "sentence2"), ("STS-B",)),
    GlueTask("qqp", "QQP", "question1", "question2", "is_duplicate", BINARY, ("f1", "accuracy"),
             ("question1", "question2"), ("QQP",), test_id="id"),
    GlueTask("mnli", "MNLI", "sentence1", "sentence2", "gold_label", ("entailment", "neutral", "contradiction"),
             ("accuracy_m", "accuracy_mm"), ("premise", "hypothesis"), ("MNLI-m", "MNLI-mm"), string_predictions=True),
    GlueTask("qnli", "QNLI", "question", "sentence", "label", NLI2, ("accuracy",), ("question", "sentence"),
             ("QNLI",), string_predictions=True),
    GlueTask("rte", "RTE", "sentence1", "sentence2", "label", NLI2, ("accuracy",), ("sentence1", "sentence2"),
             ("RTE",), string_predictions=True),
    GlueTask("wnli", "WNLI", "sentence1", "sentence2", "label", BINARY, ("accuracy",), ("sentence1", "sentence2"),
             ("WNLI",)),
)}
# The diagnostic set: MNLI's classes, predicted by the MNLI model; the server wants AX.tsv beside the tasks.
AX = GlueTask("ax", "diagnostic", "sentence1", "sentence2", "label", TASKS["mnli"].labels, (),
              ("premise", "hypothesis"), ("AX",), string_predictions=True)
COLA_COLUMNS = ("source", "label", "original_label", "sentence")  # CoLA's headerless train and dev files
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,4})?")
_ID = re.compile(r"[0-9]{1,18}")


def task_named(name: str, key: str = "glue.tasks") -> GlueTask:
    if name not in TASKS:
        raise ConfigError(f"{key}: unknown GLUE task {name!r}; expected some of {', '.join(TASKS)}")
    return TASKS[name]


def detect_layout(data_dir: Path, task: GlueTask) -> tuple[str, Path]:
    """(layout, the task's directory) of `task` under `data_dir`; one line naming what was looked for if absent."""
    if task.name == "ax":
        candidates = [("glue", data_dir / "diagnostic"), ("disk", data_dir / "ax"), ("parquet", data_dir / "ax")]
    else:
        candidates = [("glue", data_dir / task.glue_dir), ("disk", data_dir / task.name),
                      ("parquet", data_dir / task.name)]
    for layout, path in candidates:
        if layout == "glue" and path.is_dir():
            return layout, path
        if layout == "disk" and (path / "dataset_dict.json").is_file():
            return layout, path
        if layout == "parquet" and path.is_dir() and any(path.glob("*.parquet")):
            return layout, path
    glue, hf = candidates[0][1], candidates[1][1]
    raise ConfigError(f"glue.data_dir: no {task.name} data in {data_dir}: expected {glue}/ (the GLUE download "
                      f"script's layout), {hf}/dataset_dict.json (datasets' save_to_disk) or {hf}/*.parquet "
                      "(the hub's layout)")


def split_source(data_dir: str | Path, task: GlueTask, split: str) -> tuple[str, list[Path]]:
    """(layout, the files or directory holding one split); one line naming what is missing if it is absent,
    so a run can check every split it will read before it trains anything."""
    layout, task_dir = detect_layout(Path(data_dir), task)
    if layout == "glue":
        path = task_dir / f"{'diagnostic' if task.name == 'ax' else split}.tsv"
        if not path.is_file():
            raise ConfigError(f"{path}: no such file (the {split} split of {task.glue_dir}; expected the GLUE "
                              "download script's layout)")
        return layout, [path]
    hf_split = _hf_split(task, split)
    if layout == "disk":
        listing = task_dir / "dataset_dict.json"
        try:
            names = json.loads(listing.read_text()).get("splits", [])
        except (OSError, ValueError, AttributeError) as err:
            raise ConfigError(f"{listing}: not a datasets DatasetDict listing ({err})") from None
        if hf_split not in names:
            raise ConfigError(f"{listing}: no split {hf_split!r} (the {split} split of {task.name}); it has "
                              f"{', '.join(map(str, names))}")
        return layout, [task_dir / hf_split]
    files = sorted(task_dir.glob(f"{hf_split}-*.parquet"))
    if not files:
        raise ConfigError(f"{task_dir}: no {hf_split}-*.parquet (the {split} split of {task.name} in the hub's "
                          "layout)")
    return layout, files


def read_split(data_dir: str | Path, task: GlueTask, split: str) -> list[Example]:
    """The examples of one split (`train`, `dev`, `dev_matched`, `test`, ...) of `task` under `data_dir`."""
    layout, source = split_source(data_dir, task, split)
    if layout == "glue":
        return _read_glue(source[0], task, split)
    return _read_hf(source, layout, task, split)


# -- the GLUE download script's files ----------------------------------------------------------------------
def _read_glue(path: Path, task: GlueTask, split: str) -> list[Example]:
    labelled = split in LABEL_SPLITS
    rows = _cola_rows(path) if task.name == "cola" and labelled else _read_rows(path)
    columns = [task.text_a] + ([task.text_b] if task.text_b else []) + [task.label if labelled else task.test_id]
    if rows:
        missing = [c for c in columns if c not in rows[0].fields]
        if missing:
            raise ConfigError(f"{path}: the header (line 1) has no column {missing[0]!r}; expected the GLUE file of "
                              f"{task.glue_dir} {split} (columns {', '.join(map(repr, columns))})")
    out = []
    for n, row in enumerate(rows, 1):
        f = row.fields
        if labelled:
            index, label = n - 1, _glue_label(path, n, row, task)
        else:
            index, label = _test_id(path, n, row, task.test_id), 0
        out.append(Example(index, f[task.text_a], f[task.text_b] if task.text_b else None, label))
    if not out:
        raise ConfigError(f"{path}: no rows (the {split} split of {task.glue_dir})")
    return out


def _cola_rows(path: Path) -> list[_Row]:
    """CoLA's train and dev: no header, four tab-separated columns (source, label, original label, sentence)."""
    rows = []
    for n, line in _lines(path):
        if not line:
            continue
        cells = line.split("\t")
        if len(cells) != len(COLA_COLUMNS):
            raise _bad(path, len(rows) + 1, n, f"{len(cells)} tab-separated cells",
                       "CoLA's 4 headerless columns (source, label, original label, sentence)")
        rows.append(_Row(n, dict(zip(COLA_COLUMNS, cells))))
    return rows


def _glue_label(path: Path, n: int, row: _Row, task: GlueTask) -> int | float:
    raw = row.fields[task.label]
    where = f", column {task.label!r}"
    if task.regression:
        value = float(raw) if _NUMBER.fullmatch(raw) else math.nan
        if not math.isfinite(value):
            raise _bad(path, n, row.line, f"score {raw[:40]!r}", "a finite number (STS-B's 0-5 similarity)", where)
        return value
    if raw not in task.labels:
        raise _bad(path, n, row.line, f"label {raw[:40]!r}", f"one of {', '.join(map(repr, task.labels))}", where)
    return task.labels.index(raw)


def _test_id(path: Path, n: int, row: _Row, column: str) -> int:
    raw = row.fields[column]
    if not _ID.fullmatch(raw):
        raise _bad(path, n, row.line, f"id {raw[:40]!r}", "a non-negative integer (the test file's id)",
                   f", column {column!r}")
    return int(raw)


# -- datasets' save_to_disk and the hub's parquet files ---------------------------------------------------
def _hf_split(task: GlueTask, split: str) -> str:
    return "test" if task.name == "ax" else split.replace("dev", "validation")


def _read_hf(source: list[Path], layout: str, task: GlueTask, split: str) -> list[Example]:
    if layout == "disk":
        try:
            import datasets
        except ImportError:
            raise ConfigError(f"{source[0]}: reading a save_to_disk directory needs the datasets library "
                              "(pip install 'megakd[datasets]')") from None
        rows = datasets.load_from_disk(str(source[0])).to_list()
    else:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(f"{source[0]}: reading parquet files needs pyarrow (pip install 'megakd[datasets]')"
                              ) from None
        rows = [r for f in source for r in pq.read_table(f).to_pylist()]
    source = source[0]
    labelled = split in LABEL_SPLITS
    a, b = task.hf_text
    out = []
    for n, row in enumerate(rows, 1):
        missing = [c for c in (a, b, "label", "idx") if c and c not in row]
        if missing:
            raise ConfigError(f"{source}: row {n}: no column {missing[0]!r}; expected the GLUE {task.name} "
                              f"columns {a!r}{f', {b!r}' if b else ''}, 'label', 'idx'")
        texts = [row[a]] + ([row[b]] if b else [])
        if not all(isinstance(t, str) for t in texts):
            raise ConfigError(f"{source}: row {n}: a text that is not a string (columns {a!r}, {b!r})")
        label = _hf_label(source, n, row["label"], task) if labelled else 0
        index = n - 1 if labelled else row["idx"]
        if not labelled and not (isinstance(index, int) and index >= 0):
            raise ConfigError(f"{source}: row {n}: idx {index!r}: expected a non-negative integer")
        out.append(Example(index, texts[0], texts[1] if b else None, label))
    if not out:
        raise ConfigError(f"{source}: no rows (the {split} split of {task.name})")
    return out


def _hf_label(source: Path, n: int, value, task: GlueTask) -> int | float:
    if task.regression:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        expected = "a finite number (STS-B's 0-5 similarity)"
    else:
        if type(value) is int and 0 <= value < task.num_labels:
            return value
        expected = f"a class id in [0, {task.num_labels}) ({', '.join(task.labels)})"
    raise ConfigError(f"{source}: row {n}: label {value!r}: expected {expected}")
