"""What the findings share: pretraining and fine-tuning runs through the public entry points, a cache
of pretrained encoders, the cost estimate, and the quick-mode sizes.

A pretraining run is cached under `WORK/pretrained/<hash of its resolved config>/` and reused by
every finding that asks for the same one (`megakd repro all` pretrains the shared encoder once);
fine-tuning runs go to scratch directories that are deleted once read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from megakd.config import Config, load_config
from megakd.engine.metrics import read_metrics
from megakd.engine.pretrain import run_distill, run_pretraining
from megakd.finetune.config import FinetuneConfig
from megakd.finetune.jobs import run_job

log = logging.getLogger(__name__)

CONFIGS = Path(__file__).parents[2] / "configs"
PRETRAIN_RECIPE = CONFIGS / "electra-mini.yaml"  # the recipe meant to pay off downstream
FINETUNE_RT = CONFIGS / "finetune-rt.yaml"
SILENT_RUN = ("run.export_hf=false", "run.plots=false", "run.tensorboard=false", "run.progress_bar=false",
              "train.save_every=0", "run.keep_last=1")

# --quick: 1-layer, 32-wide models for a few steps, fine-tuned on 1,000 RT sentences for two epochs.
QUICK_PRETRAIN = (
    "train.max_steps=12", "train.global_batch_size=8", "train.micro_batch_size=8", "optim.schedule.warmup_steps=2",
    "train.log_every=1", "train.probe_every=0",
    *(f"model.{m}.{k}={v}" for m in ("generator", "discriminator")
      for k, v in (("num_layers", 1), ("hidden_size", 32), ("intermediate_size", 64), ("embedding_size", 32),
                   ("num_heads", 2))),
)
# Full mode fine-tunes on 3,000 of RT's 9,071 training sentences (an even spread; dev whole), so the
# six findings fit the report's 3-hour budget (README, "Reproducing the papers' findings").
FULL_FINETUNE = ("task.max_train_examples=3000",)
QUICK_FINETUNE = ("task.max_train_examples=1000", "task.max_dev_examples=500", "finetune.epochs=2")
FULL_NOTE = " Fine-tuning used 3,000 of RT's training sentences (an even spread) and the whole dev split."
QUICK_NOTE = (" Quick mode: a 1-layer, 32-wide encoder pretrained for 12 steps, fine-tuned on 1,000 RT sentences "
              "(500 dev sentences): a structure check rather than a measurement.")


def recipe_value(recipe: str | Path, key: str, overrides: tuple[str, ...] = (), cls: type = Config) -> object:
    """A dotted key's value in a recipe (a `cls` config) after `overrides` (e.g. its discriminator LR)."""
    value: object = load_config(recipe, list(overrides), cls=cls)
    for part in key.split("."):
        value = getattr(value, part)
    return value


def metric_rows(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / "metrics.jsonl")


def tail_mean(rows: list[dict], key: str, fraction: float = 0.1) -> float:
    """Mean of `key` over the logged steps in the last `fraction` of the run (at least one row)."""
    values = [r[key] for r in rows if key in r]
    if not values:
        raise KeyError(f"no logged step has {key!r}")
    tail = values[-max(1, round(fraction * len(values))):]
    return sum(tail) / len(tail)


def last_value(rows: list[dict], key: str) -> float:
    return [r[key] for r in rows if key in r][-1]


@dataclass
class Costs:
    """Measured seconds per unit of work (a pretraining step, one seed's fine-tuning epoch) and the
    finding's planned units, so the log says after every job how long the whole finding should take."""

    finding: str
    planned: dict[str, float]  # kind -> units the finding will run in total
    done: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def record(self, kind: str, units: float, seconds: float) -> None:
        self.done[kind] = self.done.get(kind, 0.0) + units
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
        rates = {k: self.seconds[k] / self.done[k] for k in self.done if self.done[k]}
        if not set(rates) >= {k for k, units in self.planned.items() if units}:
            log.info("repro %s: %s took %.0f s (%.3g s per unit); the estimate follows once every kind of job has "
                     "run", self.finding, kind, seconds, seconds / units)
            return
        kinds = [k for k in self.planned if k in rates]
        remaining = sum(max(0.0, self.planned[k] - self.done[k]) * rates[k] for k in kinds)
        total = sum(self.planned[k] * rates[k] for k in kinds)
        log.info("repro %s: estimated %.1f min in all at the speed measured so far (%s); %.1f min to go",
                 self.finding, total / 60, ", ".join(f"{rates[k]:.3g} s per {k}" for k in kinds), remaining / 60)


def pretrain(recipe: str | Path, overrides: list[str], work: Path, costs: Costs | None = None,
             distill: bool = False) -> Path:
    """The run dir of a finished pretraining (or, with `distill`, DWT) run of `recipe` + `overrides`.

    Cached by the resolved config (its `run.dir` aside): a second call with the same settings
    returns the same directory without training.
    """
    run_dir = cached_run_dir(recipe, overrides, work)
    if (run_dir / "repro-done").is_file():
        return run_dir
    if run_dir.exists():  # an interrupted earlier attempt: start it over
        shutil.rmtree(run_dir)
    cfg = load_config(recipe, [*SILENT_RUN, *overrides, f"run.dir={run_dir}"])
    log.info("repro: pretraining %s %s -> %s", Path(recipe).name, " ".join(overrides), run_dir)
    start = time.monotonic()
    (run_distill if distill else run_pretraining)(cfg)
    if costs is not None:
        costs.record("pretraining step", cfg.train.max_steps, time.monotonic() - start)
    (run_dir / "repro-done").write_text(json.dumps({"recipe": str(recipe), "overrides": overrides}) + "\n")
    return run_dir


def cached_run_dir(recipe: str | Path, overrides: list[str], work: Path) -> Path:
    """Where `pretrain` keeps the run of `recipe` + `overrides` (finished if it holds `repro-done`)."""
    cfg: Config = load_config(recipe, [*SILENT_RUN, *overrides, "run.dir=_"])
    digest = hashlib.sha256(json.dumps(_as_dict(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]
    return work / "pretrained" / digest


def _as_dict(obj: object) -> object:
    """A config tree as plain data, without `run.dir` (where the run goes does not change what it computes)."""
    if hasattr(obj, "__dataclass_fields__"):
        out = {k: _as_dict(getattr(obj, k)) for k in obj.__dataclass_fields__}
        if "dir" in out and "keep_last" in out:
            del out["dir"]
        return out
    if isinstance(obj, (list, tuple)):
        return [_as_dict(v) for v in obj]
    return obj


def finetune(overrides: list[str], work: Path, costs: Costs | None = None, config: str | Path = FINETUNE_RT,
             keep: str = "") -> dict:
    """`megakd finetune -c config overrides...` in a scratch dir under `work`; its summary.

    `keep`: a path relative to the run dir (e.g. `seed_0/model`) copied to `work/kept/<name>` and
    returned in the summary as `kept`, for runs whose model is a later run's teacher.
    """
    scratch = Path(tempfile.mkdtemp(prefix="finetune-", dir=work))
    cfg: FinetuneConfig = load_config(config, [*overrides, f"run.dir={scratch / 'run'}", "run.progress_bar=false"],
                                      cls=FinetuneConfig)
    start = time.monotonic()
    try:
        summary = run_job(cfg)
        if keep:
            kept = Path(tempfile.mkdtemp(prefix="model-", dir=work))
            shutil.copytree(scratch / "run" / keep, kept, dirs_exist_ok=True)
            summary["kept"] = str(kept)
    finally:
        shutil.rmtree(scratch)
    if costs is not None:
        models = 2 if cfg.soteacher.enabled and cfg.soteacher.distill_student else 1  # teacher, then student
        costs.record("fine-tuning epoch", models * cfg.finetune.epochs * len(cfg.finetune.seeds),
                     time.monotonic() - start)
    return summary


def seed_values(summary: dict, metric: str = "accuracy") -> list[float]:
    """Per-seed values of `metric` in a fine-tuning summary, in seed order."""
    return list(summary["metrics"][metric]["values"])


def base_overrides(quick: bool) -> list[str]:
    """The shared encoder that fine-tuning findings start from: the recipe as it stands (quick: tiny sizes)."""
    return list(QUICK_PRETRAIN) if quick else []


def base_steps_to_run(recipe: str | Path, quick: bool, work: Path) -> int:
    """Pretraining steps the shared encoder still costs: 0 once an earlier finding has trained it."""
    overrides = base_overrides(quick)
    if (cached_run_dir(recipe, overrides, work) / "repro-done").is_file():
        return 0
    return int(recipe_value(recipe, "train.max_steps", tuple(overrides)))


def base_encoder(recipe: str | Path, quick: bool, work: Path, costs: Costs | None = None) -> Path:
    """The shared encoder's run dir, pretrained now unless cached."""
    return pretrain(recipe, base_overrides(quick), work, costs)


def seeds_override(seeds: tuple[int, ...]) -> str:
    return f"finetune.seeds=[{','.join(map(str, seeds))}]"
