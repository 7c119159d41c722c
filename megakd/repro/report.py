"""docs/REPRODUCTION.md: one section per finding, each written on its own.

A finding's section sits between `<!-- finding:NAME -->` and `<!-- /finding:NAME -->`; writing a
finding replaces only its own section (or appends it), so findings can be run one at a time and
the report accumulates. The file is written atomically.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

VERDICTS = ("reproduced", "not reproduced at this scale", "inconclusive")

HEADER = """# Reproduction report

The papers' findings re-run at CPU scale on the bundled corpus by `megakd repro NAME` (one
finding) and written here section by section. Each section gives what the paper reports, what
was measured here (mean ± std over seeds, with the command that measured it), and a verdict:
reproduced, not reproduced at this scale, or inconclusive, with the reason. Nothing is tuned
until a finding appears: the settings are fixed in `megakd/repro/` before the run.

Where a section pretrains each arm once and its seeds are fine-tuning seeds (its setup says
which), a p-value over those seeds says how sure the difference is *for those pretrained
encoders*, not for the recipes. Pretraining runs themselves differ by more than that:
two runs of `electra-mini.yaml` that differed only in the random stream of the generator's
replacements fine-tuned to 0.778 ± 0.002 and 0.756 ± 0.010 on RT (README, "Does pretraining pay
off here?").
"""


@dataclass
class FindingReport:
    """What one finding's run produced, ready to be written as its section."""

    name: str
    title: str
    paper: str  # the paper's claim and numbers (markdown)
    setup: str  # what was run, how, and the command (markdown)
    columns: list[str]
    rows: list[list[str]]
    verdict: str
    reason: str
    plots: list[str] = field(default_factory=list)  # paths relative to the report's directory

    def markdown(self) -> str:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict: expected one of {VERDICTS}, got {self.verdict!r}")
        table = ["| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        table += ["| " + " | ".join(row) + " |" for row in self.rows]
        parts = [f"<!-- finding:{self.name} -->", f"## {self.title} (`{self.name}`)", "", "**Paper.** " + self.paper,
                 "", "**Setup.** " + self.setup, "", "**Measured.**", "", *table, ""]
        parts += [f"![{self.name}]({plot})" for plot in self.plots]
        if self.plots:
            parts.append("")
        parts += [f"**Verdict: {self.verdict}.** {self.reason}", f"<!-- /finding:{self.name} -->"]
        return "\n".join(parts)


def mean_std_text(values: list[float]) -> str:
    """`mean ± std` (population std over seeds) in 3 significant digits."""
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return f"{mean:.3g} ± {std:.2g}"


def write_section(report: FindingReport, path: str | Path, order: tuple[str, ...] = ()) -> Path:
    """Insert or replace `report`'s section in the report at `path` (created with its header if missing).

    A new section goes before the first existing one that comes after it in `order` (finding names;
    findings run side by side finish in any order), else at the end.
    """
    path = Path(path)
    text = path.read_text() if path.is_file() else HEADER
    section = report.markdown()
    pattern = re.compile(rf"<!-- finding:{re.escape(report.name)} -->.*?<!-- /finding:{re.escape(report.name)} -->",
                         re.DOTALL)
    later = order[order.index(report.name) + 1:] if report.name in order else ()
    following = [m for m in re.finditer(r"<!-- finding:(\w+) -->", text) if m.group(1) in later]
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    elif following:
        at = following[0].start()
        text = text[:at] + section + "\n\n" + text[at:]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text.rstrip("\n") + "\n")
    tmp.replace(path)
    return path


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (the findings run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    """Write a finding's plot (PNG, beside the report under repro/) and free the figure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return path
