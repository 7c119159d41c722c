"""A job, one piece of a finding's work, and the dependency graph jobs form: the order in which both the
plan (`megakd.repro.costs`) and the runner (`megakd.repro.runner`) take them, so the plan simulates the
schedule that runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


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


def ready(jobs: dict[str, Job], pending: list[str], finished: Callable[[str], bool]) -> list[str]:
    """The pending jobs whose dependencies have all finished, in `pending`'s order."""
    return [k for k in pending if all(finished(dep) for dep in jobs[k].after)]


def priority_order(jobs: dict[str, Job]) -> list[str]:
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


def closure(jobs: dict[str, Job], keys: list[str]) -> set[str]:
    """`keys` and every job they depend on."""
    out: set[str] = set()
    stack = list(keys)
    while stack:
        key = stack.pop()
        if key not in out:
            out.add(key)
            stack.extend(jobs[key].after)
    return out
