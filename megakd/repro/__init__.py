"""`megakd repro NAME`: the papers' findings re-run at CPU scale, written to docs/REPRODUCTION.md.

Each finding is a module with `run(out_dir, work, quick, seeds) -> FindingReport`; `--quick` runs
the same code on smaller settings in well under a minute, for tests of the report's structure.
"""

from __future__ import annotations

from pathlib import Path

from megakd.repro.report import FindingReport, write_section

FINDINGS = ("lambda",)


def run_finding(name: str, out: str | Path, work: str | Path, quick: bool = False,
                seeds: tuple[int, ...] | None = None) -> FindingReport:
    """Run finding `name` and write (or replace) its section in the report at `out`."""
    if name not in FINDINGS:
        raise ValueError(f"repro: unknown finding {name!r}; expected one of {', '.join(FINDINGS)}")
    from megakd.repro import lambda_finding

    out = Path(out)
    report = lambda_finding.run(out.parent, Path(work), quick=quick, seeds=seeds)
    write_section(report, out)
    return report
