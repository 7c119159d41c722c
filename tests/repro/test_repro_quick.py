"""`megakd repro NAME --quick` end to end for two findings: the report's structure, not its verdicts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megakd.cli import main
from megakd.repro.report import VERDICTS, code_version


def _section(report: Path, name: str) -> str:
    match = re.search(rf"<!-- finding:{name} -->(.*)<!-- /finding:{name} -->", report.read_text(), re.DOTALL)
    assert match, f"no section {name}"
    return match.group(1)


def _table(section: str) -> tuple[list[str], list[list[str]]]:
    lines = [line for line in section.splitlines() if line.startswith("|")]
    assert lines[1].startswith("|---")
    split = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return split[0], split[2:]


@pytest.mark.slow
def test_quick_findings_write_their_sections(tmp_path):
    out, work = tmp_path / "docs" / "REPRODUCTION.md", tmp_path / "work"
    expected = {
        "disc_lr": (["η_D / η_G", "η_D", "RTD F1 (last 10 %, per draw)", "gen acc (last 10 %, per draw)",
                     "RT dev accuracy, draw 0", "RT dev accuracy, draw 1"], ["1×", "3.75×", "7.5×", "15×"], [4, 5]),
        "soteacher": (["draw", "teacher", "teacher acc", "ECE", "NLL", "ECE+TS", "NLL+TS", "student acc",
                       "agreement"], ["0", "0", "1", "1"], [2, 3, 4, 5, 6, 7, 8]),
    }
    # disc_lr one job after the other in this process, soteacher as two single-thread worker processes: a
    # worker process pays its imports per job (~4 s), so the finding with the fewest jobs (soteacher's 7,
    # not disc_lr's 16) is the one that checks the workers' path
    for name, jobs in zip(expected, ("1", "2")):
        assert main(["repro", name, "--quick", "--seeds", "0", "1", "--jobs", jobs, "--out", str(out),
                     "--work", str(work)]) == 0
    for name, (columns, first_cells, mean_std_columns) in expected.items():
        section = _section(out, name)
        for part in ("**Paper.**", "**Setup.**", f"`megakd repro {name} --quick`", "**Measured.**", "seeds 0, 1"):
            assert part in section, (name, part)
        header, rows = _table(section)
        assert header == columns
        assert [row[0] for row in rows] == first_cells
        assert all(len(row) == len(columns) for row in rows)
        assert all(row[i].count("±") == 1 for row in rows for i in mean_std_columns)
        verdict = re.search(r"\*\*Verdict: (.+?)\.\*\* \S", section).group(1)
        assert verdict in VERDICTS
        assert (out.parent / "repro" / f"{name}.png").stat().st_size > 0 and f"![{name}](repro/{name}.png)" in section
        assert f"<!-- measured-with: {code_version()} -->" in section
    assert out.read_text().index("finding:disc_lr") < out.read_text().index("finding:soteacher")
    # The shared encoder soteacher fine-tunes is cached: a second finding reuses it instead of pretraining
    # (here in this process what the worker processes pretrained).
    cached = sorted((work / "pretrained").iterdir())
    assert main(["repro", "soteacher", "--quick", "--seeds", "0", "1", "--jobs", "1", "--out", str(out),
                 "--work", str(work)]) == 0
    assert sorted((work / "pretrained").iterdir()) == cached
    assert not [p for p in work.iterdir() if p.name != "pretrained"]  # fine-tuning scratch removed


@pytest.mark.slow
def test_quick_dwt_writes_both_budgets_and_the_remapping_curves(tmp_path):
    """dwt's short-budget arms (teachers and schedules, one row each) and its whole-budget runs (a row per
    draw and init, each fine-tuned on RT) in one table."""
    out = tmp_path / "docs" / "REPRODUCTION.md"
    # --jobs 1: one job after another in this process (worker processes are soteacher's run above; on two
    # cores shared with another test file they only add their imports)
    assert main(["repro", "dwt", "--quick", "--jobs", "1", "--out", str(out), "--work", str(tmp_path / "work")]) == 0
    header, rows = _table(_section(out, "dwt"))
    assert header[:2] == ["steps", "teacher"] and header[-2] == "RT dev accuracy"
    assert [row[1] for row in rows] == ["none", "weak", "very weak", "extremely weak", "weak, Strong 1:4",
                                        "weak, 4 → 1", "random init", "remapped", "random init", "remapped"]
    assert [row[0] for row in rows[6:]] == ["16, draw 0", "16, draw 0", "16, draw 1", "16, draw 1"]
    assert all(row[-2] == "—" for row in rows[:6]) and all(row[-2].count("±") == 1 for row in rows[6:])
    assert re.search(r"\*\*Verdict: (.+?)\.\*\* short budget", _section(out, "dwt")).group(1) in VERDICTS


def test_unknown_recipe_is_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "REPRODUCTION.md"
    assert main(["repro", "disc_lr", "--quick", "--recipe", str(tmp_path / "nope.yaml"), "--out", str(out),
                 "--work", str(tmp_path / "work")]) == 2
    assert "nope.yaml" in capsys.readouterr().err and not out.exists() and not (tmp_path / "work").exists()
