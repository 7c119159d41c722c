"""One finding being planned or run (`FindingRun`): the jobs it declares before anything runs, priced by
the cost model, and their results once they have run.

Every path a job writes is known when it is declared, so the whole finding (or `all`) is one dependency
graph that can be planned (`megakd repro NAME --plan`) and run in any order the dependencies allow. Jobs
with the same resolved settings are the same job: `all` pretrains the shared encoder once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megakd.config import Config, load_config
from megakd.finetune.config import FinetuneConfig
from megakd.repro.costs import Costs
from megakd.repro.jobs import Job, closure
from megakd.repro.report import FindingReport
from megakd.repro.settings import (
    FINETUNE_RT,
    FULL_NOTE,
    QUICK_NOTE,
    QUICK_PRETRAIN,
    QUICK_STUDENT_SIZES,
    SILENT_RUN,
    STUDENT_SIZES,
    Settings,
    finetuned_model,
    recipe_value,
    student_overrides,
)
from megakd.repro.training import cached_run_dir, config_tree, digest, finetune, pretrain

ReportFn = Callable[[], FindingReport]


@dataclass(frozen=True)
class PretrainRun:
    """A declared pretraining job and the run dir it will leave."""

    key: str
    path: Path


@dataclass(frozen=True)
class FinetuneRun:
    """A declared fine-tuning job; `kept` is where its kept model (if any) will be."""

    key: str
    kept: Path | None


@dataclass
class FindingRun:
    """One finding being planned or run: its settings, seeds and recipe, the jobs it declares, their results."""

    name: str
    quick: bool
    settings: Settings
    seeds: tuple[int, ...]
    recipe: Path
    work: Path
    out_dir: Path
    costs: Costs
    results: dict[str, object]  # job key -> return value, filled in by `megakd.repro.runner.execute`
    jobs: dict[str, Job] = field(default_factory=dict)
    _configs: dict[str, Config] = field(default_factory=dict)  # pretraining job key -> its config

    @property
    def command(self) -> str:
        return f"megakd repro {self.name}" + (" --quick" if self.quick else "")

    @property
    def note(self) -> str:
        """What the report says about the fine-tuning data (and, in quick mode, that it is no measurement)."""
        return QUICK_NOTE if self.quick else FULL_NOTE

    @property
    def pretrained(self) -> str:
        """How the report names the shared encoder: its recipe and at which sizes it was pretrained."""
        return f"`{self.recipe.name}` pretrained ({'quick sizes' if self.quick else 'the full recipe'})"

    @property
    def encoder(self) -> str:
        """What of a pretraining run of the recipe fine-tuning starts from, as the report names it."""
        return {"discriminator": "the discriminator", "generator": "the masked LM"}[
            finetuned_model(load_config(self.recipe, []))]

    @property
    def pretrained_draws(self) -> str:
        """How the report names the pretraining draws of each arm or encoder, with their train.seed."""
        draws = self.settings.draws
        return f"pretrained {len(draws)} times (draws: train.seed {', '.join(map(str, draws))})"

    @property
    def seeds_override(self) -> str:
        return f"finetune.seeds=[{','.join(map(str, self.seeds))}]"

    def epochs(self, config: str | Path = FINETUNE_RT) -> int:
        """Fine-tuning epochs of `config` under this mode's settings."""
        return int(recipe_value(config, "finetune.epochs", self.settings.finetune, FinetuneConfig))

    def pretrain(self, overrides: list[str], teacher: PretrainRun | None = None) -> PretrainRun:
        """Declare a pretraining run of the finding's recipe + `overrides`; with `teacher`, a DWT run
        distilling that run (`overrides` name it in `distill.teacher`)."""
        recipe = self.recipe
        path = cached_run_dir(recipe, overrides, self.work)
        key = f"pretrain:{path.name}"
        cfg = self._configs[key] = load_config(recipe, [*SILENT_RUN, *overrides, "run.dir=_"])
        step = self.costs.pretrain_step(cfg, self._configs[teacher.key] if teacher else None)
        seconds = 0.0 if (path / "repro-done").is_file() else self.costs.job_start + cfg.train.max_steps * step
        label = f"{'distill' if teacher else 'pretrain'} {recipe.name} {' '.join(overrides)}"
        self._add(Job(key, self.name, label, pretrain, (str(recipe), list(overrides), self.work, teacher is not None),
                      seconds, (teacher.key,) if teacher else ()))
        return PretrainRun(key, path)

    def finetune(self, overrides: list[str], encoder: PretrainRun, config: str | Path = FINETUNE_RT,
                 keep: bool = False, after: tuple[FinetuneRun | PretrainRun, ...] = (),
                 other: PretrainRun | None = None) -> FinetuneRun:
        """Declare `megakd finetune -c config overrides...` of a model of `encoder`'s architecture (see
        `megakd.repro.training.finetune`), after `encoder` and the runs in `after` (e.g. a teacher, or the encoder
        whose architecture a random-init student takes); `keep`: keep its model. `other`: the architecture of the
        other model the run consults or trains (a KD teacher, TGT's generator and labeler, SoTeacher's student),
        which its cost counts; default `encoder`'s."""
        cfg = load_config(config, [*self.settings.finetune, *overrides, "run.dir=_"], cls=FinetuneConfig)
        name = digest({"config": config_tree(cfg), "keep": keep})
        key, kept = f"finetune:{name}", self.work / "kept" / name if keep else None
        seconds = self.costs.job_start + self.costs.finetune_run(
            cfg, self._configs[encoder.key], self._configs[other.key] if other else None)
        self._add(Job(key, self.name, f"finetune {Path(config).name} {' '.join(overrides)}", finetune,
                      (str(config), [*self.settings.finetune, *overrides], self.work, str(kept) if kept else None),
                      seconds, (encoder.key, *(r.key for r in after))))
        return FinetuneRun(key, kept)

    def base_encoder(self, draw: int = 0) -> PretrainRun:
        """The shared encoder that fine-tuning findings start from, their teacher or labeler: the recipe as it
        stands (quick: tiny sizes), pretraining draw `draw` (its train.seed)."""
        return self.pretrain([*(QUICK_PRETRAIN if self.quick else ()), f"train.seed={draw}"])

    @property
    def student_size(self) -> str:
        """`student_encoder`'s models, as layers × width."""
        sizes = dict(QUICK_STUDENT_SIZES if self.quick else STUDENT_SIZES)
        return f"{sizes['num_layers']} × {sizes['hidden_size']}"

    def student_encoder(self, draw: int = 0) -> PretrainRun:
        """The shared student, smaller than `base_encoder`: the recipe with both models at STUDENT_SIZES,
        pretraining draw `draw`. A random-init student takes its architecture and tokenizer."""
        return self.pretrain([*(QUICK_PRETRAIN if self.quick else ()), f"train.seed={draw}",
                              *student_overrides(self.quick)])

    def call(self, key: str, label: str, fn: Callable[..., object], args: tuple, seconds: float,
             after: tuple[str, ...] = ()) -> str:
        """Declare a job of the finding's own (`fn` module-level), run after the jobs `after` names; its key."""
        self._add(Job(f"{self.name}:{key}", self.name, label, fn, args, seconds, after))
        return f"{self.name}:{key}"

    def result(self, run: PretrainRun | FinetuneRun | str) -> object:
        return self.results[run if isinstance(run, str) else run.key]

    def _add(self, job: Job) -> None:
        self.jobs.setdefault(job.key, job)


def finding_jobs(run: FindingRun) -> set[str]:
    """Every job the finding's report needs (its own and those it shares with others)."""
    return closure(run.jobs, list(run.jobs))
