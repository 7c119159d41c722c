"""Which fine-tuning job a config asks for (plain or label-regularised, SoTeacher, TGT), in one place
for the command line and for callers such as `megakd repro`."""

from __future__ import annotations

from collections.abc import Callable

from megakd.finetune.config import FinetuneConfig
from megakd.finetune.runtime import Runtime
from megakd.finetune.soteacher import run_soteacher
from megakd.finetune.tgt import run_tgt
from megakd.finetune.trainer import run_finetune
from megakd.kernels import head_backward
from megakd.objectives.labelreg import TEACHER_TARGETS
from megakd.store import check_source

Job = Callable[[FinetuneConfig, Runtime], dict]


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


def job_for(cfg: FinetuneConfig) -> Job:
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


def run_job(cfg: FinetuneConfig) -> dict:
    """The job in this process, owning `cfg.run.dir` (a new run) for its duration; its summary."""
    runtime = Runtime(cfg)
    try:
        runtime.open()
        with head_backward(cfg.kernels.head_backward):  # read by the fused head's loss (kernels/dispatch.py)
            return job_for(cfg)(cfg, runtime)
    finally:
        runtime.close()
