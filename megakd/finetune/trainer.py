"""The fine-tuning loop (docs/methods.md § Fine-tuning) with a pluggable objective, run once per seed.

Learning rate: `finetune.lr` is a rate, `auto` (a rate from the encoder's width, see `auto_lr`),
or a list of rates. A list is decided before dev is read: every candidate trains the first seed
on the training split minus a fixed held-out slice (`finetune.lr_select_frac` of it, chosen by a
permutation seeded with 0), the candidate with the best headline metric on that slice wins (ties:
the earlier candidate), and every seed then trains with it on the full training split. All
candidates' slice scores go to `summary.json`. Under data parallelism every rank trains every
trial together and takes rank 0's scores, so all ranks choose the same rate.

One seed: AdaMax (β (0.9, 0.98), ε 1e-6, coupled L2 weight decay on matrices only, as torch's
Adamax implements it; or AdamW with layer-wise LR decay, `finetune.optimizer` and
`finetune.layer_lr_decay`, ELECTRA's GLUE setting), linear warm-up over `warmup_frac` of the
optimizer steps then linear decay to 0 (`megakd.engine.optim.build_scheduler`), gradient clipping
at 1.0, dropout 0.1, dev evaluation after every epoch. The batch order of epoch e is `randperm` from
a generator seeded with (seed, e), so a seed reproduces bit-for-bit on CPU. `finetune.batch_size` is the global batch,
split over the data-parallel ranks of the backend (megakd/finetune/runtime.py).

Objectives see the batch (with the examples' stable `index` and their `row` in the train split)
and the epoch, and return (loss, logits, logs). `LabelregObjective` is plain fine-tuning and every
label-regularisation target; SoTeacher and TGT (finetune/soteacher.py, finetune/tgt.py) supply their own.
An objective with state that must survive a restart (SoTeacher's store, TGT's sampling generator)
has `state_dict`/`load_state_dict`.

Resume: each training (a seed, or an LR-selection trial) checkpoints into its own directory
(`<seed dir>/checkpoints/step_N/`, through megakd.store.checkpoint: atomic, verified) at the end
of every epoch, every `run.save_every` steps and on a stop signal; a finished one leaves
`result.json` and drops its checkpoints. `--resume auto` reloads finished trainings and continues
the unfinished one from its newest intact checkpoint, bit-exact on CPU with the same world size.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megakd.config import ConfigError, ScheduleConfig
from megakd.configio import save_config
from megakd.data.tasks import EncodedTask, Example, load_split
from megakd.data.tokenizer import Tokenizer
from megakd.engine.hooks import Hook, StepEnd, clock_text
from megakd.engine.layouts import Layout, MicroStepOutput
from megakd.engine.loop import Checkpointer, LoopPlan, RandomStreams, StepInput, TrainingLoop
from megakd.engine.optim import build_scheduler, param_groups
from megakd.engine.runlog import MetricsWriter
from megakd.engine.units import Unit
from megakd.finetune.config import FinetuneConfig, LabelregConfig, ModelInitConfig, OptimConfig, auto_lr
from megakd.finetune.models import Pretrained, build_classifier, load_pretrained
from megakd.finetune.runtime import Runtime, Stopped, single_process
from megakd.finetune.scores import mean_std_record, task_metrics
from megakd.models.electra import SequenceClassifier
from megakd.objectives.labelreg import TEACHER_TARGETS, akd_temperature, annealing_kd_loss, labelreg_loss
from megakd.store import check_same_tokenizer, checkpoint, freeze
from megakd.store.files import StoreError
from megakd.store.model_dir import load_classifier, save_classifier

log = logging.getLogger(__name__)

MAX_BAD_STEPS = 10  # non-finite losses in a row before the run stops
RESULT_FILE = "result.json"  # written last: a training directory with it is finished
UNIT = "classifier"  # the backend unit's name: checkpoint files classifier.safetensors, classifier.optim.pt


class Objective(Protocol):
    def loss(self, model: SequenceClassifier, batch: dict[str, Tensor], epoch: int
             ) -> tuple[Tensor, Tensor, dict[str, float]]: ...


class ClassifierLoss(nn.Module):
    """What the backend wraps: the classifier, with the objective's loss as its forward.

    Every forward pass an objective makes (TGT's generated batch, SoTeacher's penalty) then runs
    inside one DDP/DeepSpeed forward, so gradients are synchronised once per step.
    """

    def __init__(self, model: SequenceClassifier, objective: Objective):
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, batch: dict[str, Tensor], epoch: int) -> dict:
        loss, logits, logs = self.objective.loss(self.model, batch, epoch)
        return {"loss": loss, "logits": logits, "logs": logs}


class ClassifierLayout(Layout):
    """Fine-tuning as a training layout: one unit (the classifier), one micro-batch per step.

    So a fine-tuning step goes through the same `backend.train_step` as pretraining (one agreement
    all-reduce on finiteness and stop signals, all-or-nothing update). The micro-batch is this
    rank's rows of the global batch; its loss is weighted by its share (`StepContext.loss_weight`,
    `Runtime.local_rows`), and the objectives' schedules read `StepContext.epoch`. The statistics are
    the logs' contributions to the global-batch means, in float64, and the rows trained (`samples`).
    """

    name = "classifier"

    def __init__(self, unit: Unit, world_size: int):
        super().__init__([unit], kd=None)
        self.unit = unit
        self.world_size = world_size

    def micro_step(self, run, batch, step):
        out = run.forward(self.unit, batch, step.epoch)
        run.backward(self.unit, out["loss"] * step.loss_weight)
        share = step.loss_weight / self.world_size  # this rank's part of a global-batch mean
        logs = {"loss": out["loss"].detach(), **out["logs"]}
        stats = {k: torch.as_tensor(v, dtype=torch.float64).detach() * share for k, v in logs.items()}
        return MicroStepOutput([out["loss"].detach()], {**stats, "samples": batch["real"].double()})

    def loss_modules(self):
        return []

    def ratios(self, sums):
        """Each logged value's mean over the interval's applied steps (`steps`)."""
        return {k: v / sums["steps"] for k, v in sums.items() if k not in _COUNTS}

    def optimizer_metrics(self, mean_norms, step_lrs):
        """The rate the last step used, and the mean gradient norm."""
        return {"lr": step_lrs[UNIT], "grad_norm": mean_norms.get(UNIT, 0.0)}

    def throughput(self, sums, seconds):
        return {"samples_per_s": sums["samples"] / max(seconds, 1e-9)}


_COUNTS = ("tokens", "samples", "steps")  # statistics that count rather than average


@torch.no_grad()
def predict(model: SequenceClassifier, data: EncodedTask, batch_size: int, runtime: Runtime | None = None
            ) -> np.ndarray:
    """Logits [N, K] (eval mode, in order) for every example of `data`, on every rank.

    With several ranks each predicts every world-th batch (the same batches as one process, so the
    same values) and a sum over ranks assembles them.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    starts = range(0, len(data), batch_size)
    mine = starts if runtime is None else [starts[i] for i in runtime.shard_batches(len(starts))]
    logits = torch.zeros(len(data), model.num_labels)
    for start in mine:
        rows = range(start, min(start + batch_size, len(data)))
        b = {k: v.to(device) for k, v in data.batch(rows).items()}
        with runtime.backend.autocast() if runtime is not None else contextlib.nullcontext():
            logits[start: rows.stop] = model(b["input_ids"], b["attention_mask"], b["token_type_ids"]).float().cpu()
    model.train(was_training)
    if runtime is not None and runtime.world_size > 1:
        logits = runtime.sum(logits)
    return logits.numpy()


class LabelregObjective:
    """Plain fine-tuning (one-hot CE, or MSE for regression) and the label-regularisation targets.

    KD/self-KD teacher logits are computed once for the whole train split before training (the
    teacher is frozen and in eval mode, so they would be the same at every step).
    """

    def __init__(self, cfg: LabelregConfig, num_labels: int, teacher_logits: Tensor | None = None):
        self.cfg, self.num_labels, self.teacher_logits = cfg, num_labels, teacher_logits

    def loss(self, model: SequenceClassifier, batch: dict[str, Tensor], epoch: int
             ) -> tuple[Tensor, Tensor, dict[str, float]]:
        logits = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        return self.loss_from_logits(logits, batch, epoch), logits, {}

    def loss_from_logits(self, logits: Tensor, batch: dict[str, Tensor], epoch: int = 0) -> Tensor:
        if self.num_labels == 1:
            return F.mse_loss(logits.squeeze(-1), batch["labels"])
        c = self.cfg
        teacher = None if self.teacher_logits is None else self.teacher_logits[batch["row"].cpu()].to(logits.device)
        if c.target == "akd":
            temperature = akd_temperature(epoch, c.akd_phase1_epochs, c.temperature)
            if temperature is None:  # phase II
                return F.cross_entropy(logits, batch["labels"])
            return annealing_kd_loss(logits, teacher, temperature, c.temperature)
        return labelreg_loss(logits, batch["labels"], c.target, alpha=c.alpha, a=c.a, temperature=c.temperature,
                              tau_squared=c.tau_squared, teacher_logits=teacher)


def teacher_logits_for(path: str, key: str, student_tokenizer: Tokenizer, train: EncodedTask, num_labels: int,
                       batch_size: int, runtime: Runtime | None = None) -> Tensor:
    """Logits of a fine-tuned classifier directory on every train example (checked to share the tokenizer)."""
    teacher, tokenizer = load_classifier(path)
    check_same_tokenizer(student_tokenizer, tokenizer, key)
    if teacher.num_labels != num_labels:
        raise ConfigError(f"{key}: {path} has {teacher.num_labels} labels, the task {num_labels}")
    if runtime is not None:
        teacher.to(runtime.device)
    return torch.from_numpy(predict(freeze(teacher), train, batch_size, runtime))


def layerwise_param_groups(model: SequenceClassifier, weight_decay: float, lr: float, decay: float) -> list[dict]:
    """Parameter groups whose rate falls by `decay` per layer below the head: the head at `lr`, encoder layer
    i of L at lr·decay^(L+1−i), the embeddings (and the shared relative-position table) at lr·decay^(L+2);
    weight decay on matrices only, as `param_groups`."""
    top = model.config.num_layers + 2
    groups: dict[tuple[int, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        parts = name.split(".")
        depth = (int(parts[2]) + 1 if parts[1] == "layers" else 0) if parts[0] == "encoder" else top
        matrix = p.ndim >= 2
        group = groups.setdefault((depth, matrix), {"params": [], "weight_decay": weight_decay if matrix else 0.0,
                                                    "lr": lr * decay ** (top - depth)})
        group["params"].append(p)
    return [groups[k] for k in sorted(groups)]


def build_optimizer(model: SequenceClassifier, f: OptimConfig, lr: float) -> torch.optim.Optimizer:
    """AdaMax (the dissertation's setting) or AdamW (ELECTRA's GLUE setting) at peak rate `lr`, with
    layer-wise decay when `finetune.layer_lr_decay` < 1 (two groups otherwise, as before it existed)."""
    groups = (param_groups(model.named_parameters(), f.weight_decay) if f.layer_lr_decay == 1.0 else
              layerwise_param_groups(model, f.weight_decay, lr, f.layer_lr_decay))
    kind = torch.optim.Adamax if f.optimizer == "adamax" else torch.optim.AdamW
    return kind(groups, lr=lr, betas=tuple(f.betas), eps=f.eps)


@dataclass
class SeedResult:
    seed: int
    metrics: dict[str, float]  # eval-split metrics after the last epoch
    dev_logits: np.ndarray
    train_losses: list[float]  # mean train loss of each epoch
    curve: list[dict[str, float]]  # per epoch: epoch, train_loss and every eval-split metric
    model_dir: Path | None


def finished_result(out_dir: Path, seed: int, eval_split: str, runtime: Runtime) -> SeedResult | None:
    """The result of a training that finished before this `--resume auto` run (None if it did not)."""
    path = out_dir / RESULT_FILE
    if not (runtime.resume and path.is_file()):
        return None
    try:
        result = json.loads(path.read_text())
        dev_logits = np.load(out_dir / "dev_logits.npy") if eval_split == "dev" else np.zeros((0, 0))
        metrics, losses, curve = result[eval_split], result["train_loss"], result["curve"]
    except (OSError, ValueError, KeyError) as err:
        raise StoreError(f"{path}: cannot reuse this finished training ({err}); move {out_dir} aside to retrain "
                         "it") from None
    log.info("%s: finished before, reusing its result", out_dir)
    return SeedResult(seed, metrics, dev_logits, losses, curve, out_dir / "model" if eval_split == "dev" else None)


class EpochSampler:
    """Fine-tuning's step source: each step is one global batch, this rank's rows of it. Epoch e's order
    is `randperm` from a generator seeded with (seed, e), so the position is just the batches drawn."""

    can_hold, failure = False, None  # the rows are in memory: nothing to fail or wait for mid-run

    def __init__(self, train: EncodedTask, batch_size: int, seed: int, steps_per_epoch: int, runtime: Runtime):
        self.train, self.batch_size, self.seed = train, batch_size, seed
        self.steps_per_epoch, self.runtime = steps_per_epoch, runtime
        self.drawn = 0
        self._order: tuple[int, Tensor] | None = None  # (epoch, its order)

    def next_step(self) -> StepInput:
        epoch, b = divmod(self.drawn, self.steps_per_epoch)
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = epoch, torch.randperm(len(self.train), generator=generator)
        rows = self._order[1][b * self.batch_size: (b + 1) * self.batch_size]
        local, offset, real, weight = self.runtime.local_rows(rows)
        batch = {**self.train.batch(local), "row": local, "offset": torch.tensor(offset),
                 "real": torch.tensor(real), "batch_rows": torch.tensor(len(rows))}
        self.drawn += 1
        return StepInput(iter([batch]), epoch=epoch, loss_weight=weight)

    def counters(self) -> dict[str, float]:
        return {}

    def line_values(self) -> dict:
        return {"epoch": (self.drawn - 1) // self.steps_per_epoch}

    def start(self, session, backend) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def state_dict(self) -> dict:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = int(state["drawn"])


class EpochEnd(Hook):
    """After each epoch's last step: the epoch's mean train loss and the eval split's metrics (its logits
    kept for the result), as a metrics line of their own. Its record of the epochs is run state."""

    def __init__(self, training: SeedTraining, dev: EncodedTask, eval_split: str):
        self.training, self.dev, self.eval_split = training, dev, eval_split
        # this rank's summed contributions to the epoch's global-batch losses
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=training.runtime.device)
        self.losses: list[float] = []  # mean train loss of each epoch
        self.curve: list[dict[str, float]] = []
        self.metrics: dict[str, float] = {}  # eval-split metrics of the last finished epoch
        self.dev_logits: np.ndarray | None = None  # the eval split's logits after the latest epoch

    def after_step(self, end: StepEnd) -> None:
        if end.values is not None:
            self.loss_sum += end.values["loss"]
        if end.step % self.training.steps_per_epoch == 0:
            end.lines.append({"step": end.step, **self.evaluate(end.step)})

    def evaluate(self, step: int) -> dict:
        t, split = self.training, self.eval_split
        epoch = (step - 1) // t.steps_per_epoch
        self.losses.append(t.runtime.sum(self.loss_sum).item() / t.steps_per_epoch)
        self.loss_sum.zero_()
        self.dev_logits = predict(t.model, self.dev, t.cfg.finetune.eval_batch_size, t.runtime)
        self.metrics = task_metrics(self.dev_logits, self.dev.labels.numpy(), t.cfg.task.num_labels)
        self.curve.append({"epoch": epoch, "train_loss": self.losses[-1], **self.metrics})
        log.info("%s epoch %d/%d: train loss %.4f, %s %s", t.label, epoch + 1, t.cfg.finetune.epochs,
                 self.losses[-1], split, ", ".join(f"{k} {v:.4f}" for k, v in self.metrics.items()))
        return {"epoch": epoch, "train_loss": self.losses[-1], **{f"{split}_{k}": v for k, v in self.metrics.items()}}

    def state_dict(self) -> dict:
        return {"loss_sum": self.loss_sum.cpu(), "losses": self.losses, "curve": self.curve, "metrics": self.metrics}

    def load_state_dict(self, state: dict) -> None:
        self.loss_sum = state["loss_sum"].to(self.loss_sum.device)
        self.losses, self.curve, self.metrics = list(state["losses"]), list(state["curve"]), dict(state["metrics"])


class SeedTraining:
    """One training of `model` with `objective` (a seed, or an LR-selection trial) on `runtime`'s backend:
    a classifier layout, an epoch sampler and an epoch-end evaluation on the one training loop. `label`
    (e.g. "cola seed 2") begins its progress and epoch lines."""

    def __init__(self, cfg: FinetuneConfig, seed: int, model: SequenceClassifier, objective: Objective,
                 out_dir: Path, lr: float, runtime: Runtime, train: EncodedTask, dev: EncodedTask, eval_split: str,
                 label: str):
        f = cfg.finetune
        self.cfg, self.seed, self.model, self.runtime, self.label = cfg, seed, model, runtime, label
        self.total = training_steps(len(train), f)
        self.steps_per_epoch = self.total // f.epochs
        model.to(runtime.device)
        optimizer = build_optimizer(model, f, lr)
        schedule = ScheduleConfig(warmup_steps=round(f.warmup_frac * self.total), decay="linear")
        unit = Unit(name=UNIT, loss_module=ClassifierLoss(model, objective), model=model, optimizer=optimizer,
                    scheduler=build_scheduler(optimizer, schedule, self.total), clip_norm=f.clip_norm)
        layout = ClassifierLayout(unit, runtime.world_size)
        runtime.backend.prepare(layout, 1)
        self.epochs = EpochEnd(self, dev, eval_split)
        every, spe, main = cfg.run.save_every, self.steps_per_epoch, runtime.is_main
        plan = LoopPlan(
            max_steps=self.total, log_every=f.log_every,
            save_due=lambda step: (step % spe == 0 and step < self.total) or (bool(every) and step % every == 0),
            save_at_end=False, bad_step_limit=MAX_BAD_STEPS,
            bad_step_limit_text=f"fine-tuning's limit of {MAX_BAD_STEPS}",
            bad_step_label=f"{label}: ", count_skipped=True, bar_values=lambda line: _bar_values(line, f.epochs),
            bar_label=label, show_bar=cfg.run.progress_bar and main, evaluations=[self.epochs])
        metrics = (lambda step: MetricsWriter.for_run(out_dir, cfg, step)) if main else None
        sampler = EpochSampler(train, f.batch_size, seed, spe, runtime)
        self.loop = TrainingLoop(runtime.backend, layout, runtime.session, sampler, RandomStreams(), plan, metrics)
        parts = {**self.loop.parts, "epochs": self.epochs}
        if hasattr(objective, "state_dict"):  # SoTeacher's store, TGT's sampling generator
            parts["objective"] = objective
        self.loop.checkpointer = Checkpointer(runtime.session, out_dir, [unit], parts, keep_last=cfg.run.keep_last,
                                              files=lambda tmp: save_config(cfg, tmp / "config.yaml"),
                                              upgrade=_upgrade_progress_rank_state)
        # Dropout: rank 0 draws the seed's one-process stream, other ranks their own.
        RandomStreams.seed_rank(seed + 1_000_003 * runtime.rank)

    def resume(self) -> None:
        """Continue from the newest intact checkpoint of this training, if `--resume auto` and there is one."""
        rt, root = self.runtime, self.loop.checkpointer.root
        step = None
        if rt.resume and rt.is_main:
            checkpoint.remove_stale_temp_dirs(root)
            found = checkpoint.newest_intact(root)
            step = checkpoint.step_of(found) if found is not None else None
        step = rt.session.share(step)
        if step is None:
            return
        self.loop.checkpointer.load(checkpoint.step_dir(root, step), resharding=False)
        log.info("%s: resumed at step %d of %d", root, step, self.total)

    def run(self) -> np.ndarray | None:
        """Train to the last step; returns the eval split's logits of the last epoch (None if it ended
        before this process started, on a checkpoint at the very end). A stop signal raises `Stopped`
        after the checkpoint."""
        end = self.loop.run()
        if end.stopped:
            raise Stopped(end.interrupted)
        return self.epochs.dev_logits


def _upgrade_progress_rank_state(state: dict, rank: int) -> dict:
    """A fine-tuning rank state written before the loop's parts had names ({progress, rng, objective},
    the progress holding the counters, the epoch's record and the log interval as global sums): the same
    values under the parts' names, the global sums on rank 0 (the next reduction adds the others' zeros)."""
    old = state["progress"]
    if "epoch_sum" not in old:
        return state
    mine = rank == 0
    sums = {k: torch.tensor(v if mine else 0.0, dtype=torch.float64) for k, v in old["interval"].items()
            if k != "grad_norm"}
    sums["samples"] = torch.tensor(float(old["interval_samples"] if mine else 0), dtype=torch.float64)
    upgraded = {"progress": {"step": old["step"], "bad_steps": old["bad_steps"]},
                "interval": {"sums": sums, "norms": {UNIT: old["interval"].get("grad_norm", 0.0)},
                             "steps": old["interval_steps"]},
                "data": {"drawn": old["step"]}, "rng": state["rng"],
                "epochs": {"loss_sum": torch.tensor(old["epoch_sum"] if mine else 0.0, dtype=torch.float64),
                           "losses": old["epoch_losses"], "curve": old["curve"], "metrics": old["metrics"]}}
    if state.get("objective"):
        upgraded["objective"] = state["objective"]
    return upgraded


def _bar_values(line: dict, epochs: int) -> dict | None:
    """The progress figures of a log line, its epoch counted from 1 as people count ("epoch 3/3"; the
    `epoch` of metrics.jsonl, result.json and summary.json counts from 0, as it always has)."""
    return {"epoch": f"{line['epoch'] + 1}/{epochs}", "loss": f"{line['loss']:.4f}"} if "loss" in line else None


def training_steps(train_examples: int, f: OptimConfig) -> int:
    """The optimizer steps of one training on `train_examples`: `finetune.epochs` epochs of global batches."""
    return math.ceil(train_examples / f.batch_size) * f.epochs


def planned_steps(train_examples: int, f: OptimConfig, candidates: int) -> list[int]:
    """The optimizer steps of each training `run_seeds` runs, in its order: with several LR candidates a
    trial of each on the fit rows (`selection_rows`), then every seed on the whole train split."""
    trials = []
    if candidates > 1:
        fit = train_examples - held_out_count(train_examples, f.lr_select_frac)
        trials = [training_steps(fit, f)] * candidates
    return trials + [training_steps(train_examples, f)] * len(f.seeds)


class Trainings:
    """A command's trainings (LR trials and seeds; under `megakd glue` every task's), planned as the
    optimizer steps of each (`planned_steps`). Each start is a log line: which run of how many, and the
    time the rest will take at the seconds per step of the runs before it in this process (wall time
    from one start to the next, so evaluations and the work between runs are in it)."""

    def __init__(self, steps: list[int]) -> None:
        self.count, self.left = len(steps), sum(steps)  # runs planned; the steps of those not started
        self.started = 0
        self.where = ""  # where the runs are in a larger plan (GLUE: "task 2 of 9"), said in each line
        self.seconds, self.trained = 0.0, 0  # time and steps of the runs this process finished
        self._current: tuple[float, int] | None = None  # (start, steps to train) of the run in progress

    def reused(self, *steps: int) -> None:
        """Trainings that finished before this process (`--resume auto`): counted, not timed."""
        self.started += len(steps)
        self.left -= sum(steps)

    def start(self, label: str, steps: int, done: int = 0) -> None:
        """The training `label` of `steps` steps starts, `done` of them trained before (a resume)."""
        now = time.perf_counter()
        if self._current is not None:
            self.seconds += now - self._current[0]
            self.trained += self._current[1]
        self.started += 1
        ahead = self.left - done
        self.left -= steps
        self._current = (now, steps - done)
        where = f" ({self.where})" if self.where else ""
        resumed = f" (resumed at step {done})" if done else ""
        if self.trained:
            rate = self.seconds / self.trained
            estimate = (f"about {clock_text(ahead * rate)} for it and the {self.count - self.started} after it "
                        f"({rate:.3g} s per step so far)")
        else:
            estimate = "the time left is estimated from the end of the first run on"
        log.info("%s: run %d of %d%s, %d steps%s; %s", label, self.started, self.count, where, steps - done, resumed,
                 estimate)


def train_seed(cfg: FinetuneConfig, seed: int, model: SequenceClassifier, tokenizer: Tokenizer,
               train: EncodedTask, dev: EncodedTask, objective: Objective, out_dir: Path,
               lr: float, eval_split: str = "dev", runtime: Runtime | None = None, label: str = "",
               runs: Trainings | None = None) -> SeedResult:
    """Train `model` with `objective` for `finetune.epochs` epochs at peak rate `lr` (see `run_seeds`).

    Evaluates on `dev` after every epoch; its metrics are logged as `<eval_split>_<metric>`. For the
    real dev split this writes the dev logits and the model; an LR-selection trial
    (`eval_split="slice"`, `dev` a slice of train) writes only its metrics. Without a `runtime`
    it trains in this process on the CPU. `label` names it in the log ("" = "<task> seed <seed>"); `runs`
    counts it among the command's trainings.
    """
    runtime = runtime or single_process(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    training = SeedTraining(cfg, seed, model, objective, out_dir, lr, runtime, train, dev, eval_split,
                            label or f"{cfg.task.name} seed {seed}")
    training.resume()
    if runs is not None:
        runs.start(training.label, training.total, training.loop.progress.step)
    dev_logits = training.run()
    if dev_logits is None:
        dev_logits = predict(model, dev, cfg.finetune.eval_batch_size, runtime)
    p = training.epochs
    model_dir = out_dir / "model" if eval_split == "dev" else None
    if runtime.is_main:
        if model_dir is not None:
            np.save(out_dir / "dev_logits.npy", dev_logits)
            save_classifier(standalone_copy(model), tokenizer, model_dir, {"task": cfg.task.name, "seed": seed,
                                                                             "lr": lr, "dev": p.metrics})
        result = {"seed": seed, "lr": lr, eval_split: p.metrics, "train_loss": p.losses, "curve": p.curve}
        tmp = out_dir / f".{RESULT_FILE}.tmp"
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(out_dir / RESULT_FILE)
        shutil.rmtree(checkpoint.checkpoints_root(out_dir), ignore_errors=True)
    runtime.barrier()  # the model directory is complete before any rank reads it (a KD student's teacher)
    return SeedResult(seed, p.metrics, dev_logits, p.losses, p.curve, model_dir)


def standalone_copy(model: SequenceClassifier) -> SequenceClassifier:
    """`model` on the CPU in eval mode, with tensors that own their storage.

    DeepSpeed's ZeRO optimizers keep the module's parameters as views into flat buffers, which
    safetensors refuses to save.
    """
    copy = SequenceClassifier(model.config, model.num_labels)
    copy.load_state_dict(model.state_dict())
    return copy.eval()


ObjectiveFactory = Callable[[int, SequenceClassifier, Tokenizer, EncodedTask, Path], Objective]


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


def candidate_lrs(setting: float | list[float] | str, hidden_size: int) -> list[float]:
    """The learning rates `finetune.lr` stands for: one rate, `auto` (`auto_lr`), or a list."""
    if setting == "auto":
        return [auto_lr(hidden_size)]
    return [float(v) for v in setting] if isinstance(setting, list) else [float(setting)]


def held_out_count(n: int, frac: float) -> int:
    """How many of `n` train examples the LR selection holds out: `frac` of them, at least one, not all."""
    return min(max(1, round(frac * n)), n - 1)


def selection_rows(n: int, frac: float) -> tuple[list[int], list[int]]:
    """(fit rows, held-out rows) of a train split of `n` examples: a fixed permutation (seed 0), both non-empty."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    held = held_out_count(n, frac)
    return sorted(order[held:]), sorted(order[:held])


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
