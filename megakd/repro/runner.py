"""The runner: every declared job after its dependencies, one at a time in this process or as several
single-thread worker processes (`--jobs N`), in the order the plan (`megakd.repro.costs.plan`) simulates."""

from __future__ import annotations

import logging
import logging.handlers
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait

import torch

from megakd.repro.jobs import Job, priority_order, ready

log = logging.getLogger(__name__)


def execute(jobs: dict[str, Job], results: dict[str, object], workers: int,
            on_done: Callable[[str], None] = lambda key: None) -> None:
    """Run every job after its dependencies, highest priority first as `plan` simulates, `workers` at a time
    (more than one: each in a spawned single-thread process); `on_done(key)` after each."""
    pending = priority_order(jobs)
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
            key = ready(jobs, pending, results.__contains__)[0]
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
                for key in ready(jobs, pending, results.__contains__)[:workers - len(running)]:
                    pending.remove(key)
                    running[pool.submit(jobs[key].fn, *jobs[key].args)] = (key, time.monotonic())
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    key, begin = running.pop(future)
                    results[key] = future.result()  # a failed job raises here; the pool lets the others end
                    finished(key, time.monotonic() - begin)
    finally:
        listener.stop()


def _worker_init(logs: multiprocessing.Queue, level: int) -> None:
    """A job process: one thread (two single-thread jobs use 2 cores better than one with two threads at
    these sizes), its log records sent to the parent's handlers."""
    torch.set_num_threads(1)
    root = logging.getLogger()
    root.handlers[:] = [logging.handlers.QueueHandler(logs)]
    root.setLevel(level)
