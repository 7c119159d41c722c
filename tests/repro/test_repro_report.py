"""`megakd repro`: the report's structure (quick mode; the verdicts are not checked), and section merging."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from megakd.cli import main
from megakd.repro.report import VERDICTS, FindingReport, write_section


def _report(name: str, verdict: str = "inconclusive") -> FindingReport:
    return FindingReport(name=name, title=f"finding {name}", paper="claim", setup="ran it", columns=["a", "b"],
                         rows=[["1", "2"]], verdict=verdict, reason="because")


def test_sections_are_replaced_in_place_and_others_kept(tmp_path):
    out = tmp_path / "docs" / "REPRODUCTION.md"
    write_section(_report("first"), out)
    write_section(_report("second"), out)
    write_section(_report("first", "reproduced"), out)
    text = out.read_text()
    assert text.startswith("# Reproduction report")
    assert text.count("<!-- finding:first -->") == 1 and text.count("<!-- finding:second -->") == 1
    assert text.index("finding:first") < text.index("finding:second")  # replaced where it was
    assert "**Verdict: reproduced.**" in text and "**Verdict: inconclusive.**" in text
    # a new section goes where `order` puts it, whatever order the findings finished in
    write_section(_report("middle"), out, order=("first", "middle", "second"))
    text = out.read_text()
    assert text.index("finding:first") < text.index("finding:middle") < text.index("finding:second")
    write_section(_report("last"), out, order=("first", "middle", "second", "last"))
    assert out.read_text().rstrip().endswith("<!-- /finding:last -->")
    with pytest.raises(ValueError, match="verdict"):
        _report("x", "sort of").markdown()


@pytest.mark.slow
def test_quick_lambda_finding_writes_its_section(tmp_path):
    out = tmp_path / "docs" / "REPRODUCTION.md"
    write_section(_report("other"), out)  # an existing section of another finding survives
    # --jobs 1: in this process (12 jobs; as worker processes each would pay its imports, ~4 s: the workers'
    # path is soteacher's in test_repro_quick.py)
    assert main(["repro", "lambda", "--quick", "--jobs", "1", "--out", str(out), "--work", str(tmp_path / "work")]) == 0
    text = out.read_text()
    assert "<!-- finding:other -->" in text
    section = re.search(r"<!-- finding:lambda -->(.*)<!-- /finding:lambda -->", text, re.DOTALL).group(1)
    for part in ("**Paper.**", "**Setup.**", "`megakd repro lambda --quick`", "**Measured.**"):
        assert part in section, part
    rows = [line for line in section.splitlines() if line.startswith("| ") and "±" in line]
    modes = ("DecoupledOptim", "DecoupledOptim, ε=1e-16", "original ELECTRA")
    assert [tuple(r.split(" | ")[:2]) for r in rows] == [(f"| {m}", lam) for m in modes for lam in ("10", "50")]
    assert all(cell.count("±") == 1 for r in rows for cell in r.strip("| ").split(" | ")[2:6])
    fig_1_3 = [r.strip("| ").split(" | ")[6] for r in rows]  # filled for original ELECTRA only
    assert [cell.count("±") for cell in fig_1_3] == [0, 0, 0, 0, 1, 1]
    verdict = re.search(r"\*\*Verdict: (.+?)\.\*\* \S", section).group(1)
    assert verdict in VERDICTS
    assert (out.parent / "repro" / "lambda.png").stat().st_size > 0 and "![lambda](repro/lambda.png)" in section
    assert [p.name for p in (tmp_path / "work").iterdir()] == ["pretrained"]  # scratch runs removed, Fig. 1.3's cached


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})


def _head(repo) -> str:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_sections_say_which_code_measured_them_and_whether_it_changed_since(tmp_path, monkeypatch):
    """A section is stamped with the measuring commit; `repro --plan`'s lines mark it once megakd/, kernels/
    or configs/ change, not when only docs, another finding's module, or comments, docstrings and layout do,
    and mark an unstamped section and uncommitted code."""
    from megakd.repro import report

    repo = tmp_path / "src"
    (repo / "megakd").mkdir(parents=True)
    (repo / "megakd" / "a.py").write_text("x = 1\n")
    (repo / "configs").mkdir()
    (repo / "configs" / "r.yaml").write_text("lr: 0.001\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "one")
    monkeypatch.setattr(report, "SOURCE_ROOT", repo)
    head = _head(repo)
    assert report.code_version() == head
    out = tmp_path / "REPRODUCTION.md"
    write_section(FindingReport(**{**vars(_report("stamped")), "measured_with": report.code_version()}), out)
    write_section(_report("old"), out)
    assert report.section_versions(out) == {"stamped": head, "old": None}
    assert report.staleness(out) == [f"stamped: measured with {head}, the current measuring code",
                                     "old: measuring code not recorded (re-run it to stamp it)"]
    (repo / "notes.md").write_text("docs only\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "docs")
    assert "the current measuring code" in report.staleness(out)[0]
    (repo / "megakd" / "repro").mkdir()
    (repo / "megakd" / "repro" / "tgt.py").write_text("another finding's settings\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "tgt's settings")
    assert "the current measuring code" in report.staleness(out)[0]
    (repo / "megakd" / "a.py").write_text('"""Why x is one."""\n\n# a comment\nx = (1)  # still one\n')
    (repo / "configs" / "r.yaml").write_text("# the paper's LR\nlr: 1.0e-3\n")
    _git(repo, "commit", "-qam", "comments, a docstring and layout only")
    assert "the current measuring code" in report.staleness(out)[0]
    (repo / "megakd" / "a.py").write_text("x = 2\n")
    assert report.code_version() == _head(repo) + "+changes"  # measured with code that no commit holds
    _git(repo, "commit", "-qam", "code")
    assert report.staleness(out)[0] == (f"stamped: measured with {head}; 1 commit(s) changed the code it runs "
                                        f"(megakd/, kernels/, configs/) since ({_head(repo)} code): older code, "
                                        "re-run it to measure this version")
    for i in range(3):
        (repo / "megakd" / "a.py").write_text(f"x = {3 + i}\n")
        _git(repo, "commit", "-qam", f"change {i}")
    assert f"4 commit(s) changed the code it runs (megakd/, kernels/, configs/) since ({_head(repo)} change 2; " \
           in report.staleness(out)[0] and "; 1 more): older code" in report.staleness(out)[0]
    (repo / "configs" / "r.yaml").write_text("lr: 0.002\n")
    _git(repo, "commit", "-qam", "a recipe's value")
    assert f"5 commit(s) changed the code it runs (megakd/, kernels/, configs/) since ({_head(repo)} a recipe's " \
           in report.staleness(out)[0]


def test_the_reports_scale_table_is_the_one_the_findings_settings_give():
    """docs/REPRODUCTION.md's scale gap is computed, not typed: a change to a finding's settings or recipe
    that leaves the table stale fails here (regenerate with megakd.repro.scale.write_scale)."""
    from megakd.repro.scale import END, START, scale_markdown

    text = (Path(__file__).parents[2] / "docs" / "REPRODUCTION.md").read_text()
    assert text[text.index(START): text.index(END) + len(END)] == scale_markdown()
    assert text.index(END) < text.index("<!-- finding:")
