"""`megakd glue`: a model over the GLUE tasks with the papers' protocol, as a layer over `megakd finetune`.

Every task is a fine-tuning run (`megakd.finetune.trainer.run_seeds`) in `run.dir/<task>/`, its seeds
in `seed_<s>/`, in the run shell as a fine-tuning job (`megakd.finetune.jobs.FinetuneJob`). After a
task's seeds, this module scores each seed's dev predictions with the task's official metrics (MNLI:
matched from the training's own evaluation, mismatched predicted by the seed's saved model), writes
`<task>/task.json` (per seed, per metric; mean ± std and median), and predicts the test split(s) with
the seed whose task score is the median (the lower one for an even count) into `submission/<Task>.tsv`.
A finished task is reused by `--resume auto`; an unfinished one resumes per seed (fine-tuning's
checkpoints). At the end: `results.json`, `results.md` and `submission.zip`.

The log says the plan first (tasks, runs, optimizer steps: every train split is read once more for its
size), then at each run's start which task of how many and which run of how many it is, and the time
the runs left will take (`megakd.finetune.progress.Trainings`).
"""

from __future__ import annotations

import json
import logging
import zipfile
from pathlib import Path

import numpy as np

from megakd.configio import ConfigError
from megakd.data.tasks import EncodedTask, Example, _spread
from megakd.engine.run import Outcome, run_job
from megakd.finetune.config import LabelregConfig, ModelInitConfig
from megakd.finetune.jobs import FinetuneJob
from megakd.finetune.models import load_pretrained
from megakd.finetune.objectives import LabelregObjective
from megakd.finetune.predict import predict
from megakd.finetune.progress import Trainings, planned_steps
from megakd.finetune.runtime import Runtime
from megakd.finetune.scores import mean_std_record
from megakd.finetune.trainer import model_max_len, run_seeds
from megakd.finetune.training import SeedResult
from megakd.glue.config import GlueConfig, electra_lr
from megakd.glue.metrics import electra_score, glue_score, predictions, split_metrics, task_score
from megakd.glue.tasks import AX, TASKS, GlueTask, read_split, split_source
from megakd.launch import Launch
from megakd.store import check_source
from megakd.store.model_dir import load_classifier

log = logging.getLogger(__name__)

TASK_FILE = "task.json"  # written last: a task directory with it is finished
SUBMISSION_DIR = "submission"
SUBMISSION_ZIP = "submission.zip"
# What `--resume auto` may change: the task list (finished tasks are reused, new ones trained, dropped ones left
# on disk but out of results.json) and whether the test set is predicted (a finished task keeps what it wrote).
RESUMABLE_CHANGES = ("glue.tasks", "glue.submission")
SERVER_FILES = [stem for t in (*TASKS.values(), AX) for stem in t.submission]  # what the GLUE server expects


def check_data(cfg: GlueConfig) -> None:
    """The model source exists and every split the run will read exists and parses (one line naming the first
    file and row that do not), before run.dir is touched: a bad row in the last task's file would otherwise
    stop the run after the other tasks trained. Reading GLUE's files takes seconds, training them hours."""
    if cfg.model.path:
        check_source(cfg.model.path, "model.path")
    for task in cfg.task_list:
        for split in ("train", *task.dev_splits, *(task.test_splits if cfg.glue.submission else ())):
            read_split(cfg.glue.data_dir, task, split)


def glue(cfg: GlueConfig, resume: str | None = None, launch: Launch | None = None) -> Outcome:
    """`megakd glue`: the data checked before run.dir is touched, then every task in the run shell."""
    check_data(cfg)
    return run_job(FinetuneJob(cfg, launch or Launch.from_environ(), run_glue, steering=RESUMABLE_CHANGES, name="GLUE"),
                   resume)


def peak_lr(cfg: GlueConfig) -> float | list[float]:
    """`glue.lr` as fine-tuning's `finetune.lr`: `electra` becomes ELECTRA's rate for the model's width."""
    if cfg.glue.lr != "electra":
        return cfg.glue.lr
    m = cfg.model
    hidden = load_pretrained(m.path, m.tokenizer).config.hidden_size if m.path else m.encoder.hidden_size
    return electra_lr(hidden)


def run_glue(cfg: GlueConfig, runtime: Runtime) -> dict:
    """Every task of `glue.tasks` (MNLI first when others start from it); the results record. `glue` has run
    `check_data` before the run opened."""
    lr = peak_lr(cfg)
    tasks = cfg.task_list
    plan = {task.name: planned_steps(len(_limited(cfg, task, "train")), cfg.task_config(task, cfg.model, lr).finetune,
                                     len(lr) if isinstance(lr, list) else 1) for task in tasks}
    runs = Trainings([steps for task in plan.values() for steps in task])
    log.info("GLUE: %d tasks (%s), %d fine-tuning runs, %d optimizer steps in all", len(tasks), ", ".join(plan),
             runs.count, runs.left)
    records: dict[str, dict] = {}
    for number, task in enumerate(tasks, 1):
        runs.where = f"task {number} of {len(tasks)}"
        init = cfg.model
        if task.name in cfg.glue.from_mnli:
            init = ModelInitConfig(path=records["mnli"]["submission_model"])
            log.info("%s starts from MNLI's fine-tuned encoder %s", task.name, init.path)
        records[task.name] = run_task(cfg, task, init, lr, runtime, runs, plan[task.name])
    results = summarize(cfg, records)
    if runtime.is_main:
        write_results(runtime.run_dir, results)
        if cfg.glue.submission:
            zip_submission(runtime.run_dir)
    runtime.barrier()
    return results


def _limited(cfg: GlueConfig, task: GlueTask, split: str) -> list[Example]:
    examples = read_split(cfg.glue.data_dir, task, split)
    limit = cfg.glue.max_train_examples if split == "train" else cfg.glue.max_dev_examples
    return _spread(examples, limit) if limit and not split.startswith("test") else examples


def run_task(cfg: GlueConfig, task: GlueTask, init: ModelInitConfig, lr: float | list[float],
             runtime: Runtime, runs: Trainings, planned: list[int]) -> dict:
    """One task: its seeds (fine-tuning), their official dev metrics, the median seed's test predictions.
    `runs` counts its trainings (`planned`: their steps) among the command's."""
    task_dir = runtime.run_dir / task.name
    done = task_dir / TASK_FILE
    if runtime.resume and done.is_file():
        log.info("%s: finished before, reusing %s", task.name, done)
        runs.reused(*planned)
        return json.loads(done.read_text())
    tcfg = cfg.task_config(task, init, lr)
    splits = {"train": "train", "dev": task.dev_splits[0]}
    results, _, dev, lr_record = run_seeds(
        tcfg, task_dir, init, lambda *_: LabelregObjective(LabelregConfig(), task.num_labels), runtime,
        read_split=lambda split: _limited(cfg, task, splits[split]), name=task.name, runs=runs)
    other_dev = task.dev_splits[1:]
    per_seed = []
    for r in results:
        metrics = split_metrics(task, r.dev_logits, dev.labels.numpy(), "_m" if other_dev else "")
        if other_dev:
            model, encoded = _seed_model(r, cfg, task, other_dev, runtime)
            metrics.update(split_metrics(task, predict(model, encoded[0], cfg.finetune.eval_batch_size, runtime),
                                         encoded[0].labels.numpy(), "_mm"))
        per_seed.append(metrics)
    scores = [task_score(task, m) for m in per_seed]
    chosen = results[_median_position(scores)]
    record = {
        "task": task.name, "seeds": [r.seed for r in results], "epochs": tcfg.finetune.epochs, "init": init.path,
        "lr": lr_record, "dev_examples": len(dev),
        "metrics": {k: _stats([m[k] for m in per_seed]) for k in task.metrics},
        "score": _stats(scores), "per_seed": {str(r.seed): m for r, m in zip(results, per_seed)},
        "submission_seed": chosen.seed, "submission_model": str(chosen.model_dir),
    }
    if cfg.glue.submission:
        record["test_predictions"] = write_test_predictions(cfg, task, chosen, runtime)
    if runtime.is_main:
        tmp = task_dir / f".{TASK_FILE}.tmp"
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        tmp.replace(done)
    runtime.barrier()
    log.info("%s: score %.2f (median over seeds %s)", task.name, 100 * record["score"]["median"], record["seeds"])
    return record


def _seed_model(result: SeedResult, cfg: GlueConfig, task: GlueTask, splits, runtime: Runtime):
    """A seed's saved classifier on this rank's device, and `splits` (with labels or not) encoded for it."""
    model, tokenizer = load_classifier(result.model_dir)
    model.to(runtime.device)
    c = model.config
    max_len = model_max_len(cfg.finetune.max_seq_len, c.max_position_embeddings, c.position_encoding)
    return model, [EncodedTask(_limited(cfg, task, s), tokenizer, max_len, task.regression) for s in splits]


def _median_position(scores: list[float]) -> int:
    """The position of the median score (the lower of the two middle ones; ties: the earlier seed)."""
    order = sorted(range(len(scores)), key=lambda i: (scores[i], i))
    return order[(len(scores) - 1) // 2]


def _stats(values: list[float]) -> dict:
    return {**mean_std_record(values), "median": float(np.median(values))}


def write_test_predictions(cfg: GlueConfig, task: GlueTask, chosen: SeedResult, runtime: Runtime) -> dict[str, int]:
    """The chosen seed's predictions on every test split (and, for MNLI, the diagnostic set when the data has it)
    as the server's `<Task>.tsv` files; {file: rows}."""
    targets = [(task, s, stem) for s, stem in zip(task.test_splits, task.submission)]
    if task.name == "mnli":
        try:
            split_source(cfg.glue.data_dir, AX, "test")
            targets.append((AX, "test", "AX"))
        except ConfigError:
            log.warning("glue.data_dir has no diagnostic set (diagnostic/diagnostic.tsv or ax/): the submission "
                        "lacks AX.tsv, which the GLUE server requires")
    written = {}
    for source, split, stem in targets:
        model, (encoded,) = _seed_model(chosen, cfg, source, [split], runtime)
        logits = predict(model, encoded, cfg.finetune.eval_batch_size, runtime)
        if runtime.is_main:
            ids = [e.index for e in encoded.examples]
            written[f"{stem}.tsv"] = write_submission_file(runtime.run_dir / SUBMISSION_DIR / f"{stem}.tsv", source,
                                                           ids, predictions(source, logits))
    return written


def write_submission_file(path: Path, task: GlueTask, ids: list[int], pred: np.ndarray) -> int:
    """`index<TAB>prediction` rows as the GLUE server takes them: label strings for MNLI, QNLI, RTE and AX,
    class ids elsewhere, STS-B's score clipped to [0, 5]; the number of rows."""
    if task.regression:
        shown = [f"{v:.3f}" for v in np.clip(pred, 0.0, 5.0)]
    else:
        shown = [task.labels[int(p)] if task.string_predictions else str(int(p)) for p in pred]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("index\tprediction\n" + "".join(f"{i}\t{p}\n" for i, p in zip(ids, shown)))
    tmp.replace(path)
    return len(ids)


def summarize(cfg: GlueConfig, records: dict[str, dict]) -> dict:
    """results.json's content: every task's record and the averages over seeds' medians and means."""
    averages = {}
    for stat in ("median", "mean"):
        scores = {t: r["score"][stat] for t, r in records.items()}
        metrics = {t: {k: v[stat] for k, v in r["metrics"].items()} for t, r in records.items()}
        averages[stat] = {"glue_score": glue_score(scores), "electra_dev_score": electra_score(metrics)}
    return {"model": cfg.model.path, "data_dir": cfg.glue.data_dir, "tasks": records,
            "complete": set(records) == set(TASKS), "averages": averages,
            "subsets": {"max_train_examples": cfg.glue.max_train_examples,
                        "max_dev_examples": cfg.glue.max_dev_examples}}


def results_table(results: dict) -> str:
    """results.md: one row per task (×100, as the papers print them), then the averages."""
    lines = ["| task | metric | median | mean ± std | per seed |", "|---|---|---|---|---|"]
    for name, r in results["tasks"].items():
        for metric, s in r["metrics"].items():
            seeds = ", ".join(f"{100 * v:.1f}" for v in s["values"])
            lines.append(f"| {name} | {metric} | {100 * s['median']:.1f} | {100 * s['mean']:.1f} ± "
                         f"{100 * s['std']:.1f} | {seeds} |")
    which = "GLUE score (all nine tasks)" if results["complete"] else "average of the tasks run (not the GLUE score)"
    a = results["averages"]
    lines.append(f"| **{which}** | | {100 * a['median']['glue_score']:.1f} | {100 * a['mean']['glue_score']:.1f} | |")
    if a["median"]["electra_dev_score"] is not None:
        lines.append(f"| **ELECTRA's dev average (no WNLI)** | | {100 * a['median']['electra_dev_score']:.1f} | "
                     f"{100 * a['mean']['electra_dev_score']:.1f} | |")
    if any(results["subsets"].values()):
        lines.append(f"\nSubsets of the splits: {results['subsets']} — not comparable with GLUE's numbers.")
    return "\n".join(lines) + "\n"


def write_results(run_dir: Path, results: dict) -> None:
    for name, text in (("results.json", json.dumps(results, indent=2) + "\n"), ("results.md", results_table(results))):
        tmp = run_dir / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(run_dir / name)
    log.info("GLUE results in %s/results.json:\n%s", run_dir, results_table(results))


def zip_submission(run_dir: Path) -> Path:
    """submission.zip: every `<Task>.tsv` at the zip's top level, as the server takes it."""
    files = sorted((run_dir / SUBMISSION_DIR).glob("*.tsv"))
    missing = [stem for stem in SERVER_FILES if not (run_dir / SUBMISSION_DIR / f"{stem}.tsv").is_file()]
    if missing:
        log.warning("submission.zip lacks %s: the GLUE server takes a submission with all %d files",
                    ", ".join(missing), len(SERVER_FILES))
    target = run_dir / SUBMISSION_ZIP
    tmp = run_dir / f".{SUBMISSION_ZIP}.tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for f in files:
            z.write(f, f.name)
    tmp.replace(target)
    return target
