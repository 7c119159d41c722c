"""What a fine-tuning score is judged against, printed beside it: the same architecture from random init and
the tf-idf + logistic-regression floor on the same task and split (docs/finetuning.md).

Both are recorded per user under `$MEGAKD_CACHE/baselines/` (default `~/.cache/megakd`), keyed by
what decides them. The tf-idf floor depends only on the task section: `tools/baseline_tfidf.py`
records it (deterministic; about a minute for Rotten Tomatoes on 2 cores, too long to add to every
fine-tuning run). A random-init score depends on everything but the weights: every `model.init=random` run records its
score under a key of the task, fine-tuning and objective settings and the model's description files
(architecture and tokenizer, not weights); a pretrained run with the same key shows it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from megakd.config import TaskConfig
from megakd.configio import config_to_dict
from megakd.finetune.config import FinetuneConfig

log = logging.getLogger(__name__)

DESCRIPTION_SUFFIXES = (".json", ".yaml", ".yml", ".txt", ".model", ".vocab")  # not weights
DESCRIPTION_LIMIT = 16 << 20  # bytes: a tokenizer model or vocabulary, never a weight file


def cache_dir() -> Path:
    return Path(os.environ.get("MEGAKD_CACHE", "~/.cache/megakd")).expanduser() / "baselines"


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _description(path: str) -> dict[str, str]:
    """sha256 of each small description file directly in the model directory (config, tokenizer)."""
    root = Path(path)
    if not path or not root.is_dir():
        return {}
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())
            if p.is_file() and p.suffix in DESCRIPTION_SUFFIXES and p.stat().st_size <= DESCRIPTION_LIMIT}


def random_init_key(cfg: FinetuneConfig) -> str:
    """Everything that decides a score except the weights: the config without run.* and model.init, and the
    model directory's description files (so the same architecture and tokenizer, wherever it lies)."""
    settings = config_to_dict(cfg)
    settings.pop("run", None)
    settings["model"] = {k: v for k, v in settings["model"].items() if k not in ("init", "path")}
    return _digest({"settings": settings, "model": _description(cfg.model.path)})


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write(path: Path, record: dict) -> None:
    """Atomically (a concurrent reader sees the old file or the new one), best effort: a cache."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(path)
    except OSError as err:
        log.warning("%s: could not cache a baseline (%s)", path, err)


def tfidf_path(task: TaskConfig) -> Path:
    return cache_dir() / f"tfidf-{task.name}-{_digest(config_to_dict(task))}.json"


def cache_tfidf_floor(task: TaskConfig, result: dict) -> Path:
    """Record `tfidf_baseline(task)` (tools/baseline_tfidf.py does, with the default features)."""
    path = tfidf_path(task)
    _write(path, result)
    return path


def tfidf_floor(cfg: FinetuneConfig) -> dict | None:
    """The tf-idf floor's dev metrics for the task, when recorded (None otherwise, and for regression)."""
    if cfg.task.num_labels < 2:
        return None
    cached = _read(tfidf_path(cfg.task))
    return cached["dev"] if cached is not None else None


def random_init_score(cfg: FinetuneConfig, summary: dict) -> dict | None:
    """A random-init run records its score; a pretrained run gets the recorded one with the same key, if any."""
    path = cache_dir() / f"random-{cfg.task.name}-{random_init_key(cfg)}.json"
    metric = summary["headline"]
    if cfg.model.init == "random":
        _write(path, {"metric": metric, **summary["metrics"][metric], "run_dir": cfg.run.dir})
        return None
    record = _read(path)
    return record if record is not None and record.get("metric") == metric else None


def baseline_report(cfg: FinetuneConfig, summary: dict) -> str:
    """The headline score beside random init and the tf-idf floor, as far as they are known."""
    metric = summary["headline"]
    score = summary["metrics"][metric]
    source = "random init" if cfg.model.init == "random" else cfg.model.path
    lines = [f"{cfg.task.name} {metric}: {score['mean']:.4f} ± {score['std']:.4f} over {len(score['values'])} "
             f"seed(s) ({source})"]
    if cfg.model.init == "random":
        random_init_score(cfg, summary)
        lines.append("  random init: this run (recorded: a pretrained run of the same model shape, tokenizer and "
                     "settings will show it)")
    elif (random := random_init_score(cfg, summary)) is not None:
        lines.append(f"  random init: {random['mean']:.4f} ± {random['std']:.4f} over {len(random['values'])} "
                     f"seed(s) (run {random['run_dir']}); {100 * (score['mean'] - random['mean']):+.1f} points")
    else:
        lines.append("  random init: not measured with these settings (the same command with model.init=random "
                     "and another run.dir measures it once; later runs show it here)")
    floor = tfidf_floor(cfg)
    if floor is not None and metric in floor:
        lines.append(f"  tf-idf floor: {floor[metric]:.4f} (megakd/finetune/tfidf.py, same task and split); "
                     f"{100 * (score['mean'] - floor[metric]):+.1f} points")
    elif cfg.task.num_labels >= 2:
        lines.append("  tf-idf floor: not recorded for this task; python tools/baseline_tfidf.py -c CONFIG with the "
                     "same task.* overrides computes it once (about a minute for rt on 2 cores)")
    return "\n".join(lines)
