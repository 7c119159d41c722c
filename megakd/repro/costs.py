"""The cost model that prices each job before anything runs, and the plan it gives: when each job would
start and end with N jobs at a time (`megakd repro NAME --plan`)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from megakd.bench.flops import StepFlops, encoder_flops_per_token, step_flops
from megakd.config import Config, load_config
from megakd.finetune.config import FinetuneConfig
from megakd.finish import finish_config
from megakd.repro.jobs import Job, closure, priority_order, ready
from megakd.repro.settings import PRETRAIN_RECIPE, RT_TRAIN_SENTENCES, finetuned_model

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


def _encoder_flops(cfg: Config) -> float:
    """Forward FLOPs per token of the encoder a pretraining config hands to fine-tuning."""
    cfg = finish_config(cfg)
    return encoder_flops_per_token(getattr(cfg.model, finetuned_model(cfg)), cfg.data.seq_len)


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
        needed = [self.end[k] for k in closure(self.jobs, [k for k, j in self.jobs.items() if j.finding == finding])]
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
    """Simulate `megakd.repro.runner.execute`'s schedule: whenever a worker is free it takes the ready job of
    highest priority."""
    pending, start, end = priority_order(jobs), {}, {}
    running: list[tuple[float, str]] = []  # (end, key), a heap
    clock = 0.0
    while pending:
        finished = {k for k, t in end.items() if t <= clock}
        for key in ready(jobs, pending, finished.__contains__)[:workers - len(running)]:
            pending.remove(key)
            start[key], end[key] = clock, clock + jobs[key].seconds
            heapq.heappush(running, (end[key], key))
        clock = heapq.heappop(running)[0]
    return Plan(workers, jobs, start, end)
