"""Finding `disc_lr`: under DecoupledOptim a larger discriminator LR gives a better discriminator.

Dissertation Fig. 1.4: with the generator's LR fixed, raising η_D (as far as training stays
stable) raises the discriminator's RTD quality and its downstream accuracy (MNLI). Here: the
pretraining recipe with its discriminator LR × 0.5, 1, 2 and 4 (the generator's untouched), RTD
F1 over the last 10 % of logged steps, and RT dev accuracy of each discriminator fine-tuned with
the defaults over several seeds.
"""

from __future__ import annotations

import math
from pathlib import Path

from megakd.repro.report import FindingReport, mean_std_text, pyplot, save_figure
from megakd.repro.runs import (
    FULL_FINETUNE,
    PRETRAIN_RECIPE,
    QUICK_FINETUNE,
    QUICK_PRETRAIN,
    FindingRun,
    ReportFn,
    Settings,
    metric_rows,
    recipe_value,
    seed_values,
    tail_mean,
)
from megakd.repro.stats import claims_verdict, compare

MULTIPLIERS = (0.5, 1.0, 2.0, 4.0)
# Full mode: the recipe at its size for 1,200 of its 5,000 steps (the mini models leave the unigram
# plateau by step ~300), so that four runs fit the report's 3-hour budget.
FULL = Settings(PRETRAIN_RECIPE, seeds=(0, 1, 2), steps=1200, finetune=FULL_FINETUNE)
QUICK = Settings(PRETRAIN_RECIPE, seeds=(0, 1), steps=12, pretrain=QUICK_PRETRAIN, finetune=QUICK_FINETUNE)
F1_FLOOR = 0.05  # below this everywhere the discriminators are on the plateau: nothing to rank
PAPER = ("Dissertation Fig. 1.4 and App. A.3 (DecoupledOptim, base size, η_G fixed at 2e-4): the discriminator "
         "improves as η_D rises until training turns unstable (tuning roadmap: 'raise η_D to the largest stable "
         "value'); the recipe's 1.5e-3 is 7.5× the generator's rate. MNLI rises with η_D; RTD F1 of base "
         "discriminators against a standalone generator is ~31 %.")


def declare(run: FindingRun) -> ReportFn:
    steps = min(run.settings.steps, int(recipe_value(run.recipe, "train.max_steps")))
    base_lr = float(recipe_value(run.recipe, "optim.discriminator.lr", run.settings.pretrain))
    arms = {}
    for mult in MULTIPLIERS:
        pretrained = run.pretrain([*run.settings.pretrain, f"train.max_steps={steps}",
                                   f"optim.discriminator.lr={base_lr * mult:g}"])
        arms[mult] = pretrained, run.finetune([f"model.path={pretrained.path}", run.seeds_override], pretrained)

    def report() -> FindingReport:
        measured = {}
        for mult, (pretrained, tuned) in arms.items():
            rows = metric_rows(pretrained.path)
            measured[mult] = {"rtd_f1": tail_mean(rows, "rtd_f1"), "gen_acc": tail_mean(rows, "gen_acc"),
                              "finite": all(math.isfinite(r["disc_loss"]) for r in rows if "disc_loss" in r),
                              "acc": seed_values(run.result(tuned))}
        verdict, reason = verdict_of(measured)
        table = [[f"×{m:g}", f"{base_lr * m:.3g}", f"{measured[m]['rtd_f1']:.3f}", f"{measured[m]['gen_acc']:.3f}",
                  mean_std_text(measured[m]["acc"])] for m in MULTIPLIERS]
        plot = _plot(measured, base_lr, run.out_dir / "repro" / "disc_lr.png")
        setup = (f"`{run.command}`: `{run.recipe.name}` (DecoupledOptim) for {steps} steps with the discriminator "
                 f"LR {', '.join(f'×{m:g}' for m in MULTIPLIERS)} of the recipe's {base_lr:g} (generator LR "
                 "unchanged), pretraining seed 0; RTD F1 and generator masked accuracy averaged over the last 10 % "
                 "of logged steps (the discriminator against its own generator); each discriminator fine-tuned on "
                 f"RT with `configs/finetune-rt.yaml`'s defaults, seeds {', '.join(map(str, run.seeds))}, dev "
                 "accuracy mean ± std. Rule: reproduced if the better of ×2 and ×4 beats ×0.5 in RTD F1 (by > 0.01) "
                 "and in RT accuracy (paired t-test over seeds, p < 0.05); not reproduced if either is "
                 f"significantly reversed; inconclusive otherwise, or if RTD F1 < {F1_FLOOR} at every LR "
                 "(discriminators on the plateau), or if the ×0.5 or ×1 run diverged." + run.note)
        return FindingReport(name="disc_lr", title="Discriminator LR sweep under DecoupledOptim", paper=PAPER,
                             setup=setup, columns=["η_D", "LR", "RTD F1 (last 10 %)", "gen acc (last 10 %)",
                                                   "RT dev accuracy"],
                             rows=table, verdict=verdict, reason=reason,
                             plots=[str(plot.relative_to(run.out_dir))])

    return report


def verdict_of(measured: dict[float, dict]) -> tuple[str, str]:
    """The rule stated in the setup, over {multiplier: {rtd_f1, finite, acc (per seed)}}."""
    if not (measured[0.5]["finite"] and measured[1.0]["finite"]):
        return "inconclusive", "a run at ×0.5 or ×1 produced a non-finite loss."
    if max(m["rtd_f1"] for m in measured.values()) < F1_FLOOR:
        return "inconclusive", (f"RTD F1 stays below {F1_FLOOR} at every LR: the discriminators are still on the "
                                "plateau (predicting 'original' everywhere), so there is nothing to rank.")
    high = max((m for m in (2.0, 4.0) if measured[m]["finite"]), key=lambda m: sum(measured[m]["acc"]), default=None)
    if high is None:
        return "not reproduced at this scale", "both ×2 and ×4 diverged: a larger η_D is not stable here."
    f1_gain = measured[high]["rtd_f1"] - measured[0.5]["rtd_f1"]
    f1 = 1 if f1_gain > 0.01 else -1 if f1_gain < -0.01 else 0
    acc, test = compare(measured[high]["acc"], measured[0.5]["acc"])
    verdict = claims_verdict([f1, acc])
    return verdict, (f"×{high:g} against ×0.5: RTD F1 {f1_gain:+.3f}, RT accuracy {test.describe()}.")


def _plot(measured: dict, base_lr: float, path: Path) -> Path:
    plt = pyplot()
    lrs = [base_lr * m for m in MULTIPLIERS]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2))
    left.plot(lrs, [measured[m]["rtd_f1"] for m in MULTIPLIERS], "o-")
    left.set_ylabel("RTD F1 (last 10 % of steps)")
    accs = [measured[m]["acc"] for m in MULTIPLIERS]
    means = [sum(a) / len(a) for a in accs]
    right.errorbar(lrs, means, yerr=[(max(a) - min(a)) / 2 for a in accs], fmt="o-", capsize=3)
    right.set_ylabel("RT dev accuracy (mean, half range)")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lrs, [f"×{m:g}\n{lr:.2g}" for m, lr in zip(MULTIPLIERS, lrs)])
        ax.minorticks_off()
        ax.set_xlabel("discriminator LR (× the recipe's)")
    return save_figure(fig, path)
