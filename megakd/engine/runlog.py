"""Run outputs on rank 0: metrics.jsonl, TensorBoard, optional wandb (offline by default), plots."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import threading
from pathlib import Path

from megakd.configio import config_to_dict
from megakd.engine.hooks import Hook, StepEnd
from megakd.store.files import StoreError, human_bytes, is_disk_full

log = logging.getLogger(__name__)


class MetricsWriter(Hook):
    """Appends one JSON object per logged step and mirrors scalars to TensorBoard / wandb.

    As a hook (after the hooks that fill a step's lines) it writes each step's lines and closes at the end.
    """

    def __init__(self, run_dir: Path, *, tensorboard: bool, wandb: bool, wandb_project: str,
                 wandb_mode: str, config: dict, resume_step: int = 0):
        self.path = run_dir / "metrics.jsonl"
        # A full disk on a write here is recorded, not raised: the trainer reads `failure` as a stop
        # request, every rank stops at the next step's agreement, and the run ends with this one line
        # without saving (the last checkpoint is intact; --resume auto repeats the steps after it).
        self.failure: StoreError | None = None
        self.tb = None
        self._tb_file: Path | None = None
        if self.path.exists():  # only a resumed run finds one (a new run starts in an unused run dir)
            self._guard(self.path, f"rewriting it to resume at step {resume_step}",
                        lambda: self._truncate_after(resume_step))
        if tensorboard and self.failure is None:
            self._guard(run_dir / "tb", "creating its TensorBoard event file",
                        lambda: self._open_tensorboard(run_dir / "tb", resume_step))
        self.wandb = None
        if wandb:
            import wandb as wandb_lib

            # WANDB_MODE in the environment (e.g. set by a cluster profile) wins over run.wandb_mode.
            self.wandb = wandb_lib.init(project=wandb_project, dir=str(run_dir), config=config,
                                        id=wandb_run_id(run_dir), resume="allow", name=run_dir.name,
                                        mode=os.environ.get("WANDB_MODE", wandb_mode))

    @classmethod
    def for_run(cls, directory: Path, cfg, resume_step: int) -> MetricsWriter:
        """The writer a run's `run.*` settings ask for (pretraining's or fine-tuning's config), into `directory`."""
        r = cfg.run
        return cls(directory, tensorboard=r.tensorboard, wandb=r.wandb, wandb_project=r.wandb_project,
                   wandb_mode=r.wandb_mode, config=config_to_dict(cfg), resume_step=resume_step)

    def _open_tensorboard(self, tb_dir: Path, resume_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        _quiet_tensorboard_thread()
        before = set(tb_dir.glob("events.out.tfevents.*"))
        try:
            self.tb = SummaryWriter(log_dir=str(tb_dir), purge_step=resume_step or None)
        except Exception:
            for new in set(tb_dir.glob("events.out.tfevents.*")) - before:  # its empty or torn event file
                new.unlink(missing_ok=True)
            raise
        name = getattr(self.tb.file_writer.event_writer, "_file_name", None)
        self._tb_file = Path(name) if name else None

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
                raise StoreError(f"{self.path}: line {number} is not JSON; "
                                 "repair or remove the line to resume") from None
        kept = [line for line, record in records if record.get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        try:
            tmp.write_text("".join(ln + "\n" for ln in kept))
            tmp.replace(self.path)
        finally:
            tmp.unlink(missing_ok=True)

    def _guard(self, path: Path, what: str, action) -> bool:
        """Run `action()`; if the disk is full, set `failure` (one line naming `path`) and return False."""
        try:
            action()
            return True
        except Exception as err:
            if not is_disk_full(err):
                raise
            self.failure = StoreError(
                f"{path}: no space left on device while {what}; stopped without saving, the checkpoints and "
                "every earlier metrics line are intact: free some space and continue with --resume auto")
            return False

    def write(self, record: dict) -> None:
        """Append one line, whole or not at all, then mirror it to TensorBoard / wandb.

        After a full disk (`failure`) nothing more is written: the run is stopping.
        """
        if self.failure is not None:
            return
        step = record["step"]
        line = (json.dumps(strict_json(record), allow_nan=False) + "\n").encode()
        if not self._guard(self.path, f"appending the {human_bytes(len(line))} line of step {step}",
                           lambda: append_whole(self.path, line)):
            return
        if self.tb is not None:
            size = _size(self._tb_file)
            if not self._guard(self._tb_file or self.path.parent / "tb", f"writing the events of step {step}",
                               lambda: self._tensorboard(record, step)):
                self.tb = None  # its writer thread is dead; closing it would only retry the failed write
                if size is not None:
                    with contextlib.suppress(OSError):  # drop the torn record: the file ends at the last step
                        os.truncate(self._tb_file, size)
                return
        if self.wandb is not None:
            self.wandb.log(record, step=step)

    def _tensorboard(self, record: dict, step: int) -> None:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self.tb.add_scalar(key, value, step)
        self.tb.flush()  # on disk now, so a full disk shows here rather than in the writer's thread

    def after_step(self, end: StepEnd) -> None:
        for line in end.lines:
            if line:
                self.write(line)

    def end(self, step: int, finished: bool) -> None:
        self.close()

    def close(self) -> None:
        if self.tb is not None:
            self._guard(self._tb_file or self.path.parent / "tb", "closing the TensorBoard event file", self.tb.close)
        if self.wandb is not None:
            self.wandb.finish()


def append_whole(path: Path, data: bytes) -> None:
    """Append `data` to `path` in one `os.write`; if it fails (a full disk part-way through included) the
    file is cut back to its old length, so a reader never finds half of it."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        size = os.fstat(fd).st_size
        try:
            done = os.write(fd, data)
            while done < len(data):  # a short write: the next one says why (ENOSPC) or finishes it
                done += os.write(fd, data[done:])
        except BaseException:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def _quiet_tensorboard_thread() -> None:
    """TensorBoard's writer thread dies on a full disk and prints the traceback; the same error reaches
    `MetricsWriter.write` through `flush`, which reports it in one line, so the thread's copy is dropped."""
    previous = threading.excepthook
    if getattr(previous, "megakd_quiet", False):
        return

    def hook(args):
        if type(args.thread).__name__ == "_AsyncWriterThread" and is_disk_full(args.exc_value):
            return
        previous(args)

    hook.megakd_quiet = True
    threading.excepthook = hook


def _size(path: Path | None) -> int | None:
    try:
        return path.stat().st_size if path is not None else None
    except OSError:
        return None


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


def tail_mean(rows: list[dict], key: str, fraction: float = 0.1) -> float:
    """Mean of `key` over the logged steps in the last `fraction` of the run (at least one row)."""
    values = [r[key] for r in rows if key in r]
    if not values:
        raise KeyError(f"no logged step has {key!r}")
    tail = values[-max(1, round(fraction * len(values))):]
    return sum(tail) / len(tail)


# What the end-of-run summary averages over the last 10 % of logged steps (the figures the README quotes).
TAIL_KEYS = ("gen_loss", "gen_acc", "disc_loss", "rtd_f1", "rtd_precision", "rtd_recall", "kd_loss")


def summarize_run(metrics_path: Path) -> dict:
    """What a run learned, from its metrics.jsonl: the last-10 % averages of `TAIL_KEYS` (and the steps they
    span), the best value and step of every validation metric (losses lowest, scores highest), and the
    probe's last and best accuracy. Read after training: it changes nothing a run computes."""
    records = [r for r in read_metrics(metrics_path) if "step" in r]
    summary: dict = {"last_step": records[-1]["step"] if records else 0, "tail": {}, "best_val": {}, "probe": {}}
    logged = [r for r in records if any(k in r for k in TAIL_KEYS)]
    if logged:
        tail = logged[-max(1, round(0.1 * len(logged))):]
        summary["tail_steps"] = (tail[0]["step"], tail[-1]["step"], len(tail))
        summary["tail"] = {k: tail_mean(logged, k) for k in TAIL_KEYS if any(k in r for r in logged)}
    for key in sorted({k for r in records for k in r if k.startswith("val_")}):
        points = [(r[key], r["step"]) for r in records if r.get(key) is not None]
        if points:
            lowest_is_best = key.endswith("loss")
            summary["best_val"][key] = min(points) if lowest_is_best else max(points, key=lambda p: (p[0], -p[1]))
    probes = [(r["probe_acc"], r["step"]) for r in records if r.get("probe_acc") is not None]
    if probes:
        summary["probe"] = {"last": probes[-1], "best": max(probes, key=lambda p: (p[0], -p[1]))}
    return summary


# Each plot's panels, top to bottom: (y label, keys). A panel per scale: the discriminator's loss (~0.3-0.7)
# drawn on the generator's axis (~10 down to ~2) would look flat.
PLOT_PANELS = {
    "loss.png": [("generator loss", ["gen_loss", "val_gen_loss"]),
                 ("discriminator loss", ["disc_loss", "val_disc_loss"])],
    "rtd.png": [("score", ["rtd_f1", "rtd_precision", "rtd_recall", "gen_acc", "disc_acc", "val_rtd_f1",
                           "val_rtd_auc", "val_gen_acc", "val_teacher_agreement"])],
    "probe.png": [("downstream probe accuracy", ["probe_acc"])],
}


def metric_figures(records: list[dict], probe_chance: float | None = None) -> dict:
    """{file name: matplotlib Figure} for the plots `records` have data for (see PLOT_PANELS).

    probe.png spans accuracy 0 to 1 with the chance level drawn (`probe_chance`, when given) and the
    last probe's value written beside it: one probe (a short run) is otherwise a lone dot on an axis
    zoomed to it, which says nothing about how good it is.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {}
    for name, panels in PLOT_PANELS.items():
        panels = [(label, [k for k in keys if any(k in r for r in records)]) for label, keys in panels]
        panels = [(label, keys) for label, keys in panels if keys]
        if not panels:
            continue
        fig, axes = plt.subplots(len(panels), 1, figsize=(7, 1 + 3 * len(panels)), sharex=True, squeeze=False)
        for ax, (ylabel, keys) in zip(axes[:, 0], panels):
            for key in keys:
                pts = [(r["step"], r[key]) for r in records if key in r]
                # A point or two drawn as a bare line is invisible (a short run's one probe): mark sparse series.
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=key, marker="o" if len(pts) <= 20 else None)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        if name == "probe.png":
            ax = axes[0, 0]
            last = [(r["step"], r["probe_acc"]) for r in records if "probe_acc" in r][-1]
            ax.annotate(f"{last[1]:.3f}", last, textcoords="offset points", xytext=(6, 6))
            if probe_chance is not None:
                ax.axhline(probe_chance, color="gray", linestyle="--", label=f"chance ({probe_chance:.2f})")
            ax.set_ylim(0, 1)
            ax.set_xlim(0, 1.05 * max(r["step"] for r in records) + 1)  # the probes where they fell in the run
        for ax in axes[:, 0]:
            ax.legend()
        axes[-1, 0].set_xlabel("step")
        fig.tight_layout()
        figures[name] = fig
    return figures


def plot_metrics(metrics_path: Path, out_dir: Path, probe_chance: float | None = None) -> list[Path]:
    """Write `metric_figures` of a run's metrics.jsonl into out_dir: loss.png, rtd.png, probe.png."""
    records = read_metrics(metrics_path)
    if not records:
        return []
    figures = metric_figures(records, probe_chance)
    import matplotlib.pyplot as plt  # after metric_figures chose the Agg backend

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in figures.items():
        path = out_dir / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
