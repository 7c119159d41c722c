"""Which fine-tuning job a config asks for (plain or label-regularised, SoTeacher, TGT), in one place
for the command line and for callers such as `megakd repro`."""

from __future__ import annotations

from collections.abc import Callable

from megakd.finetune.config import FinetuneConfig
from megakd.finetune.runtime import Runtime
from megakd.finetune.soteacher import run_soteacher
from megakd.finetune.tgt import run_tgt
from megakd.finetune.trainer import run_finetune

Job = Callable[[FinetuneConfig, Runtime], dict]


def job_for(cfg: FinetuneConfig) -> Job:
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
        return job_for(cfg)(cfg, runtime)
    finally:
        runtime.close()
