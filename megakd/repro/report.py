"""docs/REPRODUCTION.md: one section per finding, each written on its own.

A finding's section sits between `<!-- finding:NAME -->` and `<!-- /finding:NAME -->`; writing a
finding replaces only its own section (or appends it), so findings can be run one at a time and
the report accumulates. The file is written atomically.
"""

from __future__ import annotations

import ast
import functools
import math
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean

import yaml

from megakd.repro.findings import FINDINGS, MODULES

VERDICTS = ("reproduced", "not reproduced at this scale", "inconclusive")

HEADER = """# Reproduction report

The papers' findings re-run at CPU scale on the bundled corpus by `megakd repro NAME` (one
finding) and written here section by section. Each section gives what the paper reports, what
was measured here (mean ± std over seeds, with the command that measured it), and a verdict:
reproduced, not reproduced at this scale, or inconclusive, with the reason. Nothing is tuned
until a finding appears: the settings are fixed in `megakd/repro/` before the run. Each section
ends with the commit of the code that measured it; `megakd repro all --plan` lists the sections
whose measuring code (megakd/, kernels/, configs/; another finding's module aside) has changed
since (a change to comments, docstrings or layout alone does not count).

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
    measured_with: str = ""  # the code that measured it (`code_version`), stamped by `megakd repro`

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
        parts.append(f"**Verdict: {self.verdict}.** {self.reason}")
        if self.measured_with:
            stamp = self.measured_with
            parts += ["", f"*Measured with megakd {stamp} (`megakd repro all --plan` says whether the code has changed "
                      f"since).* <!-- measured-with: {stamp} -->"]
        parts.append(f"<!-- /finding:{self.name} -->")
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
    write_text_atomically(path, text)
    return path


def write_text_atomically(path: Path, text: str) -> None:
    """`text` (one final newline) as `path`, whole or not at all: written beside it, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text.rstrip("\n") + "\n")
    tmp.replace(path)


# What a finding's numbers depend on: a section measured before a commit that touched these is older.
MEASURING_CODE = ("megakd", "kernels", "configs")
SOURCE_ROOT = Path(__file__).parents[2]
MAX_LISTED = 3  # commits a stale section's line names


def measuring_paths(finding: str) -> tuple[str, ...]:
    """The git pathspecs of the code `finding` runs: MEASURING_CODE without the other findings' declaring
    modules and the scale table's (no finding imports another's module), so re-running one finding and
    then changing another's settings leaves the first current."""
    others = [f"megakd/repro/{module}.py" for name, module in MODULES.items() if name != finding]
    return (*MEASURING_CODE, *(f":(exclude){path}" for path in [*others, "megakd/repro/scale.py"]))


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(SOURCE_ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_changes(since: str, paths: tuple[str, ...]) -> list[str] | None:
    """`%h %s` of each commit after `since` that changed how `paths` run (None: git cannot tell). A commit
    that only edits comments, docstrings or layout does not count: Python is compared by its syntax tree
    without docstrings, YAML by the value it loads, anything else byte for byte."""
    log = _git("log", "--format=%x00%h %s", "--name-only", f"{since}..HEAD", "--", *paths)
    if log is None:
        return None
    changes = []
    for entry in filter(None, log.split("\0")):
        subject, *files = entry.strip().splitlines()
        if any(_runs_differently(subject.split()[0], f) for f in files if f):
            changes.append(subject)
    return changes


@functools.cache  # a commit's files never change; the report's sections ask about the same commits
def _runs_differently(commit: str, path: str) -> bool:
    before, after = _git("show", f"{commit}^:{path}"), _git("show", f"{commit}:{path}")
    if before is None or after is None:  # added or removed
        return True
    try:
        return code_meaning(path, before) != code_meaning(path, after)
    except (SyntaxError, ValueError, yaml.YAMLError):  # not parseable: compare the text
        return before != after


def code_meaning(path: str, text: str) -> object:
    """What a file does, without what only documents it: Python's syntax tree without docstrings, YAML's
    loaded value, anything else its text."""
    if path.endswith(".py"):
        tree = ast.parse(text)
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                    and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                node.body = body[1:] or [ast.Pass()]
        return ast.dump(tree)
    if path.endswith((".yaml", ".yml")):
        return yaml.safe_load(text)
    return text


def code_version() -> str:
    """The commit of the measuring code (`+changes`: megakd/, kernels/ or configs/ differ from it), or
    `version X` outside a git checkout."""
    commit = _git("rev-parse", "--short=7", "HEAD")
    if commit is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"version {version('megakd')}"
        except PackageNotFoundError:
            return "version unknown"
    return commit + ("+changes" if _git("status", "--porcelain", "--", *MEASURING_CODE) else "")


def section_versions(report: str | Path) -> dict[str, str | None]:
    """Each finding section of `report` and its `measured-with` stamp (None: not recorded)."""
    text = Path(report).read_text() if Path(report).is_file() else ""
    found = {}
    for m in re.finditer(r"<!-- finding:(\w+) -->(.*?)<!-- /finding:\1 -->", text, re.DOTALL):
        stamp = re.search(r"<!-- measured-with: (.+?) -->", m.group(2))
        found[m.group(1)] = stamp.group(1) if stamp else None
    return found


def section_changes(report: str | Path) -> dict[str, tuple[str | None, list[str] | None]]:
    """Each section of `report`: its stamp, and the commits since it that changed how the code it runs works
    (None: no stamp, or git cannot tell)."""
    out = {}
    for name, stamp in section_versions(report).items():
        commit = re.fullmatch(r"([0-9a-f]{7,40})(\+changes)?", stamp or "")
        out[name] = stamp, code_changes(commit.group(1), measuring_paths(name)) if commit else None
    return out


def measured_by_current_code(stamp: str | None, changes: list[str] | None) -> bool:
    """A section's numbers come from the code as it is: a clean commit's stamp, and nothing since that runs
    differently."""
    return stamp is not None and changes == [] and not stamp.endswith("+changes")


def staleness(report: str | Path) -> list[str]:
    """One line per section of `report`: the code that measured it and the commits that have changed how
    the code it runs (`measuring_paths`) works since (`code_changes`), so an older measurement shows before
    it is trusted, and what changed can be read before deciding to re-run it."""
    lines = []
    for name, (stamp, changes) in section_changes(report).items():
        if stamp is None:
            lines.append(f"{name}: measuring code not recorded (re-run it to stamp it)")
        elif changes is None:
            lines.append(f"{name}: measured with {stamp}, which this checkout cannot compare with")
        elif measured_by_current_code(stamp, changes):
            lines.append(f"{name}: measured with {stamp}, the current measuring code")
        else:
            shown = "; ".join(c if len(c) <= 80 else c[:79] + "…" for c in changes[:MAX_LISTED])
            more = f"; {len(changes) - MAX_LISTED} more" if len(changes) > MAX_LISTED else ""
            lines.append(f"{name}: measured with {stamp}; {len(changes)} commit(s) changed the code it runs "
                         f"(megakd/, kernels/, configs/) since{f' ({shown}{more})' if changes else ''}: older code, "
                         "re-run it to measure this version")
    return lines


def unmeasured(report: str | Path) -> list[str]:
    """One line per finding `report` has no section for yet."""
    sections = set(section_changes(report))
    return [f"{name}: not measured yet (megakd repro {name} writes its section)" for name in FINDINGS
            if name not in sections]


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (the findings run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_bars(ax, per_draw: list[list[float]], labels: list[str], colors: list[str], **tick_text) -> None:
    """A bar per arm at the mean over draws (of each draw's seed mean), a dot per draw: an effect shown beside
    how far two pretraining draws of one arm land apart."""
    ax.bar(range(len(per_draw)), [fmean(v) for v in per_draw], color=colors, alpha=0.6)
    for x, values in enumerate(per_draw):
        ax.plot([x] * len(values), values, "ko", markersize=3)
    ax.set_xticks(range(len(per_draw)), labels, **tick_text)


def save_figure(fig, path: Path) -> Path:
    """Write a finding's plot (PNG, beside the report under repro/) and free the figure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return path
