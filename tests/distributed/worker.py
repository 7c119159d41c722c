"""One multi-process launch, several training runs: `torchrun --nproc_per_node N worker.py SPEC.json`.

Starting Python, torch and DeepSpeed costs more than a tiny run, so the tests hand one launch a
list of runs: each entry is {"overrides": [...], "resume": PATH|null}. Every run builds its own
backend and trainer through the production path (`build_backend` / `build_trainer`); the process
group is created once and shared, and torn down after the last run.
"""

from __future__ import annotations

import json
import logging
import sys

import torch.distributed as dist

from megakd.config import load_config
from megakd.engine.backends import exit_process, leave_process_group
from megakd.engine.pretrain import build_trainer


def main(spec_path: str) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    spec = json.loads(open(spec_path).read())
    for run in spec["runs"]:
        cfg = load_config(spec["config"], run["overrides"])
        trainer = build_trainer(cfg)
        trainer.open_run(run.get("resume"))
        trainer.train()
    if dist.is_initialized():
        dist.barrier()  # every rank has finished every run before any leaves
        leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_process(0)  # as the `megakd` executable ends: no abort at interpreter teardown
