"""Finding `disc_lr`: under DecoupledOptim a discriminator LR well above the generator's gives a better discriminator.

Dissertation Fig. 1.4 / App. A.3: with the generator's LR fixed at 2e-4, raising η_D (as far as
training stays stable; the recipe's 1.5e-3 is 7.5× η_G) raises the discriminator's RTD quality and
its downstream accuracy (MNLI). Here, in that regime: η_G fixed at the paper's 2e-4, η_D at 1×,
3.75×, 7.5× (the paper's ratio) and 15× of it, each arm pretrained twice (two draws: train.seed 0
and 1); RTD F1 over the last 10 % of logged steps, and RT dev accuracy of each discriminator
fine-tuned over several seeds. The verdict counts only what both draws agree on.
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import fmean

from megakd.engine.runlog import tail_mean
from megakd.repro.finding_run import FindingRun, ReportFn
from megakd.repro.report import FindingReport, mean_std_text, pyplot, save_figure
from megakd.repro.settings import (
    FULL_FINETUNE,
    PRETRAIN_RECIPE,
    QUICK_FINETUNE,
    QUICK_PRETRAIN,
    Settings,
    recipe_value,
)
from megakd.repro.stats import claims_verdict, compare, draw_spread, over_draws
from megakd.repro.training import metric_rows, seed_values

GENERATOR_LR = 2e-4  # the paper's η_G, fixed in every arm
RATIOS = (1.0, 3.75, 7.5, 15.0)  # η_D / η_G: equal rates, half the paper's ratio, the paper's, twice it
REFERENCE, HIGH = 1.0, (7.5, 15.0)
# Full mode: the recipe at its size for 1,200 of its 5,000 steps (the mini models leave the unigram
# plateau by step ~300), four ratios × two draws.
FULL = Settings(PRETRAIN_RECIPE, seeds=(0, 1, 2), steps=1200, finetune=FULL_FINETUNE, draws=(0, 1))
QUICK = Settings(PRETRAIN_RECIPE, seeds=(0, 1), steps=12, pretrain=QUICK_PRETRAIN, finetune=QUICK_FINETUNE,
                 draws=(0, 1))
F1_FLOOR = 0.05  # below this everywhere the discriminators are on the plateau: nothing to rank
PAPER = ("Dissertation Fig. 1.4 and App. A.3 (DecoupledOptim, base size, η_G fixed at 2e-4): the discriminator "
         "improves as η_D rises until training turns unstable (tuning roadmap: 'raise η_D to the largest stable "
         "value'); the recipe's 1.5e-3 is 7.5× the generator's rate. MNLI rises with η_D; RTD F1 of base "
         "discriminators against a standalone generator is ~31 %. Runs per point are not stated.")


def declare(run: FindingRun) -> ReportFn:
    steps = min(run.settings.steps, int(recipe_value(run.recipe, "train.max_steps")))
    arms = {}
    for draw in run.settings.draws:
        for ratio in RATIOS:
            pretrained = run.pretrain([*run.settings.pretrain, f"train.max_steps={steps}", f"train.seed={draw}",
                                       f"optim.generator.lr={GENERATOR_LR:g}",
                                       f"optim.discriminator.lr={GENERATOR_LR * ratio:g}"])
            arms[draw, ratio] = pretrained, run.finetune([f"model.path={pretrained.path}", run.seeds_override],
                                                         pretrained)

    def report() -> FindingReport:
        measured: dict[int, dict[float, dict]] = {}
        for (draw, ratio), (pretrained, tuned) in arms.items():
            rows = metric_rows(pretrained.path)
            measured.setdefault(draw, {})[ratio] = {
                "rtd_f1": tail_mean(rows, "rtd_f1"), "gen_acc": tail_mean(rows, "gen_acc"),
                "finite": all(math.isfinite(r["disc_loss"]) for r in rows if "disc_loss" in r),
                "acc": seed_values(run.result(tuned))}
        verdict, reason = verdict_of(measured)
        draws = run.settings.draws
        table = [[f"{r:g}×", f"{GENERATOR_LR * r:.3g}", " / ".join(f"{measured[d][r]['rtd_f1']:.3f}" for d in draws),
                  " / ".join(f"{measured[d][r]['gen_acc']:.3f}" for d in draws),
                  *(mean_std_text(measured[d][r]["acc"]) for d in draws)] for r in RATIOS]
        plot = _plot(measured, run.out_dir / "repro" / "disc_lr.png")
        setup = (f"`{run.command}`: `{run.recipe.name}` (DecoupledOptim) for {steps} steps with η_G fixed at the "
                 f"paper's {GENERATOR_LR:g} and η_D at {', '.join(f'{r:g}×' for r in RATIOS)} of it, each "
                 f"{run.pretrained_draws}; RTD F1 and "
                 "generator masked accuracy averaged over the last 10 % of logged steps (the discriminator against "
                 "its own generator); each discriminator fine-tuned on RT with `configs/finetune-rt.yaml`'s "
                 f"defaults, seeds {', '.join(map(str, run.seeds))}, dev accuracy mean ± std per draw. Rule, per "
                 "draw: reproduced if the better of 7.5× and 15× beats 1× in RTD F1 (by > 0.01) and in RT accuracy "
                 "(paired t-test over seeds, p < 0.05); not reproduced if either is significantly reversed; "
                 f"inconclusive otherwise, or if RTD F1 < {F1_FLOOR} at every ratio (discriminators on the "
                 "plateau), or if the 1× run diverged. The finding's verdict is the draws' verdict when they all "
                 "agree, else inconclusive; the reason compares the effect with the draw-to-draw spread." + run.note)
        return FindingReport(name="disc_lr", title="Discriminator LR sweep under DecoupledOptim", paper=PAPER,
                             setup=setup, columns=["η_D / η_G", "η_D", "RTD F1 (last 10 %, per draw)",
                                                   "gen acc (last 10 %, per draw)",
                                                   *(f"RT dev accuracy, draw {d}" for d in draws)],
                             rows=table, verdict=verdict, reason=reason,
                             plots=[str(plot.relative_to(run.out_dir))])

    return report


def draw_verdict(measured: dict[float, dict]) -> tuple[str, str]:
    """The rule stated in the setup for one draw, over {ratio: {rtd_f1, finite, acc (per seed)}}."""
    if not measured[REFERENCE]["finite"]:
        return "inconclusive", "the 1× run produced a non-finite loss"
    if max(m["rtd_f1"] for m in measured.values()) < F1_FLOOR:
        return "inconclusive", (f"RTD F1 stays below {F1_FLOOR} at every ratio: the discriminators are still on the "
                                "plateau (predicting 'original' everywhere), so there is nothing to rank")
    high = max((r for r in HIGH if measured[r]["finite"]), key=lambda r: sum(measured[r]["acc"]), default=None)
    if high is None:
        return "not reproduced at this scale", "both 7.5× and 15× diverged: the paper's ratio is not stable here"
    f1_gain = measured[high]["rtd_f1"] - measured[REFERENCE]["rtd_f1"]
    f1 = 1 if f1_gain > 0.01 else -1 if f1_gain < -0.01 else 0
    acc, test = compare(measured[high]["acc"], measured[REFERENCE]["acc"])
    return claims_verdict([f1, acc]), f"{high:g}× against 1×: RTD F1 {f1_gain:+.3f}, RT accuracy {test.describe()}"


def verdict_of(measured: dict[int, dict[float, dict]]) -> tuple[str, str]:
    """Every draw's verdict; the finding's is theirs when they agree. The reason sets the effect beside
    the draw-to-draw spread of the same arm (how far two pretraining runs of one recipe land apart)."""
    verdict, reason = over_draws({draw: draw_verdict(m) for draw, m in measured.items()})
    if len(measured) > 1:
        means = {f"{r:g}×": [fmean(m[r]["acc"]) for m in measured.values()] for r in RATIOS}
        reason += " " + draw_spread(means, f"{REFERENCE:g}×", [f"{h:g}×" for h in HIGH], " RT accuracy")
    return verdict, reason


def _plot(measured: dict[int, dict[float, dict]], path: Path) -> Path:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2))
    for draw, arms in measured.items():
        left.plot(RATIOS, [arms[r]["rtd_f1"] for r in RATIOS], "o-", label=f"draw {draw}")
        accs = [arms[r]["acc"] for r in RATIOS]
        right.errorbar(RATIOS, [sum(a) / len(a) for a in accs], yerr=[(max(a) - min(a)) / 2 for a in accs],
                       fmt="o-", capsize=3, label=f"draw {draw}")
    left.set_ylabel("RTD F1 (last 10 % of steps)")
    right.set_ylabel("RT dev accuracy (mean, half range)")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(RATIOS, [f"{r:g}×\n{GENERATOR_LR * r:.2g}" for r in RATIOS])
        ax.minorticks_off()
        ax.set_xlabel(f"η_D / η_G (η_G = {GENERATOR_LR:g})")
        ax.legend(fontsize=8)
    return save_figure(fig, path)
