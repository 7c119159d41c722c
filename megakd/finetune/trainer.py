"""The fine-tuning loop (docs/methods.md § Fine-tuning) with a pluggable objective, run once per seed.

Learning rate: `finetune.lr` is a rate, `auto` (a rate from the encoder's width, see `auto_lr`),
or a list of rates. A list is decided before dev is read: every candidate trains the first seed
on the training split minus a fixed held-out slice (`finetune.lr_select_frac` of it, chosen by a
permutation seeded with 0), the candidate with the best headline metric on that slice wins (ties:
the earlier candidate), and every seed then trains with it on the full training split. All
candidates' slice scores go to `summary.json`.

One seed: AdaMax (β (0.9, 0.98), ε 1e-6, coupled L2 weight decay on matrices only, as torch's
Adamax implements it), linear warm-up over `warmup_frac` of the optimizer steps then linear decay
to 0 (`megakd.engine.optim.build_scheduler`), gradient clipping at 1.0, dropout 0.1, dev evaluation
after every epoch. The batch order of epoch e is `randperm` from a generator seeded with
(seed, e), so a seed reproduces bit-for-bit on CPU.

Objectives see the batch (with the examples' stable `index` and their `row` in the train split)
and the epoch, and return (loss, logits, logs). `LabelRegObjective` is plain fine-tuning and every
label-regularisation target; SoTeacher and TGT (finetune/soteacher.py, finetune/tgt.py) supply their own.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from megakd.config import ConfigError, ScheduleConfig, save_config
from megakd.data.tasks import EncodedTask, load_split
from megakd.data.tokenizer import Tokenizer
from megakd.engine.metrics import MetricsWriter
from megakd.engine.optim import build_scheduler, param_groups
from megakd.finetune.config import FinetuneConfig, LabelRegConfig, ModelInitConfig, auto_lr
from megakd.finetune.metrics import mean_std, task_metrics
from megakd.finetune.models import Pretrained, build_classifier, load_pretrained
from megakd.models.electra import SequenceClassifier
from megakd.objectives.label_reg import TEACHER_TARGETS, akd_temperature, annealing_kd_loss, label_reg_loss
from megakd.store import check_same_tokenizer, freeze
from megakd.store.model_dir import load_classifier, save_classifier

log = logging.getLogger(__name__)

MAX_BAD_STEPS = 10  # non-finite losses in a row before the run stops


class Objective(Protocol):
    def loss(self, model: SequenceClassifier, batch: dict[str, Tensor], epoch: int
             ) -> tuple[Tensor, Tensor, dict[str, float]]: ...


@torch.no_grad()
def predict(model: SequenceClassifier, data: EncodedTask, batch_size: int) -> np.ndarray:
    """Logits [N, K] (eval mode, in order) for every example of `data`."""
    was_training = model.training
    model.eval()
    out = []
    for start in range(0, len(data), batch_size):
        b = data.batch(range(start, min(start + batch_size, len(data))))
        out.append(model(b["input_ids"], b["attention_mask"], b["token_type_ids"]).float())
    model.train(was_training)
    return torch.cat(out).numpy()


class LabelRegObjective:
    """Plain fine-tuning (one-hot CE, or MSE for regression) and the label-regularisation targets.

    KD/self-KD teacher logits are computed once for the whole train split before training (the
    teacher is frozen and in eval mode, so they would be the same at every step).
    """

    def __init__(self, cfg: LabelRegConfig, num_labels: int, teacher_logits: Tensor | None = None):
        self.cfg, self.num_labels, self.teacher_logits = cfg, num_labels, teacher_logits

    def loss(self, model: SequenceClassifier, batch: dict[str, Tensor], epoch: int
             ) -> tuple[Tensor, Tensor, dict[str, float]]:
        logits = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        return self.loss_from_logits(logits, batch, epoch), logits, {}

    def loss_from_logits(self, logits: Tensor, batch: dict[str, Tensor], epoch: int = 0) -> Tensor:
        if self.num_labels == 1:
            return F.mse_loss(logits.squeeze(-1), batch["labels"])
        c = self.cfg
        teacher = None if self.teacher_logits is None else self.teacher_logits[batch["row"]]
        if c.target == "akd":
            temperature = akd_temperature(epoch, c.akd_phase1_epochs, c.temperature)
            if temperature is None:  # phase II
                return F.cross_entropy(logits, batch["labels"])
            return annealing_kd_loss(logits, teacher, temperature, c.temperature)
        return label_reg_loss(logits, batch["labels"], c.target, alpha=c.alpha, a=c.a, temperature=c.temperature,
                              tau_squared=c.tau_squared, teacher_logits=teacher)


def teacher_logits_for(path: str, key: str, student_tokenizer: Tokenizer, train: EncodedTask, num_labels: int,
                       batch_size: int) -> Tensor:
    """Logits of a fine-tuned classifier directory on every train example (checked to share the tokenizer)."""
    teacher, tokenizer = load_classifier(path)
    check_same_tokenizer(student_tokenizer, tokenizer, key)
    if teacher.num_labels != num_labels:
        raise ConfigError(f"{key}: {path} has {teacher.num_labels} labels, the task {num_labels}")
    return torch.from_numpy(predict(freeze(teacher), train, batch_size))


@dataclass
class SeedResult:
    seed: int
    metrics: dict[str, float]  # eval-split metrics after the last epoch
    dev_logits: np.ndarray
    train_losses: list[float]  # mean train loss of each epoch
    curve: list[dict[str, float]]  # per epoch: epoch, train_loss and every eval-split metric
    model_dir: Path | None


def train_seed(cfg: FinetuneConfig, seed: int, model: SequenceClassifier, tokenizer: Tokenizer,
               train: EncodedTask, dev: EncodedTask, objective: Objective, out_dir: Path,
               lr: float, eval_split: str = "dev") -> SeedResult:
    """Train `model` with `objective` for `finetune.epochs` epochs at peak rate `lr` (see `run_seeds`).

    Evaluates on `dev` after every epoch; its metrics are logged as `<eval_split>_<metric>`. For the
    real dev split this writes the dev logits and the model; an LR-selection trial
    (`eval_split="slice"`, `dev` a slice of train) writes only its metrics.
    """
    f = cfg.finetune
    out_dir.mkdir(parents=True, exist_ok=True)
    steps_per_epoch = math.ceil(len(train) / f.batch_size)
    total = steps_per_epoch * f.epochs
    schedule = ScheduleConfig(warmup_steps=round(f.warmup_frac * total), decay="linear")
    optimizer = torch.optim.Adamax(param_groups(model.named_parameters(), f.weight_decay), lr=lr,
                                   betas=tuple(f.betas), eps=f.eps)
    scheduler = build_scheduler(optimizer, schedule, total)
    writer = MetricsWriter(out_dir, tensorboard=False, wandb=False, wandb_project="", wandb_mode="offline", config={})
    params = [p for p in model.parameters() if p.requires_grad]
    step, bad_steps, epoch_losses, metrics, curve = 0, 0, [], {}, []
    torch.manual_seed(seed)  # dropout stream
    model.train()
    bar = tqdm(total=total, desc=f"seed {seed}", disable=not cfg.run.progress_bar, dynamic_ncols=True)
    try:
        for epoch in range(f.epochs):
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
            sums: dict[str, float] = {}
            count, epoch_sum = 0, 0.0
            for start in range(0, len(train), f.batch_size):
                rows = order[start: start + f.batch_size]
                batch = {**train.batch(rows), "row": rows}
                loss, _, logs = objective.loss(model, batch, epoch)
                step_lr = scheduler.get_last_lr()[0]  # the rate this step used
                optimizer.zero_grad(set_to_none=True)
                step += 1
                bar.update(1)
                if not torch.isfinite(loss):  # skip the update, as the pretraining trainer does
                    bad_steps += 1
                    log.warning("seed %d step %d: non-finite loss %s, update skipped", seed, step, loss.item())
                    if bad_steps >= MAX_BAD_STEPS:
                        raise FloatingPointError(f"seed {seed}: {bad_steps} non-finite losses in a row at step "
                                                 f"{step}; lower finetune.lr or check the data")
                    continue
                bad_steps = 0
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(params, f.clip_norm if f.clip_norm > 0 else math.inf)
                optimizer.step()
                scheduler.step()
                bar.set_postfix(epoch=epoch, loss=f"{loss.item():.4f}")
                epoch_sum += loss.item()
                for k, v in {"loss": loss.item(), "grad_norm": float(grad_norm), **logs}.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
                if step % f.log_every == 0 or step == total:
                    writer.write({"step": step, "epoch": epoch, "lr": step_lr,
                                  **{k: v / count for k, v in sums.items()}})
                    sums, count = {}, 0
            epoch_losses.append(epoch_sum / steps_per_epoch)
            dev_logits = predict(model, dev, f.eval_batch_size)
            metrics = task_metrics(dev_logits, dev.labels.numpy(), cfg.task.num_labels)
            curve.append({"epoch": epoch, "train_loss": epoch_losses[-1], **metrics})
            writer.write({"step": step, "epoch": epoch, "train_loss": epoch_losses[-1],
                          **{f"{eval_split}_{k}": v for k, v in metrics.items()}})
            log.info("seed %d lr %g epoch %d: train loss %.4f, %s %s", seed, lr, epoch, epoch_losses[-1], eval_split,
                     ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    finally:
        bar.close()
        writer.close()
    model_dir = None
    if eval_split == "dev":
        np.save(out_dir / "dev_logits.npy", dev_logits)
        model_dir = save_classifier(model.eval(), tokenizer, out_dir / "model",
                                    {"task": cfg.task.name, "seed": seed, "lr": lr, "dev": metrics})
    (out_dir / "result.json").write_text(json.dumps({"seed": seed, "lr": lr, eval_split: metrics,
                                                     "train_loss": epoch_losses, "curve": curve}, indent=2) + "\n")
    return SeedResult(seed, metrics, dev_logits, epoch_losses, curve, model_dir)


ObjectiveFactory = Callable[[int, SequenceClassifier, Tokenizer, EncodedTask, Path], Objective]


def run_seeds(cfg: FinetuneConfig, run_dir: Path, init: ModelInitConfig, make_objective: ObjectiveFactory
              ) -> tuple[list[SeedResult], EncodedTask, EncodedTask, dict]:
    """Every seed of `finetune.seeds` into `run_dir/seed_<s>/`.

    Returns the results, the encoded splits and the LR record (`lr_record`). The dev split is read
    only after the learning rate is fixed.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    train_ex = load_split(cfg.task, "train")
    pretrained: Pretrained | None = load_pretrained(init.path, init.tokenizer) if init.path else None
    tokenizer = pretrained.tokenizer if pretrained else Tokenizer.load(init.tokenizer)
    encoder = pretrained.config if pretrained else init.encoder
    max_len = model_max_len(cfg.finetune.max_seq_len, encoder.max_position_embeddings, encoder.position_encoding)
    regression = cfg.task.num_labels == 1
    train = EncodedTask(train_ex, tokenizer, max_len, regression)
    log.info("task %s: %d train examples; init %s (%s)", cfg.task.name, len(train), init.path or "random", init.init)
    candidates = candidate_lrs(cfg.finetune.lr, encoder.hidden_size)
    record = {"setting": cfg.finetune.lr, "candidates": candidates, "lr": candidates[0]}
    if len(candidates) > 1:
        record = select_lr(cfg, run_dir / "lr_select", init, pretrained, train, make_objective, candidates)
    dev = EncodedTask(load_split(cfg.task, "dev"), tokenizer, max_len, regression)
    log.info("task %s: %d dev examples; lr %g", cfg.task.name, len(dev), record["lr"])
    results = []
    for seed in cfg.finetune.seeds:
        model, tokenizer = build_classifier(init, cfg.task.num_labels, cfg.finetune.dropout, seed,
                                            pretrained)
        seed_dir = run_dir / f"seed_{seed}"
        results.append(train_seed(cfg, seed, model, tokenizer, train, dev,
                                  make_objective(seed, model, tokenizer, train, seed_dir), seed_dir, lr=record["lr"]))
    return results, train, dev, record


def model_max_len(max_seq_len: int, max_position_embeddings: int, position_encoding: str) -> int:
    """`finetune.max_seq_len`, capped by the encoder's position table (said once, as HF's `model_max_length`)."""
    if position_encoding != "absolute" or max_seq_len <= max_position_embeddings:
        return max_seq_len
    log.warning("finetune.max_seq_len=%d exceeds the model's max_position_embeddings=%d: inputs are truncated "
                "to %d tokens", max_seq_len, max_position_embeddings, max_position_embeddings)
    return max_position_embeddings


def candidate_lrs(setting: float | list[float] | str, hidden_size: int) -> list[float]:
    """The learning rates `finetune.lr` stands for: one rate, `auto` (`auto_lr`), or a list."""
    if setting == "auto":
        return [auto_lr(hidden_size)]
    return [float(v) for v in setting] if isinstance(setting, list) else [float(setting)]


def selection_rows(n: int, frac: float) -> tuple[list[int], list[int]]:
    """(fit rows, held-out rows) of a train split of `n` examples: a fixed permutation (seed 0), both non-empty."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    held = min(max(1, round(frac * n)), n - 1)
    return sorted(order[held:]), sorted(order[:held])


def select_lr(cfg: FinetuneConfig, out_dir: Path, init: ModelInitConfig, pretrained: Pretrained | None,
              train: EncodedTask, make_objective: ObjectiveFactory, candidates: list[float]) -> dict:
    """Train the first seed at every candidate on train minus a held-out slice; the best slice score wins."""
    if len(train) < 2:
        raise ConfigError(f"finetune.lr: choosing among {candidates} needs at least 2 train examples")
    fit_rows, held_rows = selection_rows(len(train), cfg.finetune.lr_select_frac)
    fit, held = train.subset(fit_rows), train.subset(held_rows)
    seed, metric = cfg.finetune.seeds[0], cfg.metric
    scores = []
    for lr in candidates:
        model, tokenizer = build_classifier(init, cfg.task.num_labels, cfg.finetune.dropout, seed, pretrained)
        trial_dir = out_dir / f"lr_{lr:g}"
        objective = make_objective(seed, model, tokenizer, fit, trial_dir)
        result = train_seed(cfg, seed, model, tokenizer, fit, held, objective, trial_dir, lr=lr, eval_split="slice")
        scores.append(result.metrics[metric])
    best = max(range(len(candidates)), key=lambda i: (scores[i], -i))  # ties: the earlier candidate
    log.info("finetune.lr: %s on a held-out slice of %d train examples (seed %d): %s; using %g", metric, len(held),
             seed, ", ".join(f"{lr:g} → {v:.4f}" for lr, v in zip(candidates, scores)), candidates[best])
    return {"setting": cfg.finetune.lr, "candidates": candidates, "lr": candidates[best],
            "selection": {"metric": metric, "seed": seed, "fit_examples": len(fit), "slice_examples": len(held),
                          "slice_scores": dict(zip((f"{lr:g}" for lr in candidates), scores)),
                          "then": "every seed retrains on the full train split with the chosen lr"}}


def summarize(results: list[SeedResult], run_dir: Path, headline: str,
              extra: dict[str, list[float]] | None = None, lr_record: dict | None = None) -> dict:
    """summary.json (mean ± std over seeds of every dev metric and `extra`, the LR record, the per-epoch
    dev curve of every seed) and summary.md (a table)."""
    columns: dict[str, list[float]] = {}
    for r in results:
        for k, v in r.metrics.items():
            columns.setdefault(k, []).append(v)
    columns.update(extra or {})
    summary = {"seeds": [r.seed for r in results], "headline": headline,
               "metrics": {k: mean_std(v) for k, v in columns.items()},
               **({"lr": lr_record} if lr_record else {}),
               "dev_curve": {str(r.seed): r.curve for r in results}}
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


def open_run_dir(cfg: FinetuneConfig) -> Path:
    """Every fine-tuning command's run directory, created with its resolved config."""
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    return run_dir


def run_finetune(cfg: FinetuneConfig) -> dict:
    """`megakd finetune` without SoTeacher/TGT: plain fine-tuning or a label-regularisation target."""
    run_dir = open_run_dir(cfg)
    lr = cfg.labelreg
    # The teacher is frozen: predict once per train set (the full split, and the LR-selection fit rows).
    teacher_logits: dict[EncodedTask, Tensor] = {}

    def make_objective(seed: int, model: SequenceClassifier, tokenizer: Tokenizer, train: EncodedTask,
                       out_dir: Path) -> Objective:
        if lr.target in TEACHER_TARGETS and train not in teacher_logits:
            teacher_logits[train] = teacher_logits_for(lr.teacher, "labelreg.teacher", tokenizer, train,
                                                       cfg.task.num_labels, cfg.finetune.eval_batch_size)
            if lr.target == "selfkd":
                check_same_architecture(model, lr.teacher)
        return LabelRegObjective(lr, cfg.task.num_labels, teacher_logits.get(train))

    results, _, _, lr_record = run_seeds(cfg, run_dir, cfg.model, make_objective)
    return summarize(results, run_dir, cfg.metric, lr_record=lr_record)


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
