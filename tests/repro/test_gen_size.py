"""Finding `gen_size`: its verdict rules on made-up measurements (each claim holding, reversed and undecided),
its plan (the budget, and how the η_G selection is priced), and `--quick` end to end."""

from __future__ import annotations

import re

import pytest

from megakd.cli import main
from megakd.repro import gen_size, plan_findings
from megakd.repro.report import VERDICTS, code_version

HIGH = [0.80, 0.82, 0.81]  # above MID in every seed by 0.04–0.06
MID = [0.76, 0.76, 0.75]
LOW = [0.70, 0.71, 0.69]
CHANCE = [0.50, 0.51, 0.50]
NOISY = [0.80, 0.70, 0.76]  # mean above MID, but not significantly


def _mode(acc: dict[int, list[float]], f1: dict[int, float] | None = None) -> dict:
    f1 = f1 or {1: 0.40, 2: 0.35, 4: 0.30}
    return {d: {"acc": {"RT": a, "pairs": a}, "f1_deepest": f1[d], "rtd_f1": 0.5, "finite": True}
            for d, a in acc.items()}


def _draw(original: dict[int, list[float]], decoupled: dict[int, list[float]], f1: dict[int, float] | None = None,
          random: list[float] = CHANCE) -> dict:
    return {"random": {"RT": random, "pairs": random}, "original ELECTRA": _mode(original, f1),
            "DecoupledOptim": _mode(decoupled)}


FALLS = {1: HIGH, 2: MID, 4: LOW}  # original ELECTRA as the paper has it
FLAT = {1: MID, 2: MID, 4: HIGH}  # DecoupledOptim as the paper has it: its deepest best, above original's


def test_every_claim_holding_reproduces_and_the_reason_names_each():
    verdict, reason = gen_size.draw_verdict(_draw(FALLS, FLAT))
    assert verdict == "reproduced"
    for claim in ("falls under original (RT) holds", "removed by DecoupledOptim (pairs) holds", "Fig. 1.2 holds"):
        assert claim in reason
    assert "original 1 − 4 layers +0.11" in reason  # the best shallower generator is the one compared


def test_a_deepest_generator_that_helps_under_original_reverses_claim_1():
    verdict, reason = gen_size.draw_verdict(_draw({1: LOW, 2: MID, 4: HIGH}, FLAT))
    assert verdict == "not reproduced at this scale" and "falls under original (RT) reversed" in reason


def test_a_fall_that_remains_under_decoupledoptim_reverses_claim_2():
    # its deepest beats original's deepest, but its own shallower generator is still significantly above it
    verdict, reason = gen_size.draw_verdict(_draw(FALLS, {1: [0.90, 0.91, 0.92], 2: MID, 4: HIGH}))
    assert verdict == "not reproduced at this scale" and "removed by DecoupledOptim (RT) reversed" in reason
    # decoupled's deepest significantly below original's deepest reverses it too
    verdict, reason = gen_size.draw_verdict(_draw({1: HIGH, 2: HIGH, 4: MID}, {1: LOW, 2: LOW, 4: LOW}))
    assert "removed by DecoupledOptim (RT) reversed" in reason


def test_differences_within_seed_noise_are_undecided():
    verdict, reason = gen_size.draw_verdict(_draw({1: NOISY, 2: MID, 4: MID}, FLAT))
    assert verdict == "inconclusive" and "falls under original (RT) undecided" in reason


def test_a_task_that_cannot_rank_pretraining_leaves_its_claims_undecided():
    # every arm at or below random init: the same made-up falls count for nothing
    verdict, reason = gen_size.draw_verdict(_draw(FALLS, FLAT, random=[0.95, 0.96, 0.97]))
    assert verdict == "inconclusive"
    assert "RT: no arm beats random init significantly" in reason and "Fig. 1.2 holds" in reason


def test_fig12_rule():
    assert gen_size.fig12_claim({1: 0.40, 2: 0.35, 4: 0.30})[0] == 1
    assert gen_size.fig12_claim({1: 0.30, 2: 0.35, 4: 0.40})[0] == -1
    assert gen_size.fig12_claim({1: 0.40, 2: 0.395, 4: 0.30})[0] == 0  # one step within the margin
    assert gen_size.fig12_claim({1: 0.40, 2: 0.30, 4: 0.35})[0] == 0  # not monotone
    at_prior = gen_size.fig12_claim({1: 0.04, 2: 0.02, 4: 0.0})
    assert at_prior[0] == 0 and "at the prior" in at_prior[1]
    verdict, reason = gen_size.draw_verdict(_draw(FALLS, FLAT, f1={1: 0.30, 2: 0.35, 4: 0.40}))
    assert verdict == "not reproduced at this scale" and "Fig. 1.2 reversed" in reason


def test_the_finding_counts_only_what_both_draws_agree_on():
    good, flat = _draw(FALLS, FLAT), _draw({1: NOISY, 2: MID, 4: MID}, FLAT)
    assert gen_size.verdict_of({0: good, 1: good})[0] == "reproduced"
    verdict, reason = gen_size.verdict_of({0: good, 1: flat})
    assert verdict == "inconclusive" and reason.startswith("The draws disagree")


def test_selection_takes_the_best_score_and_the_lower_rate_on_a_tie():
    assert gen_size.choose({"0.0002": 0.30, "0.0005": 0.42, "0.001": 0.35}) == "0.0005"
    assert gen_size.choose({"0.001": 0.40, "0.0002": 0.40, "0.0005": 0.10}) == "0.0002"


def test_full_plan_fits_two_hours_on_two_cores_and_prices_the_selection(tmp_path):
    plan = plan_findings(["gen_size"], tmp_path / "work", workers=2)
    assert plan.minutes < 120
    kinds: dict[str, list] = {}
    for key, job in plan.jobs.items():  # pretrain:…, finetune:…, and the finding's own gen_size:KIND:…
        kinds.setdefault(key.split(":")[1] if key.startswith("gen_size:") else key.split(":")[0], []).append(job)
    # 3 depths x (2 original draws + 3 η_G candidates), 3 selections, 3 x 2 chosen arms, 2 designs x 2 draws
    # of Fig. 1.2, (12 arms + random init) x 2 tasks
    assert {k: len(v) for k, v in kinds.items()} == {"pretrain": 15, "select": 3, "chosen": 6, "fig12": 4,
                                                     "finetune": 26}
    candidates = sorted(j.seconds for j in kinds["pretrain"] if "optim.generator.lr=0.001" in j.label)
    chosen = sorted(j.seconds for j in kinds["chosen"])
    assert chosen[:3] == [10.0] * 3  # draw 0's arm is its selection run, from the cache: only the job's start
    assert chosen[3:] == pytest.approx(candidates)  # draw 1's: a new run of each depth
    assert len(set(candidates)) == 3  # priced by the generator's depth
    pairs = [j.seconds for j in kinds["finetune"] if "finetune-pairs" in j.label]
    rt = [j.seconds for j in kinds["finetune"] if "finetune-rt" in j.label]
    # 1,500 pairs at 2.34 RT sentences each against 3,000 RT sentences
    assert pairs[0] - 10 == pytest.approx((rt[0] - 10) * 1500 / 3000 * gen_size.PAIR_TOKENS)
    assert plan.end[next(k for k in plan.jobs if ":chosen:" in k)] > min(
        plan.end[k] for k in plan.jobs if ":select:" in k)  # a chosen arm only after its selection
    assert not (tmp_path / "work").exists()


def _table(section: str) -> tuple[list[str], list[list[str]]]:
    lines = [line for line in section.splitlines() if line.startswith("|")]
    split = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return split[0], split[2:]


@pytest.mark.slow
def test_quick_gen_size_writes_its_section(tmp_path):
    """Both designs at each generator depth and random init, on both tasks; draw 0's DecoupledOptim arms are
    the selection runs themselves (no extra pretraining), and the choices and links go with the invocation."""
    out, work = tmp_path / "docs" / "REPRODUCTION.md", tmp_path / "work"
    assert main(["repro", "gen_size", "--quick", "--jobs", "1", "--out", str(out), "--work", str(work)]) == 0
    section = re.search(r"<!-- finding:gen_size -->(.*)<!-- /finding:gen_size -->", out.read_text(), re.DOTALL)[1]
    for part in ("**Paper.**", "**Setup.**", "`megakd repro gen_size --quick`", "seeds 0, 1", "Selection scores"):
        assert part in section, part
    header, rows = _table(section)
    assert header == ["design", "generator", "η_G / η_D", "RTD F1, own generator (per draw)",
                      "RTD F1 vs the 3-layer generator (per draw)", "RT dev accuracy, draw 0",
                      "RT dev accuracy, draw 1", "pairs dev accuracy, draw 0", "pairs dev accuracy, draw 1"]
    arms = [[mode, f"{d} × 32"] for mode in gen_size.MODES for d in gen_size.QUICK_DEPTHS]
    assert [row[:2] for row in rows] == [*arms, ["random init", "3 × 32 (discriminator)"]]
    assert all(row[i].count("±") == 1 for row in rows for i in range(5, 9))
    assert all(re.fullmatch(r"\d\.\d{3} / \d\.\d{3}", row[i]) for row in rows[:-1] for i in (3, 4))
    chosen = [row[2].split(" / ")[0] for row in rows[3:6]]
    assert all(lr in [f"{x:g}" for x in gen_size.QUICK_GENERATOR_LRS] for lr in chosen)
    assert re.search(r"\*\*Verdict: (.+?)\.\*\* \S", section)[1] in VERDICTS
    assert (out.parent / "repro" / "gen_size.png").stat().st_size > 0 and "![gen_size](repro/gen_size.png)" in section
    assert f"<!-- measured-with: {code_version()} -->" in section
    # 3 depths x (2 original draws + 2 candidates) + 3 chosen arms of draw 1: draw 0's are the candidates
    assert len([p for p in (work / "pretrained").iterdir() if p.is_dir()]) == 15
    assert sorted(p.name for p in work.iterdir()) == ["pretrained"]  # choices, links and scratch removed
