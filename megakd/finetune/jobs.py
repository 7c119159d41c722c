"""Fine-tuning as a job of the run shell (`megakd.engine.run`), and which training a config asks for (plain
or label-regularised, SoTeacher, TGT), in one place for the command line and for callers such as
`megakd repro`."""

from __future__ import annotations

import logging
from collections.abc import Callable

from megakd.engine.backends import MicroBatchLoopBackend
from megakd.engine.run import Outcome, ResumePolicy, Run, run_job
from megakd.finetune.config import FinetuneConfig
from megakd.finetune.runtime import Runtime, build_backend, describe
from megakd.finetune.soteacher import run_soteacher
from megakd.finetune.tgt import run_tgt
from megakd.finetune.trainer import run_finetune
from megakd.launch import Launch
from megakd.objectives.labelreg import TEACHER_TARGETS
from megakd.store import check_source

log = logging.getLogger(__name__)

Training = Callable[[FinetuneConfig, Runtime], dict]  # a fine-tuning method: its trainings, then their summary

# Besides the keys every job treats as steering (run.*, kernels.*, backend.dist_backend; see
# megakd/store/rundir.py), these may differ when a fine-tuning run resumes: they change no number
# that a finished seed or a checkpoint holds.
STEERING = ("finetune.log_every", "finetune.eval_batch_size")


def model_sources(cfg: FinetuneConfig) -> list[tuple[str, str]]:
    """(config key, path) of every stored model the job reads, in the order it reads them."""
    s, g = cfg.soteacher, cfg.tgt
    sources = [("model.path", cfg.model.path)]
    if s.enabled:
        sources += [("soteacher.student.path", s.student.path)] if s.distill_student else []
    elif g.enabled:
        sources += [("tgt.generator", g.generator), ("tgt.labeler", g.labeler)]
    elif cfg.labelreg.target in TEACHER_TARGETS:
        sources += [("labelreg.teacher", cfg.labelreg.teacher)]
    return [(key, path) for key, path in sources if path]


def job_for(cfg: FinetuneConfig) -> Training:
    """The job `cfg` asks for, once every model it reads is known to exist: a SoTeacher student's encoder
    is read after the teachers have trained, so a missing one would otherwise fail minutes in, after
    the run directory was made."""
    for key, path in model_sources(cfg):
        check_source(path, key)
    if cfg.soteacher.enabled:
        return run_soteacher
    if cfg.tgt.enabled:
        return run_tgt
    return run_finetune


class FinetuneJob:
    """`megakd finetune` (and `megakd glue`, with its own `training`) in the run shell. Its trainings (a seed,
    an LR trial, a GLUE task's seed) keep their own checkpoints: `--resume auto` reuses the finished ones
    and continues each other from its newest (`Run.newest_checkpoint`); no state-bearing key may change."""

    run_checkpoints = False

    def __init__(self, cfg: FinetuneConfig, launch: Launch, training: Training | None = None,
                 steering: tuple[str, ...] = (), name: str = "fine-tuning"):
        self.cfg = cfg.finish(launch)  # a GlueConfig too: the same run, finetune and backend sections
        self.launch = launch
        self.training = training or job_for(cfg)
        self.policy = ResumePolicy(steering=STEERING + steering, changeable=False,
                                   why="finished seeds and checkpoints were made with the saved values; start a "
                                       "new run.dir instead")
        self.name = name
        self.runtime: Runtime | None = None

    def build_backend(self) -> MicroBatchLoopBackend:
        return build_backend(self.cfg, self.launch)

    def prepare(self, run: Run) -> None:
        self.runtime = Runtime(run)

    def train(self, run: Run) -> Outcome:
        log.info("%s on %s", self.name, describe(self.runtime))
        return Outcome(summary=self.training(self.cfg, self.runtime))

    def close(self) -> None:
        pass


def finetune(cfg: FinetuneConfig, resume: str | None = None, launch: Launch | None = None) -> Outcome:
    """The fine-tuning job `cfg` asks for, in the run shell (`launch`: the command's, else read here)."""
    return run_job(FinetuneJob(cfg, launch or Launch.from_environ()), resume)
