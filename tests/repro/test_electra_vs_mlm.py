"""`megakd repro electra_vs_mlm`: the arms' pretraining FLOPs matched (counted here from `megakd/bench/flops.py` on
the planned runs' own configs), the verdict rules on made-up measurements, and the quick mode end to end."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

from megakd.bench.flops import step_flops
from megakd.cli import main
from megakd.config import load_config
from megakd.finish import finish_config
from megakd.repro import plan_findings
from megakd.repro.electra_vs_mlm import (
    ARMS,
    POINTS,
    QUICK_TASKS,
    TASKS,
    arm_claim,
    curve_outcome,
    placement,
    scored_points,
    verdict_of,
)
from megakd.repro.report import VERDICTS
from megakd.repro.settings import SILENT_RUN

# ---------------------------------------------------------------------------------------------------------
# FLOP matching and the plan


def _planned_runs(tmp_path: Path) -> tuple[list[dict], float]:
    """Every pretraining job of the full plan as its resolved config's numbers, and the plan's minutes."""
    plan = plan_findings(["electra_vs_mlm"], tmp_path / "work", workers=2)
    runs = []
    for key, job in plan.jobs.items():
        if not key.startswith("pretrain:"):
            continue
        recipe, overrides, *_ = job.args
        cfg = finish_config(load_config(recipe, [*SILENT_RUN, *overrides, "run.dir=_"]))
        disc = cfg.model.discriminator if cfg.model.objective == "electra" else cfg.model.generator
        arm = "MLM" if cfg.model.objective == "mlm" else \
            "ELECTRA 15 %" if cfg.electra.rtd_positions == "masked" else "ELECTRA"
        runs.append({"arm": arm, "size": (disc.num_layers, disc.hidden_size), "draw": cfg.train.seed,
                     "steps": cfg.train.max_steps, "every": cfg.run.save_every, "keep": cfg.run.keep_last,
                     "step": step_flops(cfg, cfg.train.global_batch_size).model,
                     "same_shapes": cfg.model.generator.hidden_size == disc.hidden_size
                     and cfg.model.generator.num_layers == disc.num_layers})
    return runs, plan.minutes


def test_arms_pretrain_with_equal_flops_at_each_compute_point(tmp_path):
    runs, minutes = _planned_runs(tmp_path)
    assert minutes < 120  # the full finding plans under two hours with --jobs 2
    groups: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in runs:
        assert r["arm"] not in groups[r["size"], r["draw"]]
        groups[r["size"], r["draw"]][r["arm"]] = r
    assert sorted({size for size, _ in groups}) == [(2, 64), (4, 128)]
    assert sorted({draw for _, draw in groups}) == [0, 1] and len(groups) == 4
    for arms in groups.values():
        assert set(arms) == set(ARMS)
        assert all(r["same_shapes"] and r["keep"] == 0 for r in arms.values())
        electra, masked, mlm = arms["ELECTRA"], arms["ELECTRA 15 %"], arms["MLM"]
        assert masked["steps"] == electra["steps"] and masked["step"] == electra["step"]
        assert mlm["steps"] > 1.5 * electra["steps"]  # the masked LM's step is cheaper: it runs more of them
        one_step = max(electra["step"], mlm["step"])
        # the end, and the half-way checkpoint (run.save_every): within one step's FLOPs of each other
        assert abs(mlm["steps"] * mlm["step"] - electra["steps"] * electra["step"]) <= one_step
        assert abs(mlm["every"] * mlm["step"] - electra["every"] * electra["step"]) <= one_step
        assert electra["every"] * 2 == electra["steps"]


def test_rt_scores_both_compute_points_and_pairs_the_end_on_a_dev_subset(tmp_path):
    """The full plan's fine-tuning: every pretraining run's checkpoints at both points on RT (the curve), the last
    only on pairs, against 1,000 of its dev pairs (what fits two hours); random init once per size and task."""
    plan = plan_findings(["electra_vs_mlm"], tmp_path / "work", workers=2)
    ends = {}  # pretraining run's directory -> its last step
    for key, job in plan.jobs.items():
        if key.startswith("pretrain:"):
            cfg = load_config(job.args[0], [*SILENT_RUN, *job.args[1], "run.dir=_"])
            ends[key.removeprefix("pretrain:")] = cfg.train.max_steps  # the key names the run's directory
    scored = defaultdict(list)  # (task, run) -> the steps it fine-tunes
    for key, job in plan.jobs.items():
        if not key.startswith("finetune:"):
            continue
        config, overrides, *_ = job.args
        task = "pairs" if "pairs" in Path(config).name else "RT"
        assert ("task.max_dev_examples=1000" in overrides) == (task == "pairs")
        path = next(o.split("=", 1)[1] for o in overrides if o.startswith("model.path="))
        if "model.init=random" in overrides:
            scored[task, "random"].append(path)
            continue
        run, step = re.fullmatch(r".*/pretrained/(\w+)/checkpoints/step_0*(\d+)", path).groups()
        scored[task, run].append(int(step))
    assert len(ends) == 12 and len(scored["RT", "random"]) == len(scored["pairs", "random"]) == 2
    for run, end in ends.items():
        assert sorted(scored["RT", run]) == [round(end / 2), end] and scored["pairs", run] == [end]


# ---------------------------------------------------------------------------------------------------------
# Verdict rules on made-up measurements: {size: {draw: {arm: {task: [per point: per seed]}, random: {task}}}}

LOW, MID, HIGH = [0.60, 0.61, 0.62], [0.70, 0.71, 0.72], [0.80, 0.81, 0.82]


def _draw(electra, masked, mlm, random=LOW) -> dict:
    """One draw as full mode scores it: each arm the same seeds (lists of per-seed scores) at both compute points
    on RT and at the end on pairs."""
    return {"random": {t: random for t in TASKS},
            **{arm: {t: [v] * len(scored_points(t, POINTS)) for t in TASKS}
               for arm, v in zip(ARMS, (electra, masked, mlm))}}


def _measured(**per_size) -> dict:
    return {size: {0: draws[0], 1: draws[1]} for size, draws in per_size.items()}


def test_electra_ahead_at_every_size_is_reproduced():
    ahead = (_draw(HIGH, MID, MID), _draw(HIGH, MID, MID))
    verdict, reason = verdict_of(_measured(small=ahead, large=ahead))
    assert verdict == "reproduced"
    assert "small: ELECTRA ahead" in reason and "ELECTRA 15 % between them" in reason
    assert "loses" not in reason


def test_reason_names_each_tasks_compute_points():
    """RT's tests are at the half-way and end checkpoints, pairs' (scored at the end only) at the end."""
    ahead = {0: _draw(HIGH, MID, MID), 1: _draw(HIGH, MID, MID)}
    _, reason = arm_claim(ahead, "ELECTRA", "MLM")
    rt, pairs = (re.search(rf"{task}, ELECTRA − MLM: draw 0: ([^;]*);", reason).group(1) for task in ("RT", "pairs"))
    test = r"\+0\.1 \([^)]*\)"
    assert re.fullmatch(f"half-way {test}, end {test}", rt) and re.fullmatch(f"end {test}", pairs)


def test_electra_behind_at_one_size_names_it():
    ahead = (_draw(HIGH, MID, MID), _draw(HIGH, MID, MID))
    behind = (_draw(MID, MID, HIGH), _draw(MID, MID, HIGH))
    verdict, reason = verdict_of(_measured(small=behind, large=ahead))
    assert verdict == "not reproduced at this scale"
    assert reason.startswith("ELECTRA loses to the masked LM at equal compute at small.")
    assert "large: ELECTRA ahead" in reason


def test_disagreeing_draws_are_not_counted():
    verdict, reason = verdict_of(_measured(small=(_draw(HIGH, MID, MID), _draw(MID, MID, HIGH))))
    assert verdict == "inconclusive" and "the draws disagree: not counted" in reason


def test_a_task_no_arm_beats_random_init_on_cannot_rank():
    flat = (_draw(HIGH, MID, MID, random=[0.9, 0.91, 0.92]), _draw(HIGH, MID, MID, random=[0.9, 0.91, 0.92]))
    verdict, reason = verdict_of(_measured(small=flat))
    assert verdict == "inconclusive" and "cannot rank pretraining" in reason
    # beating random init in one draw only is not enough either
    one = (_draw(HIGH, MID, MID), _draw(HIGH, MID, MID, random=[0.9, 0.91, 0.92]))
    assert arm_claim({0: one[0], 1: one[1]}, "ELECTRA", "MLM")[0] == 0


def test_curves_are_compared_point_by_point():
    assert curve_outcome([HIGH, MID], [MID, MID])[0] == 1  # ahead early, level later: ahead
    assert curve_outcome([MID, MID], [MID, HIGH])[0] == -1
    outcome, tests = curve_outcome([HIGH, LOW], [MID, MID])  # ahead early, behind later: mixed
    assert outcome == 0 and [t.direction() for t in tests] == [1, -1]
    noisy = [[0.70, 0.74, 0.69], [0.72, 0.69, 0.73]]
    assert curve_outcome(noisy, [MID, MID])[0] == 0  # within seed noise
    with pytest.raises(ValueError):
        curve_outcome([MID], [MID, MID])  # the arms' compute points must pair up


def test_electra_15_is_placed_between_or_outside():
    between = {0: _draw(HIGH, MID, MID), 1: _draw(HIGH, MID, MID)}
    assert placement(between)[0] == "between"
    assert placement({0: _draw(HIGH, HIGH, MID), 1: _draw(HIGH, HIGH, MID)})[0] == "between"  # above the MLM
    assert placement({0: _draw(MID, HIGH, MID), 1: _draw(MID, HIGH, MID)})[0] == "outside"  # above ELECTRA
    assert placement({0: _draw(HIGH, LOW, MID), 1: _draw(HIGH, LOW, MID)})[0] == "outside"  # below the MLM
    assert placement({0: _draw(MID, MID, MID), 1: _draw(MID, MID, MID)})[0] == "undecided"


# ---------------------------------------------------------------------------------------------------------
# The quick mode end to end


def _section(report: Path) -> str:
    match = re.search(r"<!-- finding:electra_vs_mlm -->(.*)<!-- /finding:electra_vs_mlm -->", report.read_text(),
                      re.DOTALL)
    assert match, "no electra_vs_mlm section"
    return match.group(1)


@pytest.mark.slow
def test_quick_mode_writes_the_section_curves_and_floors(tmp_path):
    out, work = tmp_path / "docs" / "REPRODUCTION.md", tmp_path / "work"
    assert main(["repro", "electra_vs_mlm", "--quick", "--jobs", "1", "--out", str(out), "--work", str(work)]) == 0
    section = _section(out)
    for part in ("**Paper.**", "**Setup.**", "`megakd repro electra_vs_mlm --quick`", "seeds 0, 1",
                 "`electra.rtd_positions=masked`", "ELECTRA 15 %"):
        assert part in section, part
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header, *rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[:1] + lines[2:]]
    scores = [f"{t} dev accuracy, draw {w}" for t in QUICK_TASKS for w in (0, 1)]
    assert header == ["encoder", "arm", "steps", "pretraining FLOPs", "end of pretraining (per draw)", *scores]
    # per size: each arm at its two compute points, then random init; the tf-idf floor last
    arms = [arm for arm in ARMS for _ in range(2)] + ["random init"]
    assert [row[1] for row in rows] == arms * 2 + ["tf-idf floor"]
    assert [row[0] for row in rows] == ["1 × 16"] * 7 + ["1 × 32"] * 7 + ["—"]
    assert all(len(row) == len(header) for row in rows)
    assert all(cell.count("±") == 1 for row in rows[:-1] for cell in row[5:])
    assert all(0.0 <= float(cell) <= 1.0 for cell in rows[-1][5:])
    for size in (rows[:7], rows[7:14]):
        electra, mlm = size[:2], size[4:6]
        assert [int(r[2].replace(",", "")) for r in electra] == [6, 12]
        assert int(mlm[1][2].replace(",", "")) > 12  # equal FLOPs: more masked-LM steps
        flops = [float(r[3]) for r in (*electra, *mlm)]
        assert flops[2] == pytest.approx(flops[0], rel=0.25) and flops[3] == pytest.approx(flops[1], rel=0.1)
        assert size[1][4].startswith("RTD F1") and size[5][4].startswith("MLM acc")
    verdict = re.search(r"\*\*Verdict: (.+?)\.\*\* \S", section).group(1)
    assert verdict in VERDICTS
    assert (out.parent / "repro" / "electra_vs_mlm.png").stat().st_size > 0
    assert "![electra_vs_mlm](repro/electra_vs_mlm.png)" in section
    # the half-way checkpoints were kept beside the last, and fine-tuning scratch is gone
    runs = sorted((work / "pretrained").glob("*/checkpoints"))
    assert len(runs) == 12 and all(len(list(c.glob("step_*"))) >= 2 for c in runs)
    assert not [p for p in work.iterdir() if p.name != "pretrained"]
