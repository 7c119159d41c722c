"""Small GLUE-format directories from the bundled Rotten Tomatoes sentences, for tests and the CPU example.

    python tools/make_glue_data.py --out glue_data                   # the GLUE download script's layout
    python tools/make_glue_data.py --out glue_hf --layout parquet    # the hub's parquet files per task

Every task gets its real layout (file names, headers, CoLA's headerless files, MNLI's matched and
mismatched splits, test files without labels, the diagnostic set) with stand-in content that a
model can learn: a single-sentence task's label is the sentence's sentiment; a pair task's label
says whether the two sentences share it (MNLI: both positive = entailment, both negative = neutral,
mixed = contradiction); STS-B's score is 5·(1 − |crowd score difference| / 8). The numbers a model
gets on them are not GLUE's (docs/glue.md § What the CPU numbers are).

Three layouts: `glue` (the download script's), `disk` (datasets' save_to_disk per task) and `parquet`
(the hub's files per task). Tests import `write_glue_data` from here (tests/conftest.py puts tools/ on
the path): it is no part of the installed package.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from megakd.config import TaskConfig
from megakd.data.tasks import load_split
from megakd.glue.tasks import AX, TASKS, GlueTask

# The GLUE files' headers (CoLA's train and dev have none); test files drop the label and keep the id.
HEADERS = {
    "sst2": ["sentence", "label"],
    "mrpc": ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
    "stsb": ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2",
             "score"],
    "qqp": ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
    "mnli": ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
             "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label"],
    "qnli": ["index", "question", "sentence", "label"],
    "rte": ["index", "sentence1", "sentence2", "label"],
    "wnli": ["index", "sentence1", "sentence2", "label"],
}
TEST_HEADERS = {"cola": ["index", "sentence"], "sst2": ["index", "sentence"],
                "mrpc": ["index", "#1 ID", "#2 ID", "#1 String", "#2 String"],
                "qqp": ["id", "question1", "question2"], "qnli": ["index", "question", "sentence"]}
MNLI_DEV_EXTRA = ["label2", "label3", "label4", "label5"]  # MNLI's dev files carry five annotators' labels


def _sentences() -> list[tuple[str, int, float]]:
    """(sentence, sentiment 0/1, crowd score) of the bundled train split, in file order."""
    labels = load_split(TaskConfig(name="rt"), "train")
    scores = load_split(TaskConfig(name="rt_score", num_labels=1), "train")
    return [(a.text_a.replace("\t", " "), int(a.label), float(b.label)) for a, b in zip(labels, scores)]


def _examples(task: GlueTask, pool: list[tuple[str, int, float]], n: int, rng: random.Random
              ) -> list[tuple[str, str | None, int | float]]:
    out = []
    for _ in range(n):
        a, b = rng.choice(pool), rng.choice(pool)
        if task.text_b is None:
            out.append((a[0], None, a[1]))
        elif task.regression:
            out.append((a[0], b[0], round(5 * (1 - abs(a[2] - b[2]) / 8), 3)))
        elif task.num_labels == 3:
            out.append((a[0], b[0], 0 if a[1] == b[1] == 1 else 1 if a[1] == b[1] == 0 else 2))
        else:
            same = int(a[1] == b[1])
            out.append((a[0], b[0], same if task.labels == ("0", "1") else 1 - same))  # NLI2: 0 = entailment
    return out


def _glue_rows(task: GlueTask, split: str, examples) -> tuple[list[str] | None, list[list[str]]]:
    """(header or None, rows) of one GLUE file."""
    labelled = not split.startswith("test")
    if task.name == "cola" and labelled:
        return None, [["gj04", str(y), "" if y else "*", a] for a, _, y in examples]
    if task.name == "ax":
        return ["index", "sentence1", "sentence2"], [[str(i), a, b] for i, (a, b, _) in enumerate(examples)]
    header = list(HEADERS[task.name]) if labelled else TEST_HEADERS.get(task.name) or [
        c for c in HEADERS[task.name] if c not in (task.label, "label1")]
    if task.name == "mnli" and split.startswith("dev"):
        header[-1:-1] = MNLI_DEV_EXTRA
    rows = []
    for i, (a, b, y) in enumerate(examples):
        cells = {c: str(i) for c in header}  # ids, indices and the columns no reader uses
        cells.update({task.text_a: a, **({task.text_b: b} if task.text_b else {})})
        if labelled:
            label = str(y) if task.regression else task.labels[y]
            cells.update({task.label: label, **{c: label for c in ["label1", *MNLI_DEV_EXTRA] if c in cells}})
        if task.name == "mnli":
            cells["genre"] = "fiction" if split.endswith("_matched") or split == "train" else "letters"
        rows.append([cells[c] for c in header])
    return header, rows


def _write_tsv(path: Path, header: list[str] | None, rows: list[list[str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ([header] if header else []) + rows
    path.write_text("".join("\t".join(r) + "\n" for r in lines), encoding="utf-8")


def _hf_columns(task: GlueTask, split: str, examples) -> dict[str, list]:
    a, b = task.hf_text
    labelled = not split.startswith("test")
    columns = {a: [e[0] for e in examples], **({b: [e[1] for e in examples]} if b else {}),
               "label": [e[2] if labelled else (-1.0 if task.regression else -1) for e in examples],
               "idx": list(range(len(examples)))}
    return columns


def _hf_features(task: GlueTask):
    import datasets

    a, b = task.hf_text
    label = datasets.Value("float32") if task.regression else datasets.ClassLabel(names=[
        {"0": "negative", "1": "positive"}.get(x, x) for x in task.labels])
    return datasets.Features({a: datasets.Value("string"), **({b: datasets.Value("string")} if b else {}),
                              "label": label, "idx": datasets.Value("int32")})


def write_glue_data(out: str | Path, layout: str = "glue", tasks: list[str] | None = None, train: int = 64,
                    dev: int = 32, test: int = 16, seed: int = 0) -> Path:
    """A GLUE directory at `out` in `layout` (glue, disk, parquet) with `train`/`dev`/`test` examples per split
    (the diagnostic set too when MNLI is written). Deterministic for a seed."""
    out = Path(out)
    pool = _sentences()
    names = tasks or list(TASKS)
    specs = [TASKS[t] for t in names] + ([AX] if "mnli" in names else [])
    for task in specs:
        rng = random.Random(f"{seed}:{task.name}")
        sizes = {"train": train, **{s: dev for s in task.dev_splits}, **{s: test for s in task.test_splits}}
        if task is AX:
            sizes = {"test": test}
        splits = {s: _examples(task, pool, n, rng) for s, n in sizes.items()}
        if layout == "glue":
            for split, examples in splits.items():
                name = "diagnostic" if task is AX else split
                _write_tsv(out / task.glue_dir / f"{name}.tsv", *_glue_rows(task, split, examples))
            continue
        import datasets

        datasets.disable_progress_bars()
        hf = {("validation" + s[3:] if s.startswith("dev") else s): datasets.Dataset.from_dict(
            _hf_columns(task, s, e), features=_hf_features(task)) for s, e in splits.items()}
        target = out / task.name
        if layout == "disk":
            datasets.DatasetDict(hf).save_to_disk(str(target))
        elif layout == "parquet":
            target.mkdir(parents=True, exist_ok=True)
            for split, ds in hf.items():
                ds.to_parquet(str(target / f"{split}-00000-of-00001.parquet"))
        else:
            raise ValueError(f"layout: expected glue, disk or parquet, got {layout!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the directory to write (glue.data_dir)")
    parser.add_argument("--layout", choices=["glue", "disk", "parquet"], default="glue",
                        help="glue: glue_data/CoLA/train.tsv ...; disk: datasets' save_to_disk; parquet: the hub's")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated GLUE tasks")
    parser.add_argument("--train", type=int, default=512, help="train examples per task")
    parser.add_argument("--dev", type=int, default=256, help="examples per dev split")
    parser.add_argument("--test", type=int, default=128, help="examples per test split")
    args = parser.parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    if unknown := [t for t in tasks if t not in TASKS]:
        parser.error(f"--tasks: unknown {unknown[0]!r}; expected some of {', '.join(TASKS)}")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out}: not empty; choose a new directory")
    write_glue_data(args.out, args.layout, tasks, args.train, args.dev, args.test)
    print(f"wrote {', '.join(tasks)} to {args.out} ({args.layout} layout)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
