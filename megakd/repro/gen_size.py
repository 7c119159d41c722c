"""Finding `gen_size`: original ELECTRA is sensitive to the generator's size, DecoupledOptim is not (Fig. 1.1,
1.2).

Dissertation Ch. 1: under original ELECTRA (one optimizer, shared embeddings, L_MLM + λ·L_RTD) the
discriminator's downstream score falls once the generator grows past a few layers (Fig. 1.1), and the fall
happens in pretraining: scored on replacements from the deepest generator's last checkpoint, discriminators
trained beside deeper generators detect worse, even the deepest generator's own (Fig. 1.2). DecoupledOptim
(two optimizers, no shared parameter, η_G chosen per generator) removes the sensitivity. Here: the 4 × 128
discriminator of `configs/electra-mini.yaml` beside generators of 1, 2 and 4 layers at the recipe's width,
under both designs, each final arm pretrained twice (train.seed 0 and 1); downstream on RT and on the
sentence-pair task (chance 0.5, and the tf-idf floor is chance too: docs/finetuning.md) beside the same
architecture from random init; Fig. 1.2 with `megakd.eval.rtd.evaluate_rtd` (`megakd eval-rtd`).

η_G is chosen per generator by the App. A.3 roadmap on training data only: η_D first (the largest stable
rate, taken from the `disc_lr` finding), then η_G from a grid by each candidate discriminator's RTD F1 on
the pretraining corpus against replacements from every candidate generator of that depth (App. A.4's fair
measure: one fixed corruption for all; a discriminator's F1 against its own generator is not comparable
across runs). The roadmap's target is the discriminator's pretraining quality, which it says first rises
then falls with η_G; the generator's MLM loss only falls as η_G rises, so it cannot locate that peak.

Declared before anything runs, so the arms that depend on the choice are jobs that read it: a selection
job per depth writes its choice to a file, and a job per draw pretrains the chosen rate (for the selection
draw, the selection run itself, from the cache) and links it at a path known in advance, which the
fine-tuning and Fig. 1.2 jobs read.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from statistics import fmean

from megakd.config import load_config
from megakd.engine.runlog import tail_mean
from megakd.repro.finding_run import FindingRun, PretrainRun, ReportFn
from megakd.repro.report import FindingReport, mean_std_text, pyplot, save_figure
from megakd.repro.settings import (
    FULL_FINETUNE,
    FULL_PAIRS,
    PAIR_TOKENS,
    PRETRAIN_RECIPE,
    QUICK_FINETUNE,
    QUICK_PRETRAIN,
    SILENT_RUN,
    TASKS,
    Settings,
    recipe_value,
)
from megakd.repro.stats import claims_verdict, compare, over_draws
from megakd.repro.training import digest, metric_rows, pretrain, seed_values

DEPTHS = (1, 2, 4)  # generator layers; the discriminator has 4 (the recipe's)
QUICK_DEPTHS = (1, 2, 3)  # quick mode: its discriminator has 3
LAMBDA = 50.0  # original ELECTRA's λ: the dissertation sweeps {50, 70, 100, 200}, 50 the usual choice
# Original ELECTRA: one optimizer, at `optim.discriminator`'s settings (docs/pretraining.md), the recipe's
# 1e-3; the joint gradient clipped as original ELECTRA clips it (`optim.joint_clip: weighted`).
ORIGINAL = ("electra.decoupled=false", f"electra.loss_weight={LAMBDA:g}", "optim.joint_clip=weighted")
# DecoupledOptim's η_D: 1.5e-3, 7.5× disc_lr's fixed η_G, the largest rate at which disc_lr's RTD F1 still
# rose in both draws (docs/REPRODUCTION.md, `disc_lr`: 15× was finite but fell), and the paper's default.
DISC_LR = 1.5e-3
# The η_G grid: the top three of the dissertation's DecoupledOptim grid {1, 2, 5, 10} × 1e-4; 1e-4 is
# left out because at 2e-4 disc_lr's generators (1,200 steps) were still at masked accuracy ~0.11.
GENERATOR_LRS = (2e-4, 5e-4, 1e-3)
QUICK_GENERATOR_LRS = (2e-4, 1e-3)
SELECTION_DRAW = 0  # the selection runs are this draw's candidates; its final run is the chosen one
EVAL_SEED = 1000  # masks and replacements of every RTD evaluation: not a training seed
EVAL_BATCHES, QUICK_EVAL_BATCHES = 40, 4  # of 32 samples: 82K token positions in full mode
F1_FLOOR = 0.05  # below this for every discriminator, they sit at the prior: nothing to rank
MARGIN = 0.01  # an RTD F1 difference counted in Fig. 1.2's rule
# Full mode, sized to plan under two hours with --jobs 2 (`megakd repro gen_size --plan --jobs 2`):
# 1,200 of the recipe's 5,000 steps (as disc_lr: the mini models leave the unigram plateau by step
# ~300), 3 depths × (2 original draws + 3 η_G candidates + 1 more DecoupledOptim draw) = 18 pretraining
# runs (~3 hours of single-thread work, the 1- and 2-layer generators being cheaper than the 4-layer one),
# 24 fine-tuning runs and 2 random-init ones of 3 seeds on 3,000 examples (~1.2 hours): a fourth η_G, a
# third draw or a third depth's worth of seeds would each push the plan past two hours.
FULL = Settings(PRETRAIN_RECIPE, seeds=(0, 1, 2), steps=1200, finetune=FULL_FINETUNE, draws=(0, 1))
QUICK = Settings(PRETRAIN_RECIPE, seeds=(0, 1), steps=12, pretrain=(
    *QUICK_PRETRAIN, f"model.discriminator.num_layers={QUICK_DEPTHS[-1]}"), finetune=QUICK_FINETUNE, draws=(0, 1))
PAIRS_NOTE = (" Fine-tuning used 3,000 of RT's 9,071 training sentences and 1,500 of the 25,397 training pairs "
              "(each an even spread, about the same number of tokens) and the whole dev splits.")
MODES = ("original ELECTRA", "DecoupledOptim")
OUTCOME = {1: "holds", -1: "reversed", 0: "undecided"}
PAPER = ("Dissertation Fig. 1.1 (BERT-base discriminator, 125K steps, MNLI m/mm): under the original design "
         "generators of more than 4 layers consistently hurt the discriminator downstream, with (λ, LR) tuned per "
         "point; under DecoupledOptim, with (η_G, η_D) tuned per point, the score is flat to rising with the "
         "generator's depth (4, 8, 12 layers), and with larger η_D the best generator grows to the discriminator's "
         "own size (Fig. 1.4). Fig. 1.2: scored on replacements from the last checkpoint of the 12-layer "
         "generator, discriminators trained with 4-, 8- and 12-layer generators have consistently falling RTD F1 "
         "(the 12-layer one worst, on its own generator's replacements). Exact values are in the figures only; "
         "runs per point are not stated and diverged runs were omitted.")


def declare(run: FindingRun) -> ReportFn:
    steps = min(run.settings.steps, int(recipe_value(run.recipe, "train.max_steps")))
    depths = QUICK_DEPTHS if run.quick else DEPTHS
    lrs = QUICK_GENERATOR_LRS if run.quick else GENERATOR_LRS
    batches = QUICK_EVAL_BATCHES if run.quick else EVAL_BATCHES
    base = [*run.settings.pretrain, f"train.max_steps={steps}"]

    def arm(depth: int, draw: int, mode: tuple[str, ...]) -> list[str]:
        return [*base, f"model.generator.num_layers={depth}", f"train.seed={draw}", *mode]

    def decoupled(lr: float) -> tuple[str, ...]:
        return ("electra.decoupled=true", f"optim.generator.lr={lr:g}", f"optim.discriminator.lr={DISC_LR:g}")

    work = run.work / "kept" / "gen_size"  # the choices and links: read by later jobs, removed at the end
    joint_lr = float(recipe_value(run.recipe, "optim.discriminator.lr", tuple(base)))  # original ELECTRA's one LR
    runs: dict[tuple[str, int, int], PretrainRun] = {}  # (mode, draw, depth) -> the arm's run (a link for the chosen)
    selections: dict[int, str] = {}  # depth -> the selection job's key
    forward = run.costs.electra_mini_step / 6  # a 4 × 128 model's forward: a third of one of the step's two models
    for depth in depths:
        candidates = {lr: run.pretrain(arm(depth, SELECTION_DRAW, decoupled(lr))) for lr in lrs}
        name = digest([c.path.name for c in candidates.values()])
        choice = work / f"select-{name}.json"
        selections[depth] = run.call(f"select:{name}", f"choose η_G of the {depth}-layer generator", select_lr,
                                     (str(run.recipe), base, {f"{lr:g}": str(c.path) for lr, c in candidates.items()},
                                      str(choice), batches),
                                     run.costs.job_start + batches * forward * len(lrs) * (len(lrs) + 1),
                                     tuple(c.key for c in candidates.values()))
        for draw in run.settings.draws:
            runs["original ELECTRA", draw, depth] = run.pretrain(arm(depth, draw, ORIGINAL))
            overrides = {f"{lr:g}": arm(depth, draw, decoupled(lr)) for lr in lrs}
            link = work / f"chosen-{digest([name, draw])}"
            cached = draw == SELECTION_DRAW  # the chosen candidate is this draw's run: no training
            seconds = run.costs.job_start + (0.0 if cached else steps * run.costs.pretrain_step(
                load_config(run.recipe, [*SILENT_RUN, *overrides[f"{lrs[-1]:g}"], "run.dir=_"])))
            key = run.call(f"chosen:{link.name}", f"pretrain the chosen η_G, {depth}-layer generator, draw {draw}",
                           pretrain_chosen, (str(run.recipe), overrides, str(choice), run.work, str(link)), seconds,
                           (selections[depth],))
            runs["DecoupledOptim", draw, depth] = PretrainRun(key, link)
    deepest = depths[-1]
    random_arch = run.pretrain(arm(deepest, SELECTION_DRAW, decoupled(lrs[0])))  # its architecture only

    def finetune(task: str, overrides: list[str], after: tuple[PretrainRun, ...] = ()):
        extra = FULL_PAIRS if task == "pairs" and not run.quick else ()
        tuned = run.finetune([*overrides, *extra, run.seeds_override], random_arch, config=TASKS[task], after=after)
        if task == "pairs":  # priced by its tokens (PAIR_TOKENS), not its count of examples
            job = run.jobs[tuned.key]
            job.seconds = run.costs.job_start + (job.seconds - run.costs.job_start) * PAIR_TOKENS
        return tuned

    tuned = {(mode, draw, depth, task): finetune(task, [f"model.path={r.path}"], after=(r,))
             for (mode, draw, depth), r in runs.items() for task in TASKS}
    random_init = {task: finetune(task, [f"model.path={random_arch.path}", "model.init=random"]) for task in TASKS}
    fig12 = {(mode, draw): run.call(f"fig12:{digest([mode, draw, str(runs[mode, draw, deepest].path)])}",
                                    f"RTD F1 against the {deepest}-layer generator, {mode}, draw {draw}", rtd_f1,
                                    (str(run.recipe), base, str(runs[mode, draw, deepest].path),
                                     [str(runs[mode, draw, d].path) for d in depths], batches),
                                    run.costs.job_start + batches * forward * (len(depths) + 1),
                                    tuple(runs[mode, draw, d].key for d in depths))
             for mode in MODES for draw in run.settings.draws}

    def report() -> FindingReport:
        draws = run.settings.draws
        measured: dict[int, dict] = {}
        for draw in draws:
            m = measured[draw] = {"random": {t: seed_values(run.result(random_init[t])) for t in TASKS}}
            for mode in MODES:
                against = run.result(fig12[mode, draw])
                m[mode] = {d: {"acc": {t: seed_values(run.result(tuned[mode, draw, d, t])) for t in TASKS},
                               "f1_deepest": f1, **_pretraining(runs[mode, draw, d].path)}
                           for d, f1 in zip(depths, against)}
        chosen = {d: run.result(selections[d]) for d in depths}
        verdict, reason = verdict_of(measured)
        width = _width(run, base)
        table = [[mode, f"{d} × {width}", f"one LR {joint_lr:g}, λ {LAMBDA:g}" if mode == MODES[0]
                  else f"{chosen[d]['chosen']} / {DISC_LR:g}",
                  " / ".join(f"{measured[w][mode][d]['rtd_f1']:.3f}" for w in draws),
                  " / ".join(f"{measured[w][mode][d]['f1_deepest']:.3f}" for w in draws),
                  *(mean_std_text(measured[w][mode][d]["acc"][t]) for t in TASKS for w in draws)]
                 for mode in MODES for d in depths]
        table.append(["random init", f"{depths[-1]} × {width} (discriminator)", "—", "—", "—",
                      *(mean_std_text(measured[w]["random"][t]) for t in TASKS for w in draws)])
        plot = _plot(measured, depths, run.out_dir / "repro" / "gen_size.png")
        selected = "; ".join(f"{d} layers: " + ", ".join(f"{lr} → {score:.3f}" for lr, score in c["scores"].items())
                             + f" (chose {c['chosen']})" for d, c in chosen.items())
        return FindingReport(name="gen_size", title="Generator size under original ELECTRA and DecoupledOptim",
                             paper=PAPER, setup=_setup(run, steps, depths, lrs, batches, selected, joint_lr),
                             columns=["design", "generator", "η_G / η_D", "RTD F1, own generator (per draw)",
                                      f"RTD F1 vs the {depths[-1]}-layer generator (per draw)",
                                      *(f"{t} dev accuracy, draw {w}" for t in TASKS for w in draws)],
                             rows=table, verdict=verdict, reason=reason, plots=[str(plot.relative_to(run.out_dir))])

    return report


def _width(run: FindingRun, base: list[str]) -> int:
    return int(recipe_value(run.recipe, "model.generator.hidden_size", tuple(base)))


def _pretraining(path: Path) -> dict:
    """A run's RTD F1 against its own generator (last 10 % of logged steps) and whether its losses stayed finite."""
    rows = metric_rows(path)
    return {"rtd_f1": tail_mean(rows, "rtd_f1"),
            "finite": all(math.isfinite(r[k]) for r in rows for k in ("gen_loss", "disc_loss") if k in r)}


def rtd_f1(recipe: str, overrides: list[str], generator: str, discriminators: list[str], batches: int) -> list[float]:
    """Each discriminator's RTD F1 on `batches` batches of the recipe's pretraining corpus corrupted by
    `generator` (`megakd eval-rtd`, masks and replacements seeded with EVAL_SEED)."""
    from megakd.engine.pretrain import resolve_data
    from megakd.eval.rtd import evaluate_rtd

    _, shards = resolve_data(load_config(recipe, overrides))
    scored = evaluate_rtd(generator, discriminators, shards.spec, num_batches=batches, seed=EVAL_SEED)
    return [d["f1"] for d in scored["discriminators"]]


def select_lr(recipe: str, overrides: list[str], candidates: dict[str, str], out: str, batches: int) -> dict:
    """The roadmap's η_G for one generator depth: each candidate discriminator's mean RTD F1 against every
    candidate generator's replacements (training text); the best one's rate, written to `out` for the
    jobs that pretrain it."""
    paths = list(candidates.values())
    totals = [0.0] * len(paths)
    for generator in paths:
        totals = [t + f for t, f in zip(totals, rtd_f1(recipe, overrides, generator, paths, batches))]
    scores = {lr: total / len(paths) for lr, total in zip(candidates, totals)}
    result = {"scores": scores, "chosen": choose(scores)}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result) + "\n")
    return result


def choose(scores: dict[str, float]) -> str:
    """The rate of the highest score; a tie goes to the lower rate (the generator kept weaker)."""
    return max(sorted(scores, key=float), key=lambda lr: (scores[lr], -float(lr)))


def pretrain_chosen(recipe: str, overrides: dict[str, list[str]], choice: str, work: Path, link: str) -> str:
    """Pretrain (or take from the cache) the run of the rate in `choice`, and link it at `link`."""
    chosen = json.loads(Path(choice).read_text())["chosen"]
    run_dir = pretrain(recipe, overrides[chosen], Path(work))
    tmp = Path(link + ".tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(run_dir.resolve(), target_is_directory=True)
    os.replace(tmp, link)
    return chosen


def _setup(run: FindingRun, steps: int, depths: tuple[int, ...], lrs: tuple[float, ...], batches: int,
           selected: str, joint_lr: float) -> str:
    """The report's setup paragraph: arms, selection, measurements and the rule it judges by."""
    seeds = ", ".join(map(str, run.seeds))
    return (f"`{run.command}`: `{run.recipe.name}` for {steps} steps, its {depths[-1]}-layer discriminator beside "
            f"generators of {', '.join(map(str, depths))} layers at the recipe's width, each arm "
            f"{run.pretrained_draws}. Original ELECTRA: `electra.decoupled=false` (shared embeddings, one AdamW on "
            f"L_MLM + {LAMBDA:g}·L_RTD at the recipe's LR {joint_lr:g}, the joint gradient clipped at 2.0). "
            f"DecoupledOptim: "
            f"η_D = {DISC_LR:g} (the largest rate at which `disc_lr`'s RTD F1 rose in both draws; App. A.3 step 2), "
            f"η_G chosen per generator from {{{', '.join(f'{lr:g}' for lr in lrs)}}} by App. A.3 step 3 on training "
            f"data only: the candidates of draw {SELECTION_DRAW} were pretrained, and each candidate discriminator "
            "scored by its RTD F1 on the pretraining corpus (the mixed corpus has no held-out split: training text, "
            f"with masks and replacements seeded {EVAL_SEED}, not a training seed) against replacements from every "
            "candidate generator of that depth, averaged (App. A.4's fair measure); draw "
            f"{SELECTION_DRAW}'s arm is the chosen candidate, the other draw's a new run at its rate. Selection "
            f"scores (η_G → mean RTD F1): {selected}. Fig. 1.2: every discriminator of a design and draw scored "
            f"with `megakd eval-rtd`'s function on {batches} batches of 32 corrupted by that design and draw's "
            f"{depths[-1]}-layer generator. Downstream: each discriminator fine-tuned on RT "
            "(`configs/finetune-rt.yaml`) and on the sentence-pair task (`configs/finetune-pairs.yaml`, chance "
            f"0.5) with their defaults, seeds {seeds}, dev accuracy mean ± std, beside the same architecture from "
            "random init. Rule, per draw and task (paired t-tests over fine-tuning seeds, p < 0.05), with 'best "
            "shallower' the shallower generator of higher mean: (1) original ELECTRA falls: best shallower above the "
            f"{depths[-1]}-layer arm holds, below it reverses; (2) DecoupledOptim removes the fall: its "
            f"{depths[-1]}-layer arm above original ELECTRA's holds, unless its own best shallower is still "
            "significantly above it; either significantly reversed reverses. A task on which no arm of the draw beats "
            "random init significantly cannot rank pretraining: its claims count as undecided. (3) Fig. 1.2, per "
            f"draw, original ELECTRA: RTD F1 against the {depths[-1]}-layer generator falls with depth (each step by "
            f"> {MARGIN}) holds, rises (each step) reverses; undecided if every F1 < {F1_FLOOR} (discriminators "
            "at the prior). Per draw: reproduced if every claim holds, not reproduced if any reverses, inconclusive "
            "otherwise; the finding's verdict is the draws' when they agree, else inconclusive."
            + (run.note if run.quick else PAIRS_NOTE))


def _task_claims(draw: dict, task: str) -> tuple[list[int], list[str]]:
    """Claims (1) and (2) on one task of one draw: {mode: {depth: {acc: {task: per seed}}}, random: {task}}."""
    depths = sorted(draw[MODES[0]])
    deepest, shallower = depths[-1], depths[:-1]
    acc = {mode: {d: draw[mode][d]["acc"][task] for d in depths} for mode in MODES}
    if not any(compare(a, draw["random"][task])[0] == 1 for mode in MODES for a in acc[mode].values()):
        return [0, 0], [f"{task}: no arm beats random init significantly, so the task cannot rank pretraining"]

    def fall(mode: str):
        best = max(shallower, key=lambda d: fmean(acc[mode][d]))
        return best, *compare(acc[mode][best], acc[mode][deepest])

    best, sensitive, test = fall(MODES[0])
    best_d, remaining, test_d = fall(MODES[1])
    recovery, test_r = compare(acc[MODES[1]][deepest], acc[MODES[0]][deepest])
    removed = -1 if remaining == 1 or recovery == -1 else recovery
    return [sensitive, removed], [
        f"{task}: original {best} − {deepest} layers {test.describe()}; DecoupledOptim {best_d} − {deepest} layers "
        f"{test_d.describe()}; {deepest} layers, DecoupledOptim − original {test_r.describe()}"]


def fig12_claim(f1: dict[int, float]) -> tuple[int, str]:
    """Claim (3) over {generator depth: RTD F1 against the deepest generator} of original ELECTRA."""
    depths = sorted(f1)
    steps = [f1[a] - f1[b] for a, b in zip(depths, depths[1:])]  # shallower minus deeper
    text = "RTD F1 vs the deepest generator " + ", ".join(f"{d} layers {f1[d]:.3f}" for d in depths)
    if max(f1.values()) < F1_FLOOR:
        return 0, text + f" (all below {F1_FLOOR}: at the prior)"
    return (1 if all(s > MARGIN for s in steps) else -1 if all(s < -MARGIN for s in steps) else 0), text


def draw_verdict(draw: dict) -> tuple[str, str]:
    """The rule stated in the setup for one draw."""
    outcomes, parts = [], []
    for task in TASKS:
        found, why = _task_claims(draw, task)
        outcomes += found
        parts += why
    f12, why = fig12_claim({d: m["f1_deepest"] for d, m in draw[MODES[0]].items()})
    if not all(m["finite"] for mode in MODES for m in draw[mode].values()):
        parts.append("a pretraining run produced a non-finite loss")
    names = [f"{claim} ({task})" for task in TASKS for claim in ("falls under original", "removed by DecoupledOptim")]
    held = [f"{name} {OUTCOME[o]}" for name, o in zip(names, outcomes)]
    return claims_verdict([*outcomes, f12]), "; ".join([*held, f"Fig. 1.2 {OUTCOME[f12]} ({why})", *parts])


def verdict_of(measured: dict[int, dict]) -> tuple[str, str]:
    """Every draw's verdict; the finding's is theirs when they agree."""
    return over_draws({draw: draw_verdict(m) for draw, m in measured.items()})


def _plot(measured: dict[int, dict], depths: tuple[int, ...], path: Path) -> Path:
    """Fig. 1.1 per task (dev accuracy against generator depth, a line per design and draw, random init dashed)
    and Fig. 1.2 (RTD F1 against the deepest generator)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(TASKS) + 1, figsize=(4 * (len(TASKS) + 1), 3.2))
    colors = dict(zip(MODES, ("tab:orange", "tab:blue")))
    for draw, m in measured.items():
        style = "-" if draw == min(measured) else "--"
        for mode in MODES:
            for ax, task in zip(axes, TASKS):
                ax.plot(depths, [fmean(m[mode][d]["acc"][task]) for d in depths], "o" + style, color=colors[mode],
                        label=f"{mode}, draw {draw}")
            axes[-1].plot(depths, [m[mode][d]["f1_deepest"] for d in depths], "o" + style, color=colors[mode],
                          label=f"{mode}, draw {draw}")
        for ax, task in zip(axes, TASKS):
            ax.axhline(fmean(m["random"][task]), color="gray", linestyle=style, linewidth=0.8)
    for ax, task in zip(axes, TASKS):
        ax.set_title(f"{task} dev accuracy (gray: random init)", fontsize=9)
    axes[-1].set_title(f"RTD F1 vs the {depths[-1]}-layer generator", fontsize=9)
    for ax in axes:
        ax.set_xticks(depths)
        ax.set_xlabel("generator layers")
    axes[-1].legend(fontsize=7)
    return save_figure(fig, path)
