"""Finding `labelreg`: label regularization helps a randomly initialised student, not a pretrained one.

Kobyzev, Jafari et al., Tables 1, 2 and 7 (and the Wilcoxon tests of Table 8): KD, LS, TF-reg and
self-KD are statistically indistinguishable from plain fine-tuning for pretrained students, and
significantly better for the same architecture trained from random init. Here: RT, a pretrained
student vs its architecture at random init, each fine-tuned with plain cross-entropy and with each
regularizer (the paper's α, a and τ), the paper's five seeds, a paired t-test per method, on each of
two pretraining draws of teacher and student.

The paper's regime needs a pretrained student that pays off downstream and a teacher clearly
stronger than it. The recipe is therefore `bert-mini-long.yaml`, the masked LM that pays off here
at 4 × 128 (docs/recipes.md, "Does pretraining pay off here?"): the student is its 2 × 64 version
(the shared student size), KD's teacher the 4 × 128 one fine-tuned (3.6× the parameters). Under
`electra-mini.yaml` (the report's first form) the 2 × 64 student fine-tuned no better than its
random init, so "pretrained vs random init" did not separate the students.
"""

from __future__ import annotations

from pathlib import Path
from statistics import fmean

from megakd.repro.finding_run import FindingRun, ReportFn
from megakd.repro.report import FindingReport, draw_bars, mean_std_text, pyplot, save_figure
from megakd.repro.settings import CONFIGS, finetuning_settings
from megakd.repro.stats import claims_verdict, compare, over_draws
from megakd.repro.training import seed_values

# The paper's Table 9 settings. kd's teacher is the larger shared encoder fine-tuned; selfkd's is a
# fine-tuned copy of the student's own initialisation.
METHODS = {
    "fine-tune": ("labelreg.target=onehot",),
    "KD": ("labelreg.target=kd", "labelreg.alpha=0.5", "labelreg.temperature=1"),
    "LS": ("labelreg.target=ls", "labelreg.alpha=0.1"),
    "TF-reg": ("labelreg.target=tfreg", "labelreg.alpha=0.5", "labelreg.a=0.95"),
    "self-KD": ("labelreg.target=selfkd", "labelreg.alpha=0.5", "labelreg.temperature=1"),
}
TEACHER_SEED = 1000  # the teachers' fine-tuning seed, apart from the students' seeds
RECIPE = CONFIGS / "bert-mini-long.yaml"  # pays off downstream at 4 x 128 (the module's docstring)
FULL, QUICK = finetuning_settings(RECIPE, seeds=(42, 549, 1237, 230, 805))  # the paper's five
PAPER = ("Kobyzev, Jafari et al., GLUE dev Score (mean ± std of 5 runs). Pretrained DistilRoBERTa (Table 1): "
         "fine-tune 82.64 ± 0.11, LS 82.78 ± 0.15, TF-reg 82.78 ± 0.29, self-KD 82.81 ± 0.19, KD 83.08 ± 0.14; "
         "the same architecture from random init (Table 7): 61.87 ± 0.21, LS 62.45 ± 0.45, TF-reg 62.35 ± 0.25, "
         "self-KD 62.39 ± 0.28, KD 62.80 ± 0.45. Table 8 (SST-5, Wilcoxon, 8 seeds): fine-tune vs TF-reg p = 0.46 "
         "pretrained / 0.01 scratch; vs KD 0.94 / 0.01. Conclusion: for pretrained students the regularizers are "
         "statistically indistinguishable from fine-tuning; from random init they help significantly.")


def declare(run: FindingRun) -> ReportFn:
    epochs = run.epochs()
    tuned, teacher_runs = {}, {}
    # A random-init student takes only the architecture and tokenizer of a pretrained one, the same in
    # every draw: its arms are declared on draw 0's, so the runs no teacher draw enters are run once.
    first = run.student_encoder(run.settings.draws[0])
    for draw in run.settings.draws:
        student, encoder = run.student_encoder(draw), run.base_encoder(draw)
        inits = {"pretrained": (student, "model.init=pretrained"), "random init": (first, "model.init=random")}
        teacher_seed = f"finetune.seeds=[{TEACHER_SEED}]"
        teachers = teacher_runs[draw] = {
            "KD": run.finetune([f"model.path={encoder.path}", teacher_seed], encoder, keep=True),
            **{f"self-KD, {init}": run.finetune([f"model.path={start.path}", how, teacher_seed], start, keep=True)
               for init, (start, how) in inits.items()}}
        for init, (start, how) in inits.items():
            for method, overrides in METHODS.items():
                teacher = {"KD": teachers["KD"], "self-KD": teachers[f"self-KD, {init}"]}.get(method)
                tuned[draw, init, method] = run.finetune(
                    [f"model.path={start.path}", how, *overrides,
                     *((f"labelreg.teacher={teacher.kept}",) if teacher else ()), run.seeds_override],
                    start, after=(teacher,) if teacher else (), other=encoder if method == "KD" else None)

    def report() -> FindingReport:
        measured: dict[int, dict[str, dict[str, list[float]]]] = {}
        for (draw, init, method), job in tuned.items():
            measured.setdefault(draw, {}).setdefault(init, {})[method] = seed_values(run.result(job))
        table = [[str(draw), init, method, mean_std_text(values),
                  "—" if method == "fine-tune" else compare(values, by_method["fine-tune"])[1].describe()]
                 for draw, by_init in measured.items() for init, by_method in by_init.items()
                 for method, values in by_method.items()]
        teacher_acc = {draw: {name: seed_values(run.result(job))[0] for name, job in by.items()}
                       for draw, by in teacher_runs.items()}
        verdict, reason = over_draws({draw: verdict_of(by_init) for draw, by_init in measured.items()})
        plot = _plot(measured, run.out_dir / "repro" / "labelreg.png")
        draws = run.settings.draws
        setup = (f"`{run.command}`: RT, `configs/finetune-rt.yaml` defaults "
                 f"({epochs} epoch{'s' if epochs > 1 else ''}, `lr: auto`); students = {run.encoder} of "
                 f"{run.pretrained} with both models at {run.student_size} (the shared student), and the same "
                 f"architecture at random init; teacher and student encoders pretrained {len(draws)} times each "
                 f"(draws: train.seed {', '.join(map(str, draws))}; draw d's student learns from draw d's teachers; "
                 "the random-init arms that no teacher enters are one set of runs, shown under each draw); "
                 f"seeds {', '.join(map(str, run.seeds))}. Methods with the paper's Table 9 settings: KD α 0.5, τ 1 "
                 f"(teacher: {run.encoder} of {run.pretrained}, fine-tuned at seed {TEACHER_SEED}); "
                 "LS α 0.1; TF-reg α 0.5, a 0.95; self-KD α 0.5 (teacher: the student's own initialisation "
                 f"fine-tuned at seed {TEACHER_SEED}). Teachers' RT dev accuracy: "
                 + "; ".join(f"draw {d}: " + ", ".join(f"{name} {acc:.3f}" for name, acc in by.items())
                             for d, by in teacher_acc.items())
                 + ". Each method against plain fine-tuning of the same student, paired t-test over "
                 "seeds. Rule, per draw: reproduced if no method differs significantly (p < 0.05) from fine-tuning "
                 "for the "
                 "pretrained student while at least half of them help significantly at random init; not reproduced "
                 "if a method significantly changes the pretrained student, or if none helps the random-init "
                 "student while the random-init differences are significant the other way; inconclusive otherwise. "
                 "The finding's verdict is the draws' when they agree, else inconclusive." + run.note)
        return FindingReport(name="labelreg", title="Label regularization: pretrained vs randomly initialised student",
                             paper=PAPER, setup=setup,
                             columns=["draw", "student", "method", "RT dev accuracy", "− fine-tune (paired test)"],
                             rows=table, verdict=verdict, reason=reason, plots=[str(plot.relative_to(run.out_dir))])

    return report


def verdict_of(measured: dict[str, dict[str, list[float]]]) -> tuple[str, str]:
    """The rule stated in the setup, over {student init: {method: per-seed accuracy}}."""
    effects = {init: {method: compare(values, by_method["fine-tune"])
                      for method, values in by_method.items() if method != "fine-tune"}
               for init, by_method in measured.items()}
    scratch = [o for o, _ in effects["random init"].values()]
    helped = sum(o == 1 for o in scratch)
    detail = "; ".join(f"{init}: " + ", ".join(f"{m} {t.describe()}" for m, (_, t) in by.items())
                       for init, by in effects.items())
    changed = [m for m, (o, _) in effects["pretrained"].items() if o != 0]
    if changed:
        outcome = -1
        why = f"for the pretrained student {', '.join(changed)} differ(s) significantly from fine-tuning"
    elif helped * 2 >= len(scratch):
        outcome = 1
        why = f"no method changes the pretrained student; {helped} of {len(scratch)} help the random-init one"
    elif helped == 0 and any(o == -1 for o in scratch):
        outcome = -1
        why = "at random init no method helps and some hurt significantly"
    else:
        outcome = 0
        why = (f"no method changes the pretrained student, but only {helped} of {len(scratch)} help the "
               "random-init one significantly")
    return claims_verdict([outcome]), f"{why}. Differences in accuracy against fine-tuning — {detail}."


def _plot(measured: dict[int, dict[str, dict[str, list[float]]]], path: Path) -> Path:
    """A panel per student init: a bar per method (the mean over draws of each draw's seed mean), a dot per draw."""
    fig, axes = pyplot().subplots(1, 2, figsize=(9, 3.2), sharey=False)
    first = next(iter(measured.values()))
    for ax, (init, by_method) in zip(axes, first.items()):
        per_draw = [[fmean(m[init][method]) for m in measured.values()] for method in by_method]
        draw_bars(ax, per_draw, list(by_method), ["tab:gray"] + ["tab:blue"] * (len(per_draw) - 1), fontsize=8)
        ax.set_title(f"{init} student")
        ax.set_ylabel("RT dev accuracy (mean over seeds)")
        ax.set_ylim(max(0.0, min(min(v) for v in per_draw) - 0.05), None)
    return save_figure(fig, path)
