"""A fine-tuning job (docs/methods.md § Fine-tuning): its learning rate, every seed's training, the summary.

Learning rate: `finetune.lr` is a rate, `auto` (a rate from the encoder's width, see `auto_lr`),
or a list of rates. A list is decided before dev is read: every candidate trains the first seed
on the training split minus a fixed held-out slice (`finetune.lr_select_frac` of it, chosen by a
permutation seeded with 0), the candidate with the best headline metric on that slice wins (ties:
the earlier candidate), and every seed then trains with it on the full training split. All
candidates' slice scores go to `summary.json`. Under data parallelism every rank trains every
trial together and takes rank 0's scores, so all ranks choose the same rate.

Each seed and trial is one training (megakd/finetune/training.py) with a pluggable objective
(megakd/finetune/objectives.py); megakd/finetune/progress.py counts them for the progress lines.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from megakd.config import ConfigError
from megakd.data.tasks import EncodedTask, Example, load_split
from megakd.data.tokenizer import Tokenizer
from megakd.finetune.config import FinetuneConfig, ModelInitConfig
from megakd.finetune.lr_select import candidate_lrs, selection_rows
from megakd.finetune.models import Pretrained, build_classifier, load_pretrained
from megakd.finetune.objectives import LabelregObjective, Objective, ObjectiveFactory, teacher_logits_for
from megakd.finetune.progress import Trainings, planned_steps, training_steps
from megakd.finetune.runtime import Runtime
from megakd.finetune.scores import mean_std_record
from megakd.finetune.training import SeedResult, finished_result, train_seed
from megakd.models.electra import SequenceClassifier
from megakd.objectives.labelreg import TEACHER_TARGETS
from megakd.store.model_dir import load_classifier

log = logging.getLogger(__name__)


def run_seeds(cfg: FinetuneConfig, run_dir: Path, init: ModelInitConfig, make_objective: ObjectiveFactory,
              runtime: Runtime, read_split: Callable[[str], list[Example]] | None = None, name: str = "",
              runs: Trainings | None = None) -> tuple[list[SeedResult], EncodedTask, EncodedTask, dict]:
    """Every seed of `finetune.seeds` into `run_dir/seed_<s>/`.

    Returns the results, the encoded splits and the LR record (`lr_record`). The dev split is read
    only after the learning rate is fixed. `read_split` ("train" or "dev" → examples) replaces
    `load_split(cfg.task, ...)` for callers with their own files (megakd/glue). `name` begins the log
    lines ("" = `task.name`); `runs` counts the trainings in a larger plan (default: these alone).
    """
    read = read_split or (lambda split: load_split(cfg.task, split))
    run_dir.mkdir(parents=True, exist_ok=True)
    train_ex = read("train")
    pretrained: Pretrained | None = load_pretrained(init.path, init.tokenizer) if init.path else None
    tokenizer = pretrained.tokenizer if pretrained else Tokenizer.load(init.tokenizer)
    encoder = pretrained.config if pretrained else init.encoder
    max_len = model_max_len(cfg.finetune.max_seq_len, encoder.max_position_embeddings, encoder.position_encoding)
    regression = cfg.task.num_labels == 1
    train = EncodedTask(train_ex, tokenizer, max_len, regression)
    name = name or cfg.task.name
    log.info("task %s: %d train examples; init %s (%s)", name, len(train), init.path or "random", init.init)
    candidates = candidate_lrs(cfg.finetune.lr, encoder.hidden_size)
    runs = runs or Trainings(planned_steps(len(train), cfg.finetune, len(candidates)))
    record = {"setting": cfg.finetune.lr, "candidates": candidates, "lr": candidates[0]}
    if len(candidates) > 1:
        record = select_lr(cfg, run_dir / "lr_select", init, pretrained, train, make_objective, candidates, runtime,
                           name, runs)
    dev = EncodedTask(read("dev"), tokenizer, max_len, regression)
    log.info("task %s: %d dev examples; lr %g", name, len(dev), record["lr"])
    results = []
    for seed in cfg.finetune.seeds:
        seed_dir = run_dir / f"seed_{seed}"
        done = finished_result(seed_dir, seed, "dev", runtime)
        if done is not None:
            runs.reused(training_steps(len(train), cfg.finetune))
            results.append(done)
            continue
        model, tokenizer = build_classifier(init, cfg.task.num_labels, cfg.finetune.dropout, seed,
                                            pretrained)
        results.append(train_seed(cfg, seed, model, tokenizer, train, dev,
                                  make_objective(seed, model, tokenizer, train, seed_dir), seed_dir, lr=record["lr"],
                                  runtime=runtime, label=f"{name} seed {seed}", runs=runs))
    return results, train, dev, record


def model_max_len(max_seq_len: int, max_position_embeddings: int, position_encoding: str) -> int:
    """`finetune.max_seq_len`, capped by the encoder's position table (said once, as HF's `model_max_length`)."""
    if position_encoding != "absolute" or max_seq_len <= max_position_embeddings:
        return max_seq_len
    log.warning("finetune.max_seq_len=%d exceeds the model's max_position_embeddings=%d: inputs are truncated "
                "to %d tokens", max_seq_len, max_position_embeddings, max_position_embeddings)
    return max_position_embeddings


def select_lr(cfg: FinetuneConfig, out_dir: Path, init: ModelInitConfig, pretrained: Pretrained | None,
              train: EncodedTask, make_objective: ObjectiveFactory, candidates: list[float], runtime: Runtime,
              name: str, runs: Trainings) -> dict:
    """Train the first seed at every candidate on train minus a held-out slice; the best slice score wins."""
    if len(train) < 2:
        raise ConfigError(f"finetune.lr: choosing among {candidates} needs at least 2 train examples")
    fit_rows, held_rows = selection_rows(len(train), cfg.finetune.lr_select_frac)
    fit, held = train.subset(fit_rows), train.subset(held_rows)
    seed, metric = cfg.finetune.seeds[0], cfg.metric
    scores = []
    for lr in candidates:
        trial_dir = out_dir / f"lr_{lr:g}"
        result = finished_result(trial_dir, seed, "slice", runtime)
        if result is not None:
            runs.reused(training_steps(len(fit), cfg.finetune))
        else:
            model, tokenizer = build_classifier(init, cfg.task.num_labels, cfg.finetune.dropout, seed, pretrained)
            objective = make_objective(seed, model, tokenizer, fit, trial_dir)
            result = train_seed(cfg, seed, model, tokenizer, fit, held, objective, trial_dir, lr=lr,
                                eval_split="slice", runtime=runtime, label=f"{name} seed {seed} lr {lr:g} trial",
                                runs=runs)
        scores.append(result.metrics[metric])
    # Rank 0's scores decide on every rank (they agree already: the same weights predict the same slice).
    mine = torch.tensor(scores if runtime.is_main else [0.0] * len(scores), dtype=torch.float64)
    scores = runtime.sum(mine).tolist()
    best = max(range(len(candidates)), key=lambda i: (scores[i], -i))  # ties: the earlier candidate
    log.info("finetune.lr: %s on a held-out slice of %d train examples (seed %d): %s; using %g", metric, len(held),
             seed, ", ".join(f"{lr:g} → {v:.4f}" for lr, v in zip(candidates, scores)), candidates[best])
    return {"setting": cfg.finetune.lr, "candidates": candidates, "lr": candidates[best],
            "selection": {"metric": metric, "seed": seed, "fit_examples": len(fit), "slice_examples": len(held),
                          "slice_scores": dict(zip((f"{lr:g}" for lr in candidates), scores)),
                          "then": "every seed retrains on the full train split with the chosen lr"}}


def summarize(results: list[SeedResult], run_dir: Path, headline: str,
              extra: dict[str, list[float]] | None = None, lr_record: dict | None = None, write: bool = True) -> dict:
    """summary.json (mean ± std over seeds of every dev metric and `extra`, the LR record, the per-epoch
    dev curve of every seed) and summary.md (a table); `write=False` (ranks other than 0) only returns it."""
    columns: dict[str, list[float]] = {}
    for r in results:
        for k, v in r.metrics.items():
            columns.setdefault(k, []).append(v)
    columns.update(extra or {})
    summary = {"seeds": [r.seed for r in results], "headline": headline,
               "metrics": {k: mean_std_record(v) for k, v in columns.items()},
               **({"lr": lr_record} if lr_record else {}),
               "dev_curve": {str(r.seed): r.curve for r in results}}
    if not write:
        return summary
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = ["| metric | mean ± std | per seed |", "|---|---|---|"]
    for k, s in summary["metrics"].items():
        lines.append(f"| {k} | {s['mean']:.4f} ± {s['std']:.4f} | {', '.join(f'{v:.4f}' for v in s['values'])} |")
    table = "\n".join(lines)
    if lr_record:
        table += f"\n\nlearning rate {lr_record['lr']:g} (finetune.lr: {lr_record['setting']})"
    (run_dir / "summary.md").write_text(table + "\n")
    log.info("%s over seeds %s:\n%s", run_dir, summary["seeds"], table)
    return summary


def run_finetune(cfg: FinetuneConfig, runtime: Runtime) -> dict:
    """`megakd finetune` without SoTeacher/TGT: plain fine-tuning or a label-regularisation target."""
    run_dir = runtime.run_dir
    lr = cfg.labelreg
    # The teacher is frozen: predict once per train set (the full split, and the LR-selection fit rows).
    teacher_logits: dict[EncodedTask, Tensor] = {}

    def make_objective(seed: int, model: SequenceClassifier, tokenizer: Tokenizer, train: EncodedTask,
                       out_dir: Path) -> Objective:
        if lr.target in TEACHER_TARGETS and train not in teacher_logits:
            teacher_logits[train] = teacher_logits_for(lr.teacher, "labelreg.teacher", tokenizer, train,
                                                       cfg.task.num_labels, cfg.finetune.eval_batch_size, runtime)
            if lr.target == "selfkd":
                check_same_architecture(model, lr.teacher)
        return LabelregObjective(lr, cfg.task.num_labels, teacher_logits.get(train))

    results, _, _, lr_record = run_seeds(cfg, run_dir, cfg.model, make_objective, runtime)
    return summarize(results, run_dir, cfg.metric, lr_record=lr_record, write=runtime.is_main)


def check_same_architecture(model: SequenceClassifier, teacher_dir: str) -> None:
    """Self-KD's teacher is a fine-tuned copy of the student: same encoder shape (one line naming both if not)."""
    teacher, _ = load_classifier(teacher_dir)
    shape = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if shape != {k: tuple(v.shape) for k, v in teacher.state_dict().items()}:
        raise ConfigError(f"labelreg.teacher: {teacher_dir} is {_architecture(teacher)}, the student "
                          f"{_architecture(model)} (labelreg.target=selfkd needs a fine-tuned copy of the "
                          "student's architecture; use kd for another model)")


def _architecture(model: SequenceClassifier) -> str:
    c = model.config
    return (f"{c.num_layers} layers x {c.hidden_size} hidden ({c.num_heads} heads, FFN {c.intermediate_size}, "
            f"embeddings {c.embed_dim}, vocab {c.vocab_size}, {c.position_encoding}, {model.num_labels} labels)")
