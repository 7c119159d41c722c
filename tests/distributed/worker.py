"""One multi-process launch, several training runs: `torchrun --nproc_per_node N worker.py SPEC.json`.

Starting Python, torch and DeepSpeed costs more than a tiny run, so the tests hand one launch a
list of runs: each entry is {"overrides": [...], "resume": PATH|null}. Every run goes through the
production path (`run_pretraining`, the run shell) with its own backend; the process group is
created once and shared (`one_process_group`), and torn down after the last run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys

import torch.distributed as dist

from megakd.config import load_config
from megakd.engine import backends
from megakd.engine.pretrain import run_pretraining


@contextlib.contextmanager
def one_process_group():
    """The runs inside share the launch's process group. A run's backend leaves the group when the run ends
    (`ProcessGroupBackend.close`), the last thing a command does; but in a group created again in the same
    process DeepSpeed cannot build its own groups (its `new_group` waits forever on the launcher's store),
    so the group is left once, after every rank has finished every run."""
    leave = backends.leave_process_group
    backends.leave_process_group = lambda: None
    try:
        yield
    finally:
        backends.leave_process_group = leave
    if dist.is_initialized():
        dist.barrier()
        leave()


def main(spec_path: str) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    spec = json.loads(open(spec_path).read())
    with one_process_group():
        for run in spec["runs"]:
            run_pretraining(load_config(spec["config"], run["overrides"]), run.get("resume"))


if __name__ == "__main__":
    main(sys.argv[1])
    backends.exit_process(0)  # as the `megakd` executable ends: no abort at interpreter teardown
