"""`megakd repro NAME`: the papers' findings re-run at CPU scale, written to docs/REPRODUCTION.md.

Each finding is a module with `run(out_dir, work, quick, seeds, recipe) -> FindingReport`; `--quick`
runs the same code on tiny settings in a few minutes, for tests of the report's structure.
`recipe` is the pretraining recipe the finding trains (or starts) from; each module holds its default.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from megakd.repro.report import FindingReport, write_section

# name -> module; `megakd repro all` runs them in this order (soteacher pretrains the encoder that
# labelreg and tgt then reuse from the cache under --work).
MODULES = {"lambda": "lambda_finding", "disc_lr": "disc_lr", "dwt": "dwt", "soteacher": "soteacher",
           "labelreg": "labelreg", "tgt": "tgt"}
FINDINGS = tuple(MODULES)
# The findings whose recipe is an ELECTRA pretraining recipe (configs/electra-mini.yaml by default);
# `all --recipe R` passes R to these (lambda keeps electra-tiny, dwt its BERT-MLM student recipe).
ELECTRA_RECIPE_FINDINGS = ("disc_lr", "soteacher", "labelreg", "tgt")


def run_finding(name: str, out: str | Path, work: str | Path, quick: bool = False,
                seeds: tuple[int, ...] | None = None, recipe: str | Path | None = None) -> FindingReport:
    """Run finding `name` and write (or replace) its section in the report at `out`."""
    if name not in MODULES:
        raise ValueError(f"repro: unknown finding {name!r}; expected one of {', '.join(FINDINGS)}")
    module = importlib.import_module(f"megakd.repro.{MODULES[name]}")
    out = Path(out)
    if recipe is not None and not Path(recipe).is_file():
        raise FileNotFoundError(f"--recipe {recipe}: no such file")
    options = {"recipe": recipe} if recipe is not None else {}
    report = module.run(out.parent, Path(work), quick=quick, seeds=seeds, **options)
    write_section(report, out)
    return report


def run_all(out: str | Path, work: str | Path, quick: bool = False, seeds: tuple[int, ...] | None = None,
            recipe: str | Path | None = None) -> list[FindingReport]:
    """Every finding in order, each section written as soon as it is done."""
    return [run_finding(name, out, work, quick, seeds, recipe if name in ELECTRA_RECIPE_FINDINGS else None)
            for name in FINDINGS]
