"""Finding `dwt`: a weak teacher helps a larger student, weaker ones hurt it, a strong soft loss helps
early and the normal one later, and remapping hurts in the end.

DWT (Lee et al., ACL'23) Fig. 2–4: distilling a frozen teacher MLM of 0.78× the student's size
into it (α_h:α_s = 1:1) gains +1.44 GLUE over the standalone student; 0.57× and 0.46× teachers lose
1.37 and 2.76; a "Strong" soft loss (1:4) converges faster early but "Normal" (1:1) wins later;
initialising the student from the teacher (parameter remapping) converges to a worse optimum that
further pretraining does not fix. Here: the DWT student recipe (`configs/dwt-mini.yaml`, 6 × 128
BERT-MLM at the setting whose models leave the masked-LM unigram plateau; quick mode:
`configs/dwt-tiny.yaml` at tiny sizes) on a short budget alone and distilled from 4-, 2- and
1-layer teachers of its own recipe (0.77× / 0.54× / 0.42× its parameters), the weak teacher under
each of the three soft-loss schedules (`configs/dwt-weak*.yaml`); and on the recipe's whole
budget, random init against remapping from the weak teacher, each pretrained twice and judged
downstream (RT accuracy after fine-tuning), as the paper judges on GLUE.
"""

from __future__ import annotations

from pathlib import Path

from megakd.engine.runlog import tail_mean
from megakd.repro.finding_run import FindingRun, ReportFn
from megakd.repro.report import FindingReport, mean_std_text, pyplot, save_figure
from megakd.repro.settings import CONFIGS, FULL_FINETUNE, QUICK_FINETUNE, Settings, recipe_value
from megakd.repro.stats import claims_verdict, compare, draws_verdict
from megakd.repro.training import last_value, metric_rows, seed_values

DISTILL_KEYS = ("temperature", "alpha_hard", "alpha_soft_start", "alpha_soft_end", "alpha_schedule")
TEACHERS = {"weak": 4, "very weak": 2, "extremely weak": 1}  # teacher layers (the student has 6)
# The weak teacher's soft-loss schedules, α_h:α_s: the paper's two settings and its recommendation
# (never run there). "weak" itself is Normal; the other teachers use Normal too.
SCHEDULES = {"weak": CONFIGS / "dwt-weak.yaml", "weak, Strong 1:4": CONFIGS / "dwt-weak-strong.yaml",
             "weak, 4 → 1": CONFIGS / "dwt-weak-4to1.yaml"}
EARLY = (0.2, 0.4)  # the part of a run (after the 20 % warm-up of the short budget) where Strong should lead
LONG_ARMS = {"random init": (), "remapped": ("distill.init=remap",)}  # both from the weak teacher, Normal
# Full mode: 1,000 of the recipe's 5,000 steps for the teacher and schedule comparisons (the mini
# models leave the unigram plateau by step ~300 and reach masked accuracy ~0.15 by 1,000), three
# student seeds for the paired tests; remapping on the recipe's whole 5,000 steps (where the paper's
# claim is), two draws, each student fine-tuned on RT over the seeds.
FULL = Settings(CONFIGS / "dwt-mini.yaml", seeds=(0, 1, 2), steps=1000, finetune=FULL_FINETUNE, draws=(0, 1),
                whole_budget="remapping")
QUICK = Settings(CONFIGS / "dwt-tiny.yaml", seeds=(0, 1), steps=8, finetune=QUICK_FINETUNE, draws=(0, 1),
                 whole_budget="remapping", pretrain=(
    "train.global_batch_size=8", "train.micro_batch_size=8", "optim.schedule.warmup_steps=2", "train.log_every=1",
    "train.probe_fit_examples=200", "train.probe_eval_examples=100", "model.generator.hidden_size=32",
    "model.generator.num_heads=2", "model.generator.intermediate_size=64"))
QUICK_LONG_STEPS = 16  # quick mode's "whole budget"
PAPER_GAINS = {"weak": "+1.44", "very weak": "−1.37", "extremely weak": "−2.76",
               "weak, Strong 1:4": "ahead early, behind later", "weak, 4 → 1": "recommended, not run",
               "random init": "above remapped", "remapped": "below random init"}
PAPER = ("DWT (Lee et al., ACL'23) Fig. 2–4: a 6-layer BERT student (GLUE dev 79.89 alone) distilled "
         "from a frozen teacher MLM with α_h:α_s = 1:1: weak teacher (0.78× its parameters, 2.23 GLUE points below "
         "the student) 81.33 (+1.44); very weak (0.57×) −1.37; extremely weak (0.46×) −2.76. \"Strong\" (1:4) "
         "converges faster early on (MNLI, CoLA, QQP, SST-2) but \"Normal\" (1:1) wins later; the paper "
         "recommends decaying α_s (e.g. 4 → 1) but never ran it. Parameter remapping (student layers initialised "
         "from the teacher's, last layer repeated) converges to a worse optimum than random init that further "
         "pretraining does not fix. One run per configuration, no error bars.")


def window_mean(rows: list[dict], key: str, start: float, end: float) -> float:
    """Mean of `key` over the logged steps between fractions `start` and `end` of the run (at least one row)."""
    values = [r[key] for r in rows if key in r]
    lo, hi = int(start * len(values)), max(int(start * len(values)) + 1, round(end * len(values)))
    window = values[lo:hi]
    return sum(window) / len(window)


def declare(run: FindingRun) -> ReportFn:
    steps = run.settings.steps or int(recipe_value(run.recipe, "train.max_steps"))
    long = QUICK_LONG_STEPS if run.quick else int(recipe_value(run.recipe, "train.max_steps"))

    def budget(n: int) -> list[str]:  # the probe once, at the end
        return [*run.settings.pretrain, f"train.max_steps={n}", f"train.probe_every={n}"]

    overrides = budget(steps)
    student_layers = int(recipe_value(run.recipe, "model.generator.num_layers", tuple(overrides)))

    def distill(schedule: Path, teacher) -> list[str]:
        return [*(f"distill.{k}={recipe_value(schedule, f'distill.{k}')}" for k in DISTILL_KEYS),
                f"distill.teacher={teacher.path}"]

    teachers = {name: run.pretrain([*overrides, f"model.generator.num_layers={layers}"])
                for name, layers in TEACHERS.items()}
    arms = {"none": ([], None),
            **{name: (distill(SCHEDULES["weak"], teacher), teacher) for name, teacher in teachers.items()},
            **{name: (distill(schedule, teachers["weak"]), teachers["weak"])
               for name, schedule in SCHEDULES.items() if name != "weak"}}
    students = {(arm, seed): run.pretrain([*overrides, *arm_overrides, f"train.seed={seed}"], teacher=teacher)
                for arm, (arm_overrides, teacher) in arms.items() for seed in run.seeds}
    long_teacher = run.pretrain([*budget(long), f"model.generator.num_layers={TEACHERS['weak']}"])
    long_runs = {}
    for draw in run.settings.draws:
        for arm, arm_overrides in LONG_ARMS.items():
            student = run.pretrain([*budget(long), *distill(SCHEDULES["weak"], long_teacher), *arm_overrides,
                                    f"train.seed={draw}"], teacher=long_teacher)
            long_runs[draw, arm] = student, run.finetune([f"model.path={student.path}", run.seeds_override],
                                                         student)

    def report() -> FindingReport:
        short: dict[str, dict[str, list[float]]] = {}
        for (arm, _), student in students.items():
            rows = metric_rows(student.path)
            m = short.setdefault(arm, {"loss": [], "early": [], "acc": [], "probe": []})
            m["loss"].append(tail_mean(rows, "gen_loss"))
            m["early"].append(window_mean(rows, "gen_loss", *EARLY))
            m["acc"].append(tail_mean(rows, "gen_acc"))
            m["probe"].append(last_value(rows, "probe_acc"))
        curves = {key: metric_rows(student.path) for key, (student, _) in long_runs.items()}
        whole: dict[int, dict[str, dict]] = {}
        for (draw, arm), (_, tuned) in long_runs.items():
            rows = curves[draw, arm]
            whole.setdefault(draw, {})[arm] = {"early": window_mean(rows, "gen_loss", 0.1, 0.2),
                                               "loss": tail_mean(rows, "gen_loss"),
                                               "probe": last_value(rows, "probe_acc"),
                                               "rt": seed_values(run.result(tuned))}
        teacher_rows = {name: metric_rows(teacher.path) for name, teacher in teachers.items()}
        width = recipe_value(run.recipe, "model.generator.hidden_size", tuple(overrides))
        sizes = {name: f"{layers} × {width}" for name, layers in TEACHERS.items()}
        table = [[f"{steps:,}", arm, sizes.get(arm.split(",")[0], "—"),
                  f"{tail_mean(teacher_rows[arm.split(',')[0]], 'gen_loss'):.3f}" if arm != "none" else "—",
                  mean_std_text(m["early"]), mean_std_text(m["loss"]),
                  mean_std_text([b - a for a, b in zip(m["loss"], short["none"]["loss"])]),
                  mean_std_text(m["acc"]), mean_std_text(m["probe"]), "—", PAPER_GAINS.get(arm, "0 (79.89)")]
                 for arm, m in short.items()]
        table += [[f"{long:,}, draw {draw}", arm, f"{sizes['weak']}", "—", f"{m['early']:.3f}", f"{m['loss']:.3f}",
                   "—", "—", f"{m['probe']:.3f}", mean_std_text(m["rt"]), PAPER_GAINS[arm]]
                  for draw, by_arm in whole.items() for arm, m in by_arm.items()]
        verdict, reason = verdict_of(short, whole)
        plot = _plot(short, curves, run.out_dir / "repro" / "dwt.png")
        setup = _setup(run, steps, long, student_layers, width)
        return FindingReport(name="dwt", title="DWT: teacher strength, soft-loss schedule and parameter remapping",
                             paper=PAPER, setup=setup,
                             columns=["steps", "teacher", "teacher size", "teacher MLM loss", "early MLM loss",
                                      "student MLM loss", "gain in loss vs none", "student MLM acc", "probe acc",
                                      "RT dev accuracy", "paper"],
                             rows=table, verdict=verdict, reason=reason, plots=[str(plot.relative_to(run.out_dir))])

    return report


def _setup(run: FindingRun, steps: int, long: int, student_layers: int, width: int) -> str:
    """The report's setup paragraph: the arms, budgets and seeds of `declare`, and the rule it judges by."""
    return (f"`{run.command}`: student `{run.recipe.name}` ({student_layers}-layer BERT-MLM) on the bundled "
            f"corpus. Short budget, {steps:,} steps: alone and distilled from teachers = the same recipe with "
            f"{', '.join(map(str, TEACHERS.values()))} layers (seed 0, same length), pretrained first, with "
            "`dwt-weak.yaml`'s loss weights (Normal: constant α_h:α_s = 1:1, τ = 1), and from the weak teacher "
            "with `dwt-weak-strong.yaml` (constant 1:4) and `dwt-weak-4to1.yaml` (α_s 4 → 1, linear); student "
            f"seeds {', '.join(map(str, run.seeds))}. Whole budget, {long:,} steps: random init against "
            "remapping from a weak teacher of that length (Normal weights), student "
            f"{run.pretrained_draws}, each fine-tuned on RT with "
            f"`configs/finetune-rt.yaml`'s defaults, seeds {', '.join(map(str, run.seeds))}. Student masked-LM "
            "loss and accuracy (hard cross-entropy only; the run sees each sample once, so these are losses on "
            "unseen text) over the last 10 % of logged steps; early = over "
            f"{EARLY[0] * 100:.0f}–{EARLY[1] * 100:.0f} % of the short run (after its warm-up) and 10–20 % of "
            "the whole one; "
            "gain = loss(no teacher) − loss(student) of the same seed (positive = better); probe = the "
            "frozen-feature RT probe at the end. Rule: teacher strength on the short budget's masked-LM loss, "
            "where distillation acts: weak < none < very weak < extremely weak; schedules: Strong below Normal "
            "early, Normal below Strong at the end; each a paired t-test over student seeds (p < 0.05). "
            "Remapping, downstream as the paper judges it: per draw, random init's RT accuracy above remapped's "
            "(paired over fine-tuning seeds), counted only where both draws agree. Reproduced if every "
            "relation holds, not reproduced if any is significantly reversed, inconclusive otherwise."
            + (f" Quick mode: {student_layers} × {width} student for a few steps, a structure check rather than a "
               "measurement." if run.quick else run.note))


# (better, worse) on the short budget's student loss: teacher strength at the end, then the schedules
RELATIONS = (("weak", "none"), ("none", "very weak"), ("very weak", "extremely weak"))
SCHEDULE_RELATIONS = (("early", "weak, Strong 1:4", "weak"), ("loss", "weak", "weak, Strong 1:4"))


def verdict_of(short: dict[str, dict[str, list[float]]],
               whole: dict[int, dict[str, dict]]) -> tuple[str, str]:
    """RELATIONS and SCHEDULE_RELATIONS on per-seed losses (lower is better), and remapping per draw on RT
    accuracy, counted where the draws agree."""
    outcomes, parts = [], []
    for metric, better, worse in (*(("loss", b, w) for b, w in RELATIONS), *SCHEDULE_RELATIONS):
        outcome, test = compare(short[better][metric], short[worse][metric], higher_is_better=False)
        outcomes.append(outcome)
        parts.append(f"{better} − {worse} ({'early' if metric == 'early' else 'end'}): {test.describe()}")
    remap = {draw: compare(by_arm["random init"]["rt"], by_arm["remapped"]["rt"]) for draw, by_arm in whole.items()}
    directions = {-1: "not reproduced at this scale", 0: "inconclusive", 1: "reproduced"}
    agreed = draws_verdict([directions[o] for o, _ in remap.values()])
    outcomes.append({v: k for k, v in directions.items()}[agreed])
    return claims_verdict(outcomes), (
        "short budget, student MLM loss, a − b (negative: a is better): " + "; ".join(parts)
        + ". Whole budget, RT accuracy, random init − remapped: "
        + "; ".join(f"draw {d}: {t.describe()}" for d, (_, t) in remap.items())
        + ("" if len({o for o, _ in remap.values()}) == 1 else " (the draws disagree: not counted)") + ".")


def _plot(short: dict, curves: dict[tuple[int, str], list[dict]], path: Path) -> Path:
    """Left: each short-budget arm's gain in loss over no teacher. Right: the whole-budget masked-LM loss
    curves, random init against remapped, one line per draw."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.4))
    arms = [a for a in short if a != "none"]
    gains = [[b - a for a, b in zip(short[arm]["loss"], short["none"]["loss"])] for arm in arms]
    left.bar(range(len(arms)), [sum(g) / len(g) for g in gains], yerr=[(max(g) - min(g)) / 2 for g in gains],
             capsize=3, color=["tab:green", "tab:orange", "tab:red", "tab:olive", "tab:cyan"][:len(arms)])
    left.axhline(0.0, color="black", linewidth=0.8)
    left.set_xticks(range(len(arms)), arms, fontsize=7)
    left.set_ylabel("MLM loss gain vs no teacher")
    left.set_title("short budget: loss(no teacher) − loss(student)", fontsize=9)
    for (draw, arm), rows in curves.items():
        points = [(r["step"], r["gen_loss"]) for r in rows if "gen_loss" in r]
        window = max(1, len(points) // 20)  # a running mean over 5 % of the run
        smooth = [sum(v for _, v in points[max(0, i - window + 1):i + 1]) / len(points[max(0, i - window + 1):i + 1])
                  for i in range(len(points))]
        right.plot([s for s, _ in points], smooth, color="tab:blue" if arm == "random init" else "tab:red",
                   linestyle="-" if draw == min(d for d, _ in curves) else "--", label=f"{arm}, draw {draw}")
    right.set_xlabel("step")
    right.set_ylabel("student MLM loss (running mean)")
    right.set_title("whole budget: random init vs remapped", fontsize=9)
    right.legend(fontsize=7)
    return save_figure(fig, path)
