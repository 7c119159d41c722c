"""What the findings share: their settings, the jobs they declare, the cost model that plans them, and
the runner that executes the jobs one at a time or as several single-thread processes (`--jobs N`).

A finding declares its work as jobs (pretraining runs, fine-tuning runs, its own calls) before
anything runs: every path a job writes is known in advance, so the whole finding (or `all`) is
one dependency graph that can be planned (`megakd repro NAME --plan`) and run in any order the
dependencies allow. Jobs with the same resolved settings are the same job: `all` pretrains the
shared encoder once.

A pretraining run is cached under `WORK/pretrained/<hash of its resolved config>/` and reused
by every later job or invocation that asks for the same one; a lock file beside it makes sure two
processes never train the same run at once. Fine-tuning runs go to scratch directories that are
deleted once read; models kept as later runs' teachers are deleted when the invocation ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import heapq
import json
import logging
import logging.handlers
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from megakd.bench.flops import StepFlops, encoder_flops_per_token, step_flops
from megakd.config import Config, load_config
from megakd.engine.pretrain import run_distill, run_pretraining
from megakd.engine.runlog import read_metrics
from megakd.engine.runlog import tail_mean as tail_mean  # the findings' modules import it from here
from megakd.finetune.config import FinetuneConfig
from megakd.finetune.jobs import run_job
from megakd.finish import finish_config
from megakd.repro.report import FindingReport

log = logging.getLogger(__name__)

CONFIGS = Path(__file__).parents[2] / "configs"
PRETRAIN_RECIPE = CONFIGS / "electra-mini.yaml"  # the recipe meant to pay off downstream
FINETUNE_RT = CONFIGS / "finetune-rt.yaml"
RT_TRAIN_SENTENCES = 9071  # the bundled RT task's training split
SILENT_RUN = ("run.export_hf=false", "run.plots=false", "run.tensorboard=false", "run.progress_bar=false",
              "train.save_every=0", "run.keep_last=1")

# --quick: 1-layer, 32-wide models for a few steps, fine-tuned on 400 RT sentences for one epoch.
QUICK_PRETRAIN = (
    "train.max_steps=12", "train.global_batch_size=8", "train.micro_batch_size=8", "optim.schedule.warmup_steps=2",
    "train.log_every=1", "train.probe_every=0",
    *(f"model.{m}.{k}={v}" for m in ("generator", "discriminator")
      for k, v in (("num_layers", 1), ("hidden_size", 32), ("intermediate_size", 64), ("embedding_size", 32),
                   ("num_heads", 2))),
)
# Full mode fine-tunes on 3,000 of RT's 9,071 training sentences (an even spread; dev whole), to keep the
# report's cost within hours on 2 cores (`megakd repro all --plan` states it).
FULL_FINETUNE = ("task.max_train_examples=3000",)
# The student of the findings whose teacher or labeler is the shared encoder (soteacher, labelreg, tgt):
# the recipe with both models at 2 x 64, 3.7x fewer parameters than its 4 x 128 discriminator (the
# papers' teachers are 3.9x to 5.4x their students; docs/REPRODUCTION.md's scale table).
STUDENT_SIZES = (("num_layers", 2), ("hidden_size", 64), ("intermediate_size", 256), ("embedding_size", 64),
                 ("num_heads", 2))
QUICK_STUDENT_SIZES = (("num_layers", 1), ("hidden_size", 16), ("intermediate_size", 32), ("embedding_size", 16),
                       ("num_heads", 2))


def student_overrides(quick: bool = False) -> tuple[str, ...]:
    """The overrides that make the recipe the shared student: both models at STUDENT_SIZES (quick: the
    QUICK_STUDENT_SIZES)."""
    sizes = QUICK_STUDENT_SIZES if quick else STUDENT_SIZES
    return tuple(f"model.{m}.{k}={v}" for m in ("generator", "discriminator") for k, v in sizes)


QUICK_FINETUNE = ("task.max_train_examples=400", "task.max_dev_examples=200", "finetune.epochs=1")
FULL_NOTE = " Fine-tuning used 3,000 of RT's training sentences (an even spread) and the whole dev split."
QUICK_NOTE = (" Quick mode: a 1-layer, 32-wide encoder pretrained for 12 steps, fine-tuned on 400 RT sentences "
              "(200 dev sentences) for one epoch: a structure check rather than a measurement.")


CALIBRATION_STEPS = 5  # timed steps of `Costs.calibrated`


@dataclass(frozen=True)
class Costs:
    """Seconds per unit of work for one job on one thread, the plan's cost model.

    The defaults come from one machine (the project's 2-core CPU), one thread per job with the other
    core busy, which is what `--jobs 2` gives each job: first timed directly (0.46 s, 70 s), then
    scaled by the full run's measured/planned ratios (pretraining and distillation 0.80, fine-tuning
    0.74 over 35 jobs; README "Budget"). Other models are scaled by matrix FLOPs (`megakd.bench.flops`).
    """

    electra_mini_step: float = 0.37  # one pretraining step of configs/electra-mini.yaml (batch 32, seq 64)
    rt_epoch: float = 52.0  # one RT fine-tuning epoch of its 4 x 128 discriminator over all 9,071 sentences
    job_start: float = 10.0  # a job's set-up (imports, data, model): an estimate, not measured

    @classmethod
    def parse(cls, items: list[str]) -> Costs:
        """`NAME=SECONDS` items (e.g. `electra_mini_step=0.5`) over the defaults."""
        names = [f.name for f in fields(cls)]
        values = {}
        for item in items:
            name, _, value = item.partition("=")
            if name not in names:
                raise ValueError(f"--unit-seconds {item}: expected NAME=SECONDS with NAME one of {', '.join(names)}")
            try:
                values[name] = float(value)
            except ValueError:
                raise ValueError(f"--unit-seconds {item}: {value!r} is not a number of seconds") from None
        return cls(**values)

    def calibrated(self, work: Path) -> Costs:
        """These costs on this machine: a timed step of configs/electra-mini.yaml on one thread, as a job of
        `--jobs 2` runs, against `electra_mini_step`; every unit is scaled by that ratio (the fine-tuning
        epoch and the set-up are the same kind of CPU work). Takes about 20 s. Timed alone, so on a machine
        with nothing else running it reads a little fast for `--jobs 2`, where two jobs share the memory
        bandwidth (by how much is not measured)."""
        from megakd.bench.cluster import training_throughput

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            cfg = load_config(PRETRAIN_RECIPE, [f"run.dir={work / 'calibration'}", "run.progress_bar=false"])
            step = training_throughput(cfg, steps=CALIBRATION_STEPS, warmup=2, peak_tflops=1.0,
                                       profile_steps=0)["step_s"]
        finally:
            torch.set_num_threads(threads)
        ratio = step / self.electra_mini_step
        return Costs(**{f.name: getattr(self, f.name) * ratio for f in fields(self)})

    def pretrain_step(self, cfg: Config, teacher: Config | None = None) -> float:
        """Seconds of one step of `cfg` (with `teacher`: plus the frozen teacher's forward pass)."""
        flops = _step_flops(cfg).model + (_step_flops(teacher).forward if teacher is not None else 0.0)
        return self.electra_mini_step * flops / _step_flops(_reference_recipe()).model

    def finetune_run(self, cfg: FinetuneConfig, encoder: Config, other: Config | None = None) -> float:
        """Seconds of a fine-tuning run of `cfg` (every seed) whose model has the architecture of the encoder of
        `encoder` (a pretraining config), and the other model it consults or trains (`training_passes`) that of
        `other` (default: the same)."""
        sentences = min(cfg.task.max_train_examples or RT_TRAIN_SENTENCES, RT_TRAIN_SENTENCES)
        own, others = training_passes(cfg)
        work = own * _encoder_flops(encoder) + others * _encoder_flops(other or encoder)
        epoch = self.rt_epoch * sentences / RT_TRAIN_SENTENCES * work / _encoder_flops(_reference_recipe())
        return epoch * cfg.finetune.epochs * len(cfg.finetune.seeds)


def training_passes(cfg: FinetuneConfig) -> tuple[float, float]:
    """A fine-tuning step's work in plain training steps of the run's own model and of the other model it
    consults or trains (a KD teacher; TGT's generator and labeler; SoTeacher's student), counted from the
    passes it makes (a forward pass is ~1/3 of a training step); an estimate, not measured."""
    forward = 1 / 3
    if cfg.soteacher.enabled:  # the teacher (the run's model), then (unless disabled) a student distilling it
        return (1 + forward, 1) if cfg.soteacher.distill_student else (1, 0)
    if cfg.tgt.enabled:
        # the student trained on real and generated text; the generator's forward, the labeler's on both
        own, others = 2, forward + 2 * forward
        if cfg.tgt.mode == "gradient":  # the ascent: a forward and an input-gradient backward of all three
            own, others = own + 2 / 3, others + 4 / 3
        return own, others
    return 1, (forward if cfg.labelreg.target in ("kd", "selfkd", "akd") else 0)  # a teacher's forward


def _reference_recipe() -> Config:
    return load_config(PRETRAIN_RECIPE, [])


def _step_flops(cfg: Config) -> StepFlops:
    cfg = finish_config(cfg)
    return step_flops(cfg, cfg.train.global_batch_size)


def finetuned_model(cfg: Config) -> str:
    """Which model of a pretraining config fine-tuning starts from: an ELECTRA run's discriminator, a
    masked LM's own (`generator`)."""
    return "discriminator" if cfg.model.objective == "electra" else "generator"


def _encoder_flops(cfg: Config) -> float:
    """Forward FLOPs per token of the encoder a pretraining config hands to fine-tuning."""
    cfg = finish_config(cfg)
    return encoder_flops_per_token(getattr(cfg.model, finetuned_model(cfg)), cfg.data.seq_len)


@dataclass(frozen=True)
class Settings:
    """A finding's settings in one mode (full or --quick)."""

    recipe: Path  # the pretraining recipe (`--recipe` replaces it)
    seeds: tuple[int, ...]
    steps: int = 0  # pretraining steps of each of its runs (0: the recipe's own)
    pretrain: tuple[str, ...] = ()  # overrides of every pretraining run
    finetune: tuple[str, ...] = ()  # overrides of every fine-tuning run
    # Pretraining draws per arm (train.seed of each): two runs of one recipe differ by more than most
    # measured effects, so a finding that pretrains its arms counts only what every draw agrees on.
    draws: tuple[int, ...] = (0,)
    whole_budget: str = ""  # what the runs that also go the recipe's whole length are (DWT: "remapping")


@dataclass
class Job:
    """One piece of a finding's work that runs on its own: `fn(*args)`, after the jobs in `after`."""

    key: str  # equal keys are the same work, run once
    finding: str
    label: str
    fn: Callable[..., object]  # module-level, so that a worker process can import it
    args: tuple
    seconds: float  # planned
    after: tuple[str, ...] = ()


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
    results: dict[str, object]  # job key -> return value, filled in by `execute`
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
        `finetune`), after `encoder` and the runs in `after` (e.g. a teacher, or the encoder whose architecture a
        random-init student takes); `keep`: keep its model. `other`: the architecture of the other model the run
        consults or trains (a KD teacher, TGT's generator and labeler, SoTeacher's student), which its cost
        counts; default `encoder`'s."""
        cfg = load_config(config, [*self.settings.finetune, *overrides, "run.dir=_"], cls=FinetuneConfig)
        digest = _digest({"config": _as_dict(cfg), "keep": keep})
        key, kept = f"finetune:{digest}", self.work / "kept" / digest if keep else None
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

    def call(self, key: str, label: str, fn: Callable[..., object], args: tuple, seconds: float) -> str:
        """Declare a job of the finding's own (`fn` module-level); returns its key."""
        self._add(Job(f"{self.name}:{key}", self.name, label, fn, args, seconds))
        return f"{self.name}:{key}"

    def result(self, run: PretrainRun | FinetuneRun | str) -> object:
        return self.results[run if isinstance(run, str) else run.key]

    def _add(self, job: Job) -> None:
        self.jobs.setdefault(job.key, job)


def recipe_value(recipe: str | Path, key: str, overrides: tuple[str, ...] = (), cls: type = Config) -> object:
    """A dotted key's value in a recipe (a `cls` config) after `overrides` (e.g. its discriminator LR)."""
    value: object = load_config(recipe, list(overrides), cls=cls)
    for part in key.split("."):
        value = getattr(value, part)
    return value


def metric_rows(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / "metrics.jsonl")


def last_value(rows: list[dict], key: str) -> float:
    return [r[key] for r in rows if key in r][-1]


def seed_values(summary: dict, metric: str = "accuracy") -> list[float]:
    """Per-seed values of `metric` in a fine-tuning summary, in seed order."""
    return list(summary["metrics"][metric]["values"])


# --- the jobs' functions (module-level: a worker process imports them) ---------------------------

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
        (run_distill if distill else run_pretraining)(cfg)
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
        summary = run_job(cfg)
        if kept:
            (seed,) = cfg.finetune.seeds
            shutil.copytree(scratch / "run" / f"seed_{seed}" / "model", kept, dirs_exist_ok=True)
    finally:
        shutil.rmtree(scratch)
    return summary


def cached_run_dir(recipe: str | Path, overrides: list[str], work: Path) -> Path:
    """Where `pretrain` keeps the run of `recipe` + `overrides` (finished if it holds `repro-done`)."""
    cfg: Config = load_config(recipe, [*SILENT_RUN, *overrides, "run.dir=_"])
    return work / "pretrained" / _digest(_as_dict(cfg))


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


def _digest(tree: object) -> str:
    return hashlib.sha256(json.dumps(tree, sort_keys=True, default=str).encode()).hexdigest()[:16]


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


# --- planning and running ------------------------------------------------------------------------

@dataclass
class Plan:
    """When each job would start and end with `workers` jobs at a time, at the planned seconds."""

    workers: int
    jobs: dict[str, Job]
    start: dict[str, float]
    end: dict[str, float]

    @property
    def minutes(self) -> float:
        return max(self.end.values(), default=0.0) / 60

    def finding_minutes(self, finding: str) -> tuple[float, float]:
        """(the single-thread work of the jobs it declared first, the time its last job would end), in minutes."""
        own = [j.seconds for j in self.jobs.values() if j.finding == finding]
        needed = [self.end[k] for k in _closure(self.jobs, [k for k, j in self.jobs.items() if j.finding == finding])]
        return sum(own) / 60, max(needed, default=0.0) / 60

    def table(self, findings: list[str], costs: Costs) -> str:
        units = ", ".join(f"{f.name} {getattr(costs, f.name):g} s" for f in fields(costs))
        lines = [f"repro plan: {self.workers} job(s) at a time, one thread each; seconds per unit: {units}",
                 f"{'finding':<10} {'jobs':>5} {'work (min)':>11} {'done at (min)':>14}"]
        for name in findings:
            work, done = self.finding_minutes(name)
            count = sum(j.finding == name for j in self.jobs.values())
            lines.append(f"{name:<10} {count:>5} {work:>11.1f} {done:>14.1f}")
        total = sum(j.seconds for j in self.jobs.values()) / 60
        lines.append(f"{'total':<10} {len(self.jobs):>5} {total:>11.1f} {self.minutes:>14.1f}")
        return "\n".join(lines)


def plan(jobs: dict[str, Job], workers: int) -> Plan:
    """Simulate `execute`'s schedule: whenever a worker is free it takes the ready job of highest priority."""
    pending, start, end = _priority_order(jobs), {}, {}
    running: list[tuple[float, str]] = []  # (end, key), a heap
    clock = 0.0
    while pending:
        finished = {k for k, t in end.items() if t <= clock}
        for key in _ready(jobs, pending, finished.__contains__)[:workers - len(running)]:
            pending.remove(key)
            start[key], end[key] = clock, clock + jobs[key].seconds
            heapq.heappush(running, (end[key], key))
        clock = heapq.heappop(running)[0]
    return Plan(workers, jobs, start, end)


def execute(jobs: dict[str, Job], results: dict[str, object], workers: int,
            on_done: Callable[[str], None] = lambda key: None) -> None:
    """Run every job after its dependencies, highest priority first as `plan` simulates, `workers` at a time
    (more than one: each in a spawned single-thread process); `on_done(key)` after each."""
    pending = _priority_order(jobs)
    total = len(pending)
    started, planned_done = time.monotonic(), 0.0

    def finished(key: str, seconds: float) -> None:
        nonlocal planned_done
        planned_done += jobs[key].seconds
        rest = sum(jobs[k].seconds for k in jobs if k not in results)
        pace = (time.monotonic() - started) / planned_done if planned_done else 1.0
        log.info("repro: %s done in %.0f s (planned %.0f s); %d of %d jobs done, ~%.0f min to go at this pace",
                 jobs[key].label[:100], seconds, jobs[key].seconds, len(results), total, rest * pace / 60 / workers)
        on_done(key)

    if workers <= 1:
        while pending:
            key = _ready(jobs, pending, results.__contains__)[0]
            pending.remove(key)
            begin = time.monotonic()
            results[key] = jobs[key].fn(*jobs[key].args)
            finished(key, time.monotonic() - begin)
        return
    context = multiprocessing.get_context("spawn")
    logs = context.Queue()
    listener = logging.handlers.QueueListener(logs, *logging.getLogger().handlers, respect_handler_level=True)
    listener.start()
    running: dict[Future, tuple[str, float]] = {}
    try:
        with ProcessPoolExecutor(workers, mp_context=context, max_tasks_per_child=1, initializer=_worker_init,
                                 initargs=(logs, logging.getLogger().getEffectiveLevel())) as pool:
            while pending or running:
                for key in _ready(jobs, pending, results.__contains__)[:workers - len(running)]:
                    pending.remove(key)
                    running[pool.submit(jobs[key].fn, *jobs[key].args)] = (key, time.monotonic())
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    key, begin = running.pop(future)
                    results[key] = future.result()  # a failed job raises here; the pool lets the others end
                    finished(key, time.monotonic() - begin)
    finally:
        listener.stop()


def _ready(jobs: dict[str, Job], pending: list[str], finished: Callable[[str], bool]) -> list[str]:
    return [k for k in pending if all(finished(dep) for dep in jobs[k].after)]


def _worker_init(logs: multiprocessing.Queue, level: int) -> None:
    """A job process: one thread (two single-thread jobs use 2 cores better than one with two threads at
    these sizes), its log records sent to the parent's handlers."""
    torch.set_num_threads(1)
    root = logging.getLogger()
    root.handlers[:] = [logging.handlers.QueueHandler(logs)]
    root.setLevel(level)


def _priority_order(jobs: dict[str, Job]) -> list[str]:
    """Jobs by the longest planned path from them to the end (the critical path first), then as declared."""
    children: dict[str, list[str]] = {k: [] for k in jobs}
    for key, job in jobs.items():
        for dep in job.after:
            children[dep].append(key)
    rank: dict[str, float] = {}

    def path(key: str) -> float:
        if key not in rank:
            rank[key] = jobs[key].seconds + max((path(c) for c in children[key]), default=0.0)
        return rank[key]

    position = {k: i for i, k in enumerate(jobs)}
    return sorted(jobs, key=lambda k: (-path(k), position[k]))


def _closure(jobs: dict[str, Job], keys: list[str]) -> set[str]:
    """`keys` and every job they depend on."""
    out: set[str] = set()
    stack = list(keys)
    while stack:
        key = stack.pop()
        if key not in out:
            out.add(key)
            stack.extend(jobs[key].after)
    return out


def finding_jobs(run: FindingRun) -> set[str]:
    """Every job the finding's report needs (its own and those it shares with others)."""
    return _closure(run.jobs, list(run.jobs))


ReportFn = Callable[[], FindingReport]
