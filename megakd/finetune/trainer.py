"""The fine-tuning loop (SPEC §1.7) with a pluggable objective, run once per seed.

One seed: AdaMax (β (0.9, 0.98), ε 1e-6, coupled L2 weight decay on matrices only, as torch's
Adamax implements it), linear warm-up over `warmup_frac` of the optimizer steps then linear decay
to 0 (`megakd.engine.optim.build_scheduler`), gradient clipping at 1.0, dropout 0.1, dev evaluation
after every epoch. The batch order of epoch e is `randperm` from a generator seeded with
(seed, e), so a seed reproduces bit-for-bit on CPU.

Objectives see the batch (with the examples' stable `index` and their `row` in the train split)
and the epoch, and return (loss, logits, logs). `LabelRegObjective` is plain fine-tuning and every
label-regularisation target; SoTeacher and TGT (megakd.distill) supply their own.
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
from megakd.data.tasks import EncodedTask, load_task
from megakd.data.tokenizer import Tokenizer
from megakd.engine.metrics import MetricsWriter
from megakd.engine.optim import build_scheduler, param_groups
from megakd.finetune.config import FinetuneConfig, LabelRegConfig, ModelInitConfig
from megakd.finetune.metrics import mean_std, task_metrics
from megakd.finetune.models import (
    Pretrained,
    build_classifier,
    check_same_tokenizer,
    freeze,
    load_classifier,
    load_pretrained,
    save_classifier,
)
from megakd.models.electra import SequenceClassifier
from megakd.objectives.label_reg import TEACHER_TARGETS, label_reg_loss

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
        return self.loss_from_logits(logits, batch), logits, {}

    def loss_from_logits(self, logits: Tensor, batch: dict[str, Tensor]) -> Tensor:
        if self.num_labels == 1:
            return F.mse_loss(logits.squeeze(-1), batch["labels"])
        c = self.cfg
        teacher = None if self.teacher_logits is None else self.teacher_logits[batch["row"]]
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
    metrics: dict[str, float]  # dev metrics after the last epoch
    dev_logits: np.ndarray
    train_losses: list[float]  # mean train loss of each epoch
    model_dir: Path


def train_seed(cfg: FinetuneConfig, seed: int, model: SequenceClassifier, tokenizer: Tokenizer,
               train: EncodedTask, dev: EncodedTask, objective: Objective, out_dir: Path) -> SeedResult:
    """Train `model` with `objective` for `finetune.epochs` epochs; write metrics, dev logits and the model."""
    f = cfg.finetune
    out_dir.mkdir(parents=True, exist_ok=True)
    steps_per_epoch = math.ceil(len(train) / f.batch_size)
    total = steps_per_epoch * f.epochs
    schedule = ScheduleConfig(warmup_steps=round(f.warmup_frac * total), decay="linear")
    optimizer = torch.optim.Adamax(param_groups(model.named_parameters(), f.weight_decay), lr=f.lr,
                                   betas=tuple(f.betas), eps=f.eps)
    scheduler = build_scheduler(optimizer, schedule, total)
    writer = MetricsWriter(out_dir, tensorboard=False, wandb=False, wandb_project="", wandb_mode="offline", config={})
    params = [p for p in model.parameters() if p.requires_grad]
    step, bad_steps, epoch_losses, metrics = 0, 0, [], {}
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
                lr = scheduler.get_last_lr()[0]  # the rate this step used
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
                    writer.write({"step": step, "epoch": epoch, "lr": lr,
                                  **{k: v / count for k, v in sums.items()}})
                    sums, count = {}, 0
            epoch_losses.append(epoch_sum / steps_per_epoch)
            dev_logits = predict(model, dev, f.eval_batch_size)
            metrics = task_metrics(dev_logits, dev.labels.numpy(), cfg.task.num_labels)
            writer.write({"step": step, "epoch": epoch, "train_loss": epoch_losses[-1],
                          **{f"dev_{k}": v for k, v in metrics.items()}})
            log.info("seed %d epoch %d: train loss %.4f, dev %s", seed, epoch, epoch_losses[-1],
                     ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    finally:
        bar.close()
        writer.close()
    np.save(out_dir / "dev_logits.npy", dev_logits)
    model_dir = save_classifier(model.eval(), tokenizer, out_dir / "model",
                                {"task": cfg.task.name, "seed": seed, "dev": metrics})
    (out_dir / "result.json").write_text(json.dumps({"seed": seed, "dev": metrics, "train_loss": epoch_losses},
                                                    indent=2) + "\n")
    return SeedResult(seed, metrics, dev_logits, epoch_losses, model_dir)


ObjectiveFactory = Callable[[int, SequenceClassifier, Tokenizer, EncodedTask, Path], Objective]


def run_seeds(cfg: FinetuneConfig, run_dir: Path, init: ModelInitConfig, make_objective: ObjectiveFactory
              ) -> tuple[list[SeedResult], EncodedTask, EncodedTask]:
    """Every seed of `finetune.seeds` into `run_dir/seed_<s>/`; returns the results and the encoded splits."""
    run_dir.mkdir(parents=True, exist_ok=True)
    train_ex, dev_ex = load_task(cfg.task)
    pretrained: Pretrained | None = load_pretrained(init.path, run_dir / "init", init.tokenizer) if init.path else None
    tokenizer = pretrained.tokenizer if pretrained else Tokenizer.load(init.tokenizer)
    regression = cfg.task.num_labels == 1
    train = EncodedTask(train_ex, tokenizer, cfg.finetune.max_seq_len, regression)
    dev = EncodedTask(dev_ex, tokenizer, cfg.finetune.max_seq_len, regression)
    log.info("task %s: %d train / %d dev examples; init %s (%s)", cfg.task.name, len(train), len(dev),
             init.path or "random", init.init)
    results = []
    for seed in cfg.finetune.seeds:
        model, tokenizer = build_classifier(init, cfg.task.num_labels, cfg.finetune.dropout, seed,
                                            run_dir / "init", pretrained)
        seed_dir = run_dir / f"seed_{seed}"
        results.append(train_seed(cfg, seed, model, tokenizer, train, dev,
                                  make_objective(seed, model, tokenizer, train, seed_dir), seed_dir))
    return results, train, dev


def summarize(results: list[SeedResult], run_dir: Path, headline: str,
              extra: dict[str, list[float]] | None = None) -> dict:
    """summary.json (mean ± std over seeds of every dev metric and `extra`) and summary.md (a table)."""
    columns: dict[str, list[float]] = {}
    for r in results:
        for k, v in r.metrics.items():
            columns.setdefault(k, []).append(v)
    columns.update(extra or {})
    summary = {"seeds": [r.seed for r in results], "headline": headline,
               "metrics": {k: mean_std(v) for k, v in columns.items()}}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = ["| metric | mean ± std | per seed |", "|---|---|---|"]
    for k, s in summary["metrics"].items():
        lines.append(f"| {k} | {s['mean']:.4f} ± {s['std']:.4f} | {', '.join(f'{v:.4f}' for v in s['values'])} |")
    table = "\n".join(lines)
    (run_dir / "summary.md").write_text(table + "\n")
    log.info("%s over seeds %s:\n%s", run_dir, summary["seeds"], table)
    return summary


def run_finetune(cfg: FinetuneConfig) -> dict:
    """`megakd finetune` without SoTeacher/TGT: plain fine-tuning or a label-regularisation target."""
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    lr = cfg.labelreg
    # The teacher and the encoded train split are the same for every seed: predict once.
    teacher_logits: list[Tensor] = []

    def make_objective(seed: int, model: SequenceClassifier, tokenizer: Tokenizer, train: EncodedTask,
                       out_dir: Path) -> Objective:
        if lr.target in TEACHER_TARGETS and not teacher_logits:
            teacher_logits.append(teacher_logits_for(lr.teacher, "labelreg.teacher", tokenizer, train,
                                                     cfg.task.num_labels, cfg.finetune.eval_batch_size))
            if lr.target == "selfkd":
                check_same_architecture(model, lr.teacher)
        return LabelRegObjective(lr, cfg.task.num_labels, teacher_logits[0] if teacher_logits else None)

    results, _, _ = run_seeds(cfg, run_dir, cfg.model, make_objective)
    return summarize(results, run_dir, cfg.metric)


def check_same_architecture(model: SequenceClassifier, teacher_dir: str) -> None:
    """Self-KD's teacher is a fine-tuned copy of the student: same encoder shape."""
    teacher, _ = load_classifier(teacher_dir)
    shape = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if shape != {k: tuple(v.shape) for k, v in teacher.state_dict().items()}:
        raise ConfigError(f"labelreg.teacher: {teacher_dir} is not the student's architecture "
                          "(labelreg.target=selfkd needs a fine-tuned copy of the same model; use kd)")
