"""One fine-tuning training (a seed, or an LR-selection trial) on the training loop.

One seed: AdaMax (β (0.9, 0.98), ε 1e-6, coupled L2 weight decay on matrices only, as torch's
Adamax implements it; or AdamW with layer-wise LR decay, `finetune.optimizer` and
`finetune.layer_lr_decay`, ELECTRA's GLUE setting), linear warm-up over `warmup_frac` of the
optimizer steps then linear decay to 0 (`megakd.engine.optim.build_scheduler`), gradient clipping
at 1.0, dropout 0.1, dev evaluation after every epoch. The batch order of epoch e is `randperm` from
a generator seeded with (seed, e), so a seed reproduces bit-for-bit on CPU. `finetune.batch_size` is the global batch,
split over the data-parallel ranks of the backend (megakd/finetune/runtime.py).

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
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from megakd.config import ScheduleConfig
from megakd.configio import save_config
from megakd.data.tasks import EncodedTask
from megakd.data.tokenizer import Tokenizer
from megakd.engine.hooks import Hook, StepEnd
from megakd.engine.loop import Checkpointer, LoopPlan, RandomStreams, TrainingLoop
from megakd.engine.optim import build_scheduler
from megakd.engine.run import Stopped
from megakd.engine.runlog import MetricsWriter
from megakd.engine.units import StepInput, Unit
from megakd.finetune.config import FinetuneConfig
from megakd.finetune.layout import UNIT, ClassifierLayout, ClassifierLoss
from megakd.finetune.objectives import Objective
from megakd.finetune.optim import build_optimizer
from megakd.finetune.predict import predict
from megakd.finetune.progress import Trainings, training_steps
from megakd.finetune.runtime import Runtime
from megakd.finetune.scores import task_metrics
from megakd.models.electra import SequenceClassifier
from megakd.store import checkpoint
from megakd.store.files import StoreError
from megakd.store.model_dir import save_classifier

log = logging.getLogger(__name__)


MAX_BAD_STEPS = 10  # non-finite losses in a row before the run stops
RESULT_FILE = "result.json"  # written last: a training directory with it is finished


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
        root = self.loop.checkpointer.root
        found = self.runtime.run.newest_checkpoint(root)
        if found is None:
            return
        self.loop.checkpointer.load(found, resharding=False)
        log.info("%s: resumed at step %d of %d", root, self.loop.progress.step, self.total)

    def run(self) -> np.ndarray | None:
        """Train to the last step; returns the eval split's logits of the last epoch (None if it ended
        before this process started, on a checkpoint at the very end). A stop signal raises `Stopped`
        after the checkpoint."""
        end = self.loop.run()
        if end.stopped:
            raise Stopped(self.loop.progress.step, end.interrupted)
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


def train_seed(cfg: FinetuneConfig, seed: int, model: SequenceClassifier, tokenizer: Tokenizer,
               train: EncodedTask, dev: EncodedTask, objective: Objective, out_dir: Path,
               lr: float, runtime: Runtime, eval_split: str = "dev", label: str = "",
               runs: Trainings | None = None) -> SeedResult:
    """Train `model` with `objective` for `finetune.epochs` epochs at peak rate `lr` (see `run_seeds`).

    Evaluates on `dev` after every epoch; its metrics are logged as `<eval_split>_<metric>`. For the
    real dev split this writes the dev logits and the model; an LR-selection trial
    (`eval_split="slice"`, `dev` a slice of train) writes only its metrics. `label` names it in the log
    ("" = "<task> seed <seed>"); `runs` counts it among the command's trainings.
    """
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
