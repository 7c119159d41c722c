"""Run outputs on rank 0: metrics.jsonl, TensorBoard, optional wandb (offline by default), plots."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


class MetricsWriter:
    """Appends one JSON object per logged step and mirrors scalars to TensorBoard / wandb."""

    def __init__(self, run_dir: Path, *, tensorboard: bool, wandb: bool, wandb_project: str,
                 wandb_mode: str, config: dict, resume_step: int = 0):
        self.path = run_dir / "metrics.jsonl"
        if resume_step and self.path.exists():
            self._truncate_after(resume_step)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=resume_step or None)
        self.wandb = None
        if wandb:
            import wandb as wandb_lib

            os.environ.setdefault("WANDB_MODE", wandb_mode)
            self.wandb = wandb_lib.init(project=wandb_project, dir=str(run_dir), config=config,
                                        resume="allow", name=run_dir.name)

    def _truncate_after(self, step: int) -> None:
        """On resume, drop lines logged after the checkpoint so the file has no duplicated steps."""
        lines = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
        kept = [ln for ln in lines if json.loads(ln).get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(ln + "\n" for ln in kept))
        tmp.replace(self.path)

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
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
        "loss.png": ("loss", ["gen_loss", "disc_loss"]),
        "rtd.png": ("score", ["rtd_f1", "rtd_precision", "rtd_recall", "gen_acc", "disc_acc"]),
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
