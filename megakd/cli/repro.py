"""`megakd repro`: the papers' findings re-run at CPU scale, or their plan."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from megakd.cli.common import HelpFormatter, _Command, _examples
from megakd.errors import UserError
from megakd.repro import FINDINGS


def cmd_repro(args: argparse.Namespace) -> int:
    from megakd.repro import FINDINGS, plan_findings, run_findings
    from megakd.repro.costs import Costs

    names = list(FINDINGS) if "all" in args.name else list(dict.fromkeys(args.name))
    seeds = tuple(args.seeds) if args.seeds else None
    if args.jobs < 1:
        raise UserError(f"--jobs: expected a positive number of jobs, got {args.jobs}")
    try:
        costs = Costs.parse(args.unit_seconds or [])
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.calibrate and not args.plan:
        raise UserError("--calibrate: times this machine for --plan; add --plan")
    if args.plan:
        if args.calibrate:
            costs = costs.calibrated(Path(args.work))
            print(f"calibrated on this machine: one configs/electra-mini.yaml step on one thread took "
                  f"{costs.electra_mini_step:.3g} s; every unit scaled by the same ratio")
        plan = plan_findings(names, args.work, quick=args.quick, seeds=seeds, recipe=args.recipe,
                             workers=args.jobs, costs=costs)
        print(plan.table(names, costs))
        from megakd.repro.report import staleness, unmeasured

        stale = staleness(args.out) + unmeasured(args.out)
        if stale:
            print(f"\n{args.out}, section by section:\n" + "\n".join(f"  {line}" for line in stale))
        return 0
    run_findings(names, args.out, args.work, quick=args.quick, seeds=seeds, recipe=args.recipe, workers=args.jobs,
                 costs=costs)
    return 0


class ReproHelpFormatter(HelpFormatter):
    """`megakd repro --help` shows the cost model's defaults, imported only then: megakd.repro.costs loads
    torch, which no other command line needs for parsing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = super()._get_help_string(action)
        if action.dest != "unit_seconds":
            return text
        from megakd.repro.costs import Costs

        defaults = ", ".join(f"{f.name}={f.default:g}" for f in dataclasses.fields(Costs))
        return f"{text} (default: {defaults})"


def add_repro(sub, command: _Command) -> None:
    p = command(sub, "repro", "re-run one of the papers' findings at CPU scale and write its section of "
                "docs/REPRODUCTION.md (paper numbers, measured mean ± std over seeds, verdict)", _examples(
                    "megakd repro all --plan  # minutes per finding; runs nothing",
                    "megakd repro dwt --quick --out /tmp/REPRODUCTION.md  # tiny settings, in minutes",
                    "megakd repro lambda disc_lr --jobs 2"), ReproHelpFormatter)
    p.add_argument("name", nargs="+", choices=(*FINDINGS, "all"),
                   help="the findings to run together (jobs of different findings share the cores), or all")
    p.add_argument("--quick", action="store_true", help="small settings, for tests of the report's structure")
    p.add_argument("--seeds", type=int, nargs="+", help="override the finding's seeds")
    p.add_argument("--recipe", help="the pretraining recipe the finding trains from (default: the finding's own; "
                   "with several: replaces configs/electra-mini.yaml in disc_lr, soteacher and tgt)")
    p.add_argument("--out", default="docs/REPRODUCTION.md", help="the report (its other sections are kept)")
    p.add_argument("--work", default="runs/repro", help="scratch directory for the runs")
    p.add_argument("--jobs", type=int, default=2,
                   help="jobs at a time (default 2, for 2 cores): with more than one, each runs in a single-thread "
                   "process; 1 runs them one after the other in this process")
    p.add_argument("--plan", action="store_true",
                   help="print the estimated minutes per finding and in total, and run nothing")
    p.add_argument("--unit-seconds", nargs="+", metavar="NAME=SECONDS",
                   help="the plan's cost model: seconds per unit of work")
    p.add_argument("--calibrate", action="store_true",
                   help="with --plan: time a few training steps here (about 20 s) and plan with this machine's speed")
    p.set_defaults(func=cmd_repro)
