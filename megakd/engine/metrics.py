"""Run outputs on rank 0: metrics.jsonl, TensorBoard, optional wandb (offline by default), plots."""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
from pathlib import Path

from megakd.store.files import StoreError

log = logging.getLogger(__name__)


class MetricsWriter:
    """Appends one JSON object per logged step and mirrors scalars to TensorBoard / wandb."""

    def __init__(self, run_dir: Path, *, tensorboard: bool, wandb: bool, wandb_project: str,
                 wandb_mode: str, config: dict, resume_step: int = 0):
        self.path = run_dir / "metrics.jsonl"
        if self.path.exists():  # only a resumed run finds one (a new run starts in an unused run dir)
            self._truncate_after(resume_step)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=resume_step or None)
        self.wandb = None
        if wandb:
            import wandb as wandb_lib

            # WANDB_MODE in the environment (e.g. set by a cluster profile) wins over run.wandb_mode.
            self.wandb = wandb_lib.init(project=wandb_project, dir=str(run_dir), config=config,
                                        id=wandb_run_id(run_dir), resume="allow", name=run_dir.name,
                                        mode=os.environ.get("WANDB_MODE", wandb_mode))

    def _truncate_after(self, step: int) -> None:
        """On resume, drop lines logged after the checkpoint so the file has no duplicated steps.

        A last line cut short by a crash mid-write is dropped with a warning; a damaged line
        anywhere else is an error naming the file and line.
        """
        lines = [ln for ln in self.path.read_text(errors="replace").splitlines() if ln.strip()]
        records = []
        for number, line in enumerate(lines, 1):
            try:
                records.append((line, json.loads(line)))
            except json.JSONDecodeError:
                if number == len(lines):
                    log.warning("%s: dropped a torn last line (the previous job stopped while writing it)", self.path)
                    continue
                raise StoreError(f"{self.path}: line {number} is not JSON; repair or remove the line to resume") from None
        kept = [line for line, record in records if record.get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(ln + "\n" for ln in kept))
        tmp.replace(self.path)

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                if self.tb is not None:
                    self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(record, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def strict_json(record: dict) -> dict:
    """NaN and ±inf become null: metrics.jsonl stays standard JSON that any parser reads."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


WANDB_ID_FILE = "wandb_run_id"


def wandb_run_id(run_dir: Path) -> str:
    """The run dir's wandb id, created on its first run: a requeued job continues the same wandb run."""
    path = run_dir / WANDB_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    run_id = secrets.token_hex(8)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(run_id + "\n")
    tmp.replace(path)
    return run_id


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]


def plot_metrics(metrics_path: Path, out_dir: Path) -> list[Path]:
    """loss.png (generator and discriminator losses), rtd.png (RTD F1 and accuracies), probe.png (probe_acc)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    if not records:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    panels = {
        "loss.png": ("loss", ["gen_loss", "disc_loss", "val_gen_loss", "val_disc_loss"]),
        "rtd.png": ("score", ["rtd_f1", "rtd_precision", "rtd_recall", "gen_acc", "disc_acc", "val_rtd_f1",
                              "val_rtd_auc", "val_gen_acc", "val_teacher_agreement"]),
        "probe.png": ("downstream probe accuracy", ["probe_acc"]),
    }
    for name, (ylabel, keys) in panels.items():
        keys = [k for k in keys if any(k in r for r in records)]
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for key in keys:
            pts = [(r["step"], r[key]) for r in records if key in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=key)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
