"""What the jobs run, module-level so that a worker process can import them: a pretraining run cached by
its resolved config, a fine-tuning run in a scratch directory; and how the findings read what they leave.

A pretraining run is cached under `WORK/pretrained/<hash of its resolved config>/` and reused by every
later job or invocation that asks for the same one; a lock file beside it makes sure two processes never
train the same run at once. Fine-tuning runs go to scratch directories that are deleted once read; a
model kept as a later run's teacher is copied out first (`megakd.repro` deletes those when the
invocation ends).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from megakd.config import Config, load_config
from megakd.engine.pretrain import run_distill, run_pretraining
from megakd.engine.runlog import read_metrics
from megakd.errors import UserError
from megakd.finetune.config import FinetuneConfig
from megakd.finetune.jobs import finetune as run_finetuning
from megakd.repro.settings import SILENT_RUN

log = logging.getLogger(__name__)


def pretrain(recipe: str | Path, overrides: list[str], work: Path, distill: bool = False) -> Path:
    """The run dir of a finished pretraining (or, with `distill`, DWT) run of `recipe` + `overrides`.

    Cached by the resolved config (its `run.dir` aside): a second call with the same settings
    returns the same directory without training; a call while another process trains that run
    waits for it, then returns it.
    """
    run_dir = cached_run_dir(recipe, overrides, work)
    with _locked(run_dir.with_name(run_dir.name + ".lock")):
        if (run_dir / "repro-done").is_file():
            return run_dir
        if run_dir.exists():  # an interrupted earlier attempt: start it over
            shutil.rmtree(run_dir)
        cfg = load_config(recipe, [*SILENT_RUN, *overrides, f"run.dir={run_dir}"])
        log.info("repro: pretraining %s %s -> %s", Path(recipe).name, " ".join(overrides), run_dir)
        if (run_distill if distill else run_pretraining)(cfg).stopped:  # not done: the next attempt starts over
            raise UserError(f"{run_dir}: stopped on a signal before the pretraining finished")
        (run_dir / "repro-done").write_text(json.dumps({"recipe": str(recipe), "overrides": overrides}) + "\n")
    return run_dir


def finetune(config: str | Path, overrides: list[str], work: Path, kept: str | None = None) -> dict:
    """`megakd finetune -c config overrides...` in a scratch dir under `work`; its summary.

    `kept`: copy the run's `seed_<s>/model` (its only seed) there, for runs whose model is a later
    run's teacher.
    """
    scratch = Path(tempfile.mkdtemp(prefix="finetune-", dir=work))
    cfg: FinetuneConfig = load_config(config, [*overrides, f"run.dir={scratch / 'run'}", "run.progress_bar=false"],
                                      cls=FinetuneConfig)
    try:
        outcome = run_finetuning(cfg)
        if outcome.stopped:
            raise UserError(f"{scratch}: stopped on a signal before the fine-tuning finished")
        summary = outcome.summary
        if kept:
            (seed,) = cfg.finetune.seeds
            shutil.copytree(scratch / "run" / f"seed_{seed}" / "model", kept, dirs_exist_ok=True)
    finally:
        shutil.rmtree(scratch)
    return summary


def cached_run_dir(recipe: str | Path, overrides: list[str], work: Path) -> Path:
    """Where `pretrain` keeps the run of `recipe` + `overrides` (finished if it holds `repro-done`)."""
    cfg: Config = load_config(recipe, [*SILENT_RUN, *overrides, "run.dir=_"])
    return work / "pretrained" / digest(config_tree(cfg))


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created if missing) for the block, across processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def digest(tree: object) -> str:
    """A short hash of plain data: equal settings, equal name (a cached run's directory, a job's key)."""
    return hashlib.sha256(json.dumps(tree, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_tree(obj: object) -> object:
    """A config tree as plain data, without `run.dir` (where the run goes does not change what it computes)."""
    if hasattr(obj, "__dataclass_fields__"):
        out = {k: config_tree(getattr(obj, k)) for k in obj.__dataclass_fields__}
        if "dir" in out and "keep_last" in out:
            del out["dir"]
        return out
    if isinstance(obj, (list, tuple)):
        return [config_tree(v) for v in obj]
    return obj


def metric_rows(run_dir: Path) -> list[dict]:
    """The logged rows of a pretraining run `pretrain` returned."""
    return read_metrics(run_dir / "metrics.jsonl")


def last_value(rows: list[dict], key: str) -> float:
    return [r[key] for r in rows if key in r][-1]


def seed_values(summary: dict, metric: str = "accuracy") -> list[float]:
    """Per-seed values of `metric` in a fine-tuning summary, in seed order."""
    return list(summary["metrics"][metric]["values"])
