"""Finding `dwt`: a weak teacher helps a larger student, weaker ones hurt it, and remapping hurts.

DWT (Lee et al., ACL'23) Fig. 2 and 4: distilling a frozen teacher MLM of 0.78× the student's size
into it (α_h:α_s = 1:1) gains +1.44 GLUE over the standalone student; 0.57× and 0.46× teachers lose
1.37 and 2.76; initialising the student from the teacher (parameter remapping) ends worse than
random init. Here: the DWT student recipe (`configs/dwt-tiny.yaml`, 6 × 192 BERT-MLM) alone and
distilled from 4-, 2- and 1-layer teachers of its own recipe (0.79× / 0.58× / 0.48× its parameters)
with the paper's loss weights (`configs/dwt-weak.yaml`), plus the weak teacher with remapping.
"""

from __future__ import annotations

from pathlib import Path

from megakd.repro.report import FindingReport, mean_std, pyplot, save_figure
from megakd.repro.runs import CONFIGS, Costs, last_value, metric_rows, pretrain, recipe_value, tail_mean
from megakd.repro.stats import claims_verdict, compare

STUDENT_RECIPE = CONFIGS / "dwt-tiny.yaml"
DISTILL_SETTINGS = CONFIGS / "dwt-weak.yaml"  # the paper's loss weights (all three teacher recipes share them)
DISTILL_KEYS = ("temperature", "alpha_hard", "alpha_soft_start", "alpha_soft_end", "alpha_schedule")
FULL = {"teachers": {"weak": 4, "very weak": 2, "extremely weak": 1}, "seeds": (0, 1), "overrides": ()}
QUICK = {"teachers": {"weak": 3, "very weak": 2, "extremely weak": 1}, "seeds": (0, 1), "overrides": (
    "train.max_steps=8", "train.global_batch_size=8", "train.micro_batch_size=8", "optim.schedule.warmup_steps=2",
    "train.log_every=1", "train.probe_fit_examples=200", "train.probe_eval_examples=100",
    "model.generator.num_layers=4", "model.generator.hidden_size=32", "model.generator.num_heads=2",
    "model.generator.intermediate_size=64")}
PAPER_GAINS = {"weak": "+1.44", "very weak": "−1.37", "extremely weak": "−2.76", "weak, remapped": "below weak"}
PAPER = ("DWT (Lee et al., ACL'23) Fig. 2 and 4, Table: a 6-layer BERT student (GLUE dev 79.89 alone) distilled "
         "from a frozen teacher MLM with α_h:α_s = 1:1: weak teacher (0.78× its parameters, 2.23 GLUE points below "
         "the student) 81.33 (+1.44); very weak (0.57×) −1.37; extremely weak (0.46×) −2.76. Parameter remapping "
         "(student layers initialised from the teacher's, last layer repeated) converges to a worse optimum than "
         "random init. Ordering of the gains: weak > none > very weak > extremely weak; random init > remap.")


def run(out_dir: Path, work: Path, quick: bool = False, seeds: tuple[int, ...] | None = None,
        recipe: str | Path = STUDENT_RECIPE) -> FindingReport:
    settings = QUICK if quick else FULL
    seeds = tuple(seeds or settings["seeds"])
    work.mkdir(parents=True, exist_ok=True)
    steps = int(recipe_value(recipe, "train.max_steps", settings["overrides"]))
    overrides = [*settings["overrides"], f"train.probe_every={steps}"]  # the probe once, at the end
    student_layers = int(recipe_value(recipe, "model.generator.num_layers", tuple(overrides)))
    distill = [f"distill.{k}={recipe_value(DISTILL_SETTINGS, f'distill.{k}')}" for k in DISTILL_KEYS]
    teachers = settings["teachers"]
    costs = Costs("dwt", {"pretraining step": steps * (sum(teachers.values()) / student_layers
                                                       + len(seeds) * (len(teachers) + 2))})
    teacher_runs = {name: pretrain(recipe, [*overrides, f"model.generator.num_layers={layers}"], work, costs)
                    for name, layers in teachers.items()}
    arms = {"none": ([], False), **{name: ([*distill, f"distill.teacher={path}"], True)
                                    for name, path in teacher_runs.items()},
            "weak, remapped": ([*distill, f"distill.teacher={teacher_runs['weak']}", "distill.init=remap"], True)}
    measured: dict[str, dict[str, list[float]]] = {}
    for arm, (arm_overrides, is_distill) in arms.items():
        for seed in seeds:
            rows = metric_rows(pretrain(recipe, [*overrides, *arm_overrides, f"train.seed={seed}"], work, costs,
                                        distill=is_distill))
            m = measured.setdefault(arm, {"loss": [], "acc": [], "probe": []})
            m["loss"].append(tail_mean(rows, "gen_loss"))
            m["acc"].append(tail_mean(rows, "gen_acc"))
            m["probe"].append(last_value(rows, "probe_acc"))
    teacher_rows = {name: metric_rows(path) for name, path in teacher_runs.items()}
    width = recipe_value(recipe, "model.generator.hidden_size", tuple(overrides))
    sizes = {**{name: f"{layers} × {width}" for name, layers in teachers.items()},
             "weak, remapped": f"{teachers['weak']} × {width}, remapped into the student"}
    table = [[arm, sizes.get(arm, "—"),
              f"{tail_mean(teacher_rows[arm], 'gen_loss'):.3f}" if arm in teachers else "—",
              mean_std(m["loss"]), mean_std([b - a for a, b in zip(m["loss"], measured["none"]["loss"])]),
              mean_std(m["acc"]), mean_std(m["probe"]), PAPER_GAINS.get(arm, "0 (79.89)")]
             for arm, m in measured.items()]
    verdict, reason = verdict_of(measured)
    plot = _plot(measured, out_dir / "repro" / "dwt.png")
    command = "megakd repro dwt" + (" --quick" if quick else "")
    setup = (f"`{command}`: student `{Path(recipe).name}` ({student_layers}-layer BERT-MLM, {steps} steps) on the "
             f"bundled corpus; teachers = the same recipe with {', '.join(f'{v}' for v in teachers.values())} "
             "layers (seed 0), pretrained first; distillation with `dwt-weak.yaml`'s loss weights (constant "
             f"α_h:α_s = 1:1, τ = 1); student seeds {', '.join(map(str, seeds))}. Student masked-LM loss and accuracy "
             "(hard cross-entropy only) averaged over the last 10 % of logged steps — the run sees each sample once, "
             "so these are losses on unseen text; gain = loss(no teacher) − loss(student) of the same seed "
             "(positive = better); probe = the frozen-feature RT probe (`train.probe_every`) at the end. Rule: "
             "the ordering is judged on the masked-LM loss, where distillation acts (GLUE at this scale would "
             "rank noise); each relation weak < none < very weak < extremely weak (losses) and weak < weak "
             "remapped is tested by a paired t-test over seeds (p < 0.05): reproduced if all hold, not reproduced "
             "if any is significantly reversed, inconclusive otherwise."
             + (" Quick mode: 4 × 32 student for a few steps, a structure check rather than a measurement."
                if quick else ""))
    return FindingReport(name="dwt", title="DWT: teacher strength and parameter remapping", paper=PAPER, setup=setup,
                         columns=["teacher", "teacher size", "teacher MLM loss", "student MLM loss",
                                  "gain in loss vs none", "student MLM acc", "probe acc", "paper's GLUE gain"],
                         rows=table, verdict=verdict, reason=reason, plots=[str(plot.relative_to(out_dir))])


RELATIONS = (("weak", "none"), ("none", "very weak"), ("very weak", "extremely weak"), ("weak", "weak, remapped"))


def verdict_of(measured: dict[str, dict[str, list[float]]]) -> tuple[str, str]:
    """Each relation (better, worse) of RELATIONS on the per-seed student loss (lower is better)."""
    outcomes, parts = [], []
    for better, worse in RELATIONS:
        outcome, test = compare(measured[better]["loss"], measured[worse]["loss"], higher_is_better=False)
        outcomes.append(outcome)
        parts.append(f"{better} − {worse}: {test.describe()}")
    return claims_verdict(outcomes), ("student MLM loss, a − b (negative: a is better), "
                                      + "; ".join(parts) + ".")


def _plot(measured: dict, path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    arms = [a for a in measured if a != "none"]
    gains = [[b - a for a, b in zip(measured[arm]["loss"], measured["none"]["loss"])] for arm in arms]
    ax.bar(range(len(arms)), [sum(g) / len(g) for g in gains], yerr=[(max(g) - min(g)) / 2 for g in gains],
           capsize=3, color=["tab:green", "tab:orange", "tab:red", "tab:gray"][:len(arms)])
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(arms)), arms)
    ax.set_ylabel("MLM loss gain vs no teacher")
    ax.set_title("DWT students: loss(no teacher) − loss(student), mean over seeds")
    return save_figure(fig, path)
