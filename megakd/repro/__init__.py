"""`megakd repro NAME`: the papers' findings re-run at CPU scale, written to docs/REPRODUCTION.md.

Each finding is a module with `FULL` and `QUICK` settings (`settings.Settings`) and
`declare(run: FindingRun) -> report function`: it declares its jobs on `run`, and the returned
function builds its section from their results once they have run. `--quick` runs the same code on
tiny settings in a few minutes, for tests of the report's structure.
"""

from __future__ import annotations

import importlib
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from megakd.repro.findings import ELECTRA_RECIPE_FINDINGS, FINDINGS, MODULES
from megakd.repro.report import FindingReport, code_version, write_section

if TYPE_CHECKING:  # these import torch and the engine; `megakd --help` needs only FINDINGS
    from megakd.repro.costs import Costs, Plan
    from megakd.repro.finding_run import FindingRun, ReportFn
    from megakd.repro.jobs import Job

log = logging.getLogger(__name__)



def declare(names: list[str], out: str | Path, work: str | Path, quick: bool = False,
            seeds: tuple[int, ...] | None = None, recipe: str | Path | None = None, costs: Costs | None = None
            ) -> tuple[dict[str, FindingRun], dict[str, ReportFn], dict[str, Job]]:
    """Each finding's run and report function, and all their jobs (a job two findings share, once)."""
    from megakd.repro.costs import Costs
    from megakd.repro.finding_run import FindingRun

    for name in names:
        if name not in MODULES:
            raise ValueError(f"repro: unknown finding {name!r}; expected one of {', '.join(FINDINGS)}")
    if recipe is not None and not Path(recipe).is_file():
        raise FileNotFoundError(f"--recipe {recipe}: no such file")
    results: dict[str, object] = {}
    runs, reports, jobs = {}, {}, {}
    for name in names:
        module = importlib.import_module(f"megakd.repro.{MODULES[name]}")
        settings = module.QUICK if quick else module.FULL
        own_recipe = recipe if recipe is not None and (len(names) == 1 or name in ELECTRA_RECIPE_FINDINGS) else None
        run = FindingRun(name=name, quick=quick, settings=settings, seeds=tuple(seeds or settings.seeds),
                         recipe=Path(own_recipe or settings.recipe), work=Path(work), out_dir=Path(out).parent,
                         costs=costs or Costs(), results=results)
        reports[name] = module.declare(run)
        runs[name] = run
        for key, job in run.jobs.items():
            jobs.setdefault(key, job)
    return runs, reports, jobs


def plan_findings(names: list[str], work: str | Path, quick: bool = False, seeds: tuple[int, ...] | None = None,
                  recipe: str | Path | None = None, workers: int = 1, costs: Costs | None = None) -> Plan:
    """What running `names` would take with `workers` jobs at a time, from the cost model; nothing runs."""
    from megakd.repro.costs import plan

    _, _, jobs = declare(names, Path(work) / "REPRODUCTION.md", work, quick, seeds, recipe, costs)
    return plan(jobs, workers)


def run_findings(names: list[str], out: str | Path, work: str | Path, quick: bool = False,
                 seeds: tuple[int, ...] | None = None, recipe: str | Path | None = None, workers: int = 1,
                 costs: Costs | None = None) -> list[FindingReport]:
    """Run the findings' jobs and write (or replace) each finding's section in `out` as soon as its jobs are done."""
    from megakd.repro.costs import Costs, plan
    from megakd.repro.finding_run import finding_jobs
    from megakd.repro.runner import execute

    costs = costs or Costs()
    measured_with = code_version()  # before anything runs: the code that measures
    runs, report_fns, jobs = declare(names, out, work, quick, seeds, recipe, costs)
    log.info("%s", plan(jobs, workers).table(names, costs))
    Path(work).mkdir(parents=True, exist_ok=True)
    results = next(iter(runs.values())).results
    reports: dict[str, FindingReport] = {}

    def write_finished(_key: str) -> None:
        for name, run in runs.items():
            if name not in reports and finding_jobs(run) <= results.keys():
                reports[name] = report_fns[name]()
                reports[name].measured_with = measured_with
                write_section(reports[name], out, order=FINDINGS)
                log.info("finding %s: %s; section written to %s", name, reports[name].verdict, out)

    try:
        execute(jobs, results, workers, write_finished)
        if not quick and recipe is None:  # the table describes the findings' own full-mode settings
            from megakd.repro.scale import write_scale

            write_scale(out)
    finally:
        shutil.rmtree(Path(work) / "kept", ignore_errors=True)  # teachers and labelers kept for later jobs
    return [reports[name] for name in names]
