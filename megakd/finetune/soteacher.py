"""SoTeacher (docs/methods.md § SoTeacher): train a student-oriented teacher, then distill a student from it.

Teacher loss: CE + λ_LR·Σ Lip₁ + λ_CR(t)·MSE(p, p̄), with p̄ the running mean of the same
example's predictions in earlier epochs. The running means live in a `ConsistencyStore`: two
numpy memmap files in the seed's run directory (`cr_store/mean.npy` float64 [N, K] and
`cr_store/count.npy` int64 [N]), keyed by the example's stable index, so the buffer costs no RAM
and survives the process (a 128K-example task with 3 classes is 3 MB). As in the authors' code,
predictions are recorded from the ordinary training forward pass (dropout on), the store is
updated after the loss with weight 1/(1+count) (an exact running mean, since each example is seen
once per epoch), and CR is skipped in the first epoch. λ_CR(t) uses the 1-based epoch number
t = 1..T, T = `finetune.epochs` (the papers' λ_CR(t) = (t/T)·λ_max), so the last epoch trains
with exactly λ_max under every schedule.

The student is trained with label-regularisation KD from each seed's teacher, RepDistiller's
convention (docs/methods.md § The KD family): α·CE + (1−α)·τ²·KL(p^t_τ ‖ p^s_τ),
α = `soteacher.student_alpha` (0.5), τ =
`soteacher.student_temperature` (4). Reports (`summary.json`): the teacher's dev metrics, its ECE
and NLL with and without temperature scaling (T fitted by minimum NLL on the dev examples at even
positions, ECE/NLL reported on the odd ones), the student's dev metrics and the student–teacher
top-1 agreement on dev, each as mean ± std over `finetune.seeds`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from numpy.lib.format import open_memmap
from torch import Tensor

from megakd.config import ConfigError
from megakd.data.tasks import EncodedTask
from megakd.data.tokenizer import Tokenizer
from megakd.finetune.config import FinetuneConfig, SoTeacherConfig
from megakd.finetune.objectives import LabelregObjective, teacher_logits_for
from megakd.finetune.runtime import Runtime
from megakd.finetune.scores import agreement, calibration_report
from megakd.finetune.trainer import run_seeds, summarize
from megakd.finetune.training import SeedResult
from megakd.models.electra import SequenceClassifier
from megakd.objectives.soteacher import consistency_loss, cr_weight_for_epoch, lipschitz_penalty

log = logging.getLogger(__name__)


class ConsistencyStore:
    """Per-example running mean of predicted probabilities, in memory-mapped files under `directory`.

    `create=True` starts an empty store (replacing an old one); `create=False` reopens an existing
    one and checks its shape. `directory=None` keeps the arrays in memory (the copies that ranks
    other than 0 keep under data parallelism).
    """

    def __init__(self, directory: str | Path | None, num_examples: int, num_classes: int, create: bool = True):
        if directory is None:
            self.mean = np.zeros((num_examples, num_classes), dtype=np.float64)
            self.count = np.zeros(num_examples, dtype=np.int64)
            return
        self.directory = Path(directory)
        mean_path, count_path = self.directory / "mean.npy", self.directory / "count.npy"
        if create:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.mean = open_memmap(mean_path, mode="w+", dtype=np.float64, shape=(num_examples, num_classes))
            self.count = open_memmap(count_path, mode="w+", dtype=np.int64, shape=(num_examples,))
            return
        if not (mean_path.is_file() and count_path.is_file()):
            raise ConfigError(f"{self.directory}: no consistency store (expected mean.npy and count.npy)")
        self.mean = open_memmap(mean_path, mode="r+")
        self.count = open_memmap(count_path, mode="r+")
        if self.mean.shape != (num_examples, num_classes) or self.count.shape != (num_examples,):
            raise ConfigError(f"{mean_path}: shape {self.mean.shape}, expected ({num_examples}, {num_classes})")

    def targets(self, index: Tensor) -> tuple[Tensor, Tensor]:
        """(running means [B, K] float64, whether each example has any recorded prediction [B])."""
        idx = index.numpy()
        return torch.from_numpy(np.array(self.mean[idx])), torch.from_numpy(self.count[idx] > 0)

    def update(self, index: Tensor, probs: Tensor) -> None:
        """mean ← mean + (p − mean)/(count + 1); count ← count + 1 (indices in a batch are distinct)."""
        idx = index.numpy()
        p = probs.detach().double().numpy()
        count = self.count[idx]
        self.mean[idx] = self.mean[idx] + (p - self.mean[idx]) / (count + 1)[:, None]
        self.count[idx] = count + 1

    def flush(self) -> None:
        if isinstance(self.mean, np.memmap):
            self.mean.flush()
            self.count.flush()

    def state_dict(self) -> dict[str, Tensor]:
        return {"mean": torch.from_numpy(np.array(self.mean)), "count": torch.from_numpy(np.array(self.count))}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.mean[:] = state["mean"].numpy()
        self.count[:] = state["count"].numpy()


class SoTeacherObjective:
    """CE + λ_LR·Lipschitz penalty + λ_CR(t)·consistency, recording predictions into the store.

    `gather(batch, probs)` returns the stable indices and predictions of every row of the step's
    global batch (data parallelism: each rank keeps a whole store, since an example's earlier
    predictions may have been made on another rank); by default the batch is the global batch.
    """

    def __init__(self, cfg: SoTeacherConfig, store: ConsistencyStore, num_epochs: int, kernels_backend: str = "auto",
                 gather: Callable[[dict[str, Tensor], Tensor], tuple[Tensor, Tensor]] | None = None):
        self.cfg, self.store, self.num_epochs, self.backend = cfg, store, num_epochs, kernels_backend
        self.gather = gather or (lambda batch, probs: (batch["index"], probs))

    def loss(self, model: SequenceClassifier, batch: dict[str, Tensor], epoch: int
             ) -> tuple[Tensor, Tensor, dict[str, float]]:
        logits = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        ce = F.cross_entropy(logits, batch["labels"])
        loss = ce
        logs = {"ce": ce.item()}
        if self.cfg.lambda_lr > 0:
            lip = lipschitz_penalty(model, self.backend)
            loss = loss + self.cfg.lambda_lr * lip
            logs["lipschitz"] = lip.item()
        probs = F.softmax(logits, dim=-1)
        lam = cr_weight_for_epoch(self.cfg.cr_schedule, epoch, self.num_epochs, self.cfg.lambda_cr)
        if epoch > 0 and lam > 0:
            targets, has = self.store.targets(batch["index"].cpu())
            cr = consistency_loss(probs, targets.to(probs.device), has.to(probs.device))
            loss = loss + lam * cr
            logs.update(cr=cr.item(), lambda_cr=lam)
        index, all_probs = self.gather(batch, probs.detach())
        self.store.update(index.cpu(), all_probs.cpu())
        return loss, logits, logs

    def state_dict(self) -> dict[str, Tensor]:
        return self.store.state_dict()

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.store.load_state_dict(state)


def _calibration(results: list[SeedResult], dev: EncodedTask) -> dict[str, list[float]]:
    labels = dev.labels.numpy()
    fit_rows = np.arange(0, len(labels), 2)
    reports = [calibration_report(r.dev_logits, labels, fit_rows) for r in results]
    return {k: [rep[k] for rep in reports] for k in reports[0]}


def gather_rows(runtime: Runtime) -> Callable[[dict[str, Tensor], Tensor], tuple[Tensor, Tensor]]:
    """`SoTeacherObjective.gather` over the data-parallel ranks: every rank gets the whole global batch.

    Rank r's real rows go to their place in the global batch (`offset`, `real`) of a zero tensor,
    and a sum over ranks assembles the batch in its one-process order (float64; indices are exact).
    """
    if runtime.world_size == 1:
        return lambda batch, probs: (batch["index"], probs)

    def gather(batch: dict[str, Tensor], probs: Tensor) -> tuple[Tensor, Tensor]:
        offset, real, rows = int(batch["offset"]), int(batch["real"]), int(batch["batch_rows"])
        full = torch.zeros(rows, 1 + probs.shape[1], dtype=torch.float64)
        full[offset: offset + real, 0] = batch["index"][:real].cpu().double()
        full[offset: offset + real, 1:] = probs[:real].cpu().double()
        full = runtime.sum(full)
        return full[:, 0].long(), full[:, 1:]

    return gather


def run_soteacher(cfg: FinetuneConfig, runtime: Runtime) -> dict:
    """Teacher (SoTeacher loss) for every seed, then (unless disabled) a KD student per teacher."""
    run_dir = runtime.run_dir
    s = cfg.soteacher
    stores: list[ConsistencyStore] = []

    def make_teacher_objective(seed: int, model: SequenceClassifier, tokenizer: Tokenizer, train: EncodedTask,
                               out_dir: Path) -> SoTeacherObjective:
        stores.append(ConsistencyStore(out_dir / "cr_store" if runtime.is_main else None,
                                       int(train.indices.max()) + 1, cfg.task.num_labels))
        return SoTeacherObjective(s, stores[-1], cfg.finetune.epochs, cfg.kernels.backend, gather_rows(runtime))

    teachers, _, dev, teacher_lr = run_seeds(cfg, run_dir / "teacher", cfg.model, make_teacher_objective, runtime,
                                             name=f"{cfg.task.name} teacher")
    for store in stores:
        store.flush()
    summary = {"teacher": summarize(teachers, run_dir / "teacher", cfg.metric, _calibration(teachers, dev), teacher_lr,
                                    write=runtime.is_main)}
    if s.distill_student:
        teacher_dirs = {r.seed: r.model_dir for r in teachers}
        kd = dataclasses.replace(cfg.labelreg, target="kd", alpha=1 - s.student_alpha,
                                 temperature=s.student_temperature, tau_squared=True)

        def make_student_objective(seed: int, model: SequenceClassifier, tokenizer: Tokenizer,
                                   train: EncodedTask, out_dir: Path) -> LabelregObjective:
            logits = teacher_logits_for(str(teacher_dirs[seed]), "soteacher teacher", tokenizer, train,
                                        cfg.task.num_labels, cfg.finetune.eval_batch_size, runtime)
            return LabelregObjective(kd, cfg.task.num_labels, logits)

        students, _, _, student_lr = run_seeds(cfg, run_dir / "student", s.student, make_student_objective, runtime,
                                               name=f"{cfg.task.name} student")
        by_seed = {r.seed: r for r in teachers}
        agree = [agreement(r.dev_logits, by_seed[r.seed].dev_logits) for r in students]
        summary["student"] = summarize(students, run_dir / "student", cfg.metric, {"agreement": agree}, student_lr,
                                       write=runtime.is_main)
    if runtime.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
