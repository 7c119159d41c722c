"""Finding `electra_vs_mlm`: replaced-token detection learns more per unit of compute than masked LM (ELECTRA
§3.4–3.5).

Clark et al. (2020): ELECTRA's discriminator, which learns from every token, beats a masked LM of the same
architecture at equal pretraining compute, most clearly for small models; their efficiency ablation (GLUE
dev) puts ELECTRA 15 % (the discriminator's loss on the masked positions only) next to BERT, so the gain
comes from learning at every position. Here: ELECTRA (DecoupledOptim, `configs/electra-mini.yaml`), ELECTRA
15 % (`electra.rtd_positions=masked`) and the masked LM of `configs/bert-mini.yaml` (`model.objective=mlm`,
electra-mini's generator trained alone: the discriminator's shape) at two encoder sizes, 2 × 64 (the shared
student's, `STUDENT_SIZES`) and the recipe's 4 × 128, each at equal pretraining FLOPs (`megakd/bench/flops.py`:
the generator's forward and backward counted), so the masked LM runs more steps. Each arm is scored on RT at two
compute points (the checkpoint at half the FLOPs and the end) and on the sentence-pair task at the end, in each of
two pretraining draws, beside the same architecture from random init and the tf-idf + logistic-regression floor
(`megakd/finetune/tfidf.py`).
"""

from __future__ import annotations

from pathlib import Path
from statistics import fmean

from megakd.bench.flops import step_flops
from megakd.config import Config, load_config
from megakd.engine.runlog import tail_mean
from megakd.finetune.config import FinetuneConfig
from megakd.finish import finish_config
from megakd.repro.finding_run import FindingRun, PretrainRun, ReportFn
from megakd.repro.report import FindingReport, mean_std_text, pyplot, save_figure
from megakd.repro.settings import (
    FULL_FINETUNE,
    FULL_PAIRS,
    PAIR_TOKENS,
    PRETRAIN_RECIPE,
    QUICK_FINETUNE,
    QUICK_PRETRAIN,
    QUICK_STUDENT_SIZES,
    RT_TRAIN_SENTENCES,
    SILENT_RUN,
    STUDENT_SIZES,
    TASKS,
    Settings,
    recipe_value,
)
from megakd.repro.stats import PairedTest, claims_verdict, compare
from megakd.repro.training import metric_rows, seed_values
from megakd.store.checkpoint import step_dir

ARMS = {"ELECTRA": (), "ELECTRA 15 %": ("electra.rtd_positions=masked",), "MLM": ("model.objective=mlm",)}
RANDOM, TFIDF = "random init", "tf-idf floor"
QUICK_TASKS = ("RT",)  # --quick: 39 jobs instead of 66, a few minutes on 2 cores
POINT_NAMES = ("half-way", "end")  # compute points per arm: checkpoints at 1/2 and 2/2 of its pretraining FLOPs
POINTS = len(POINT_NAMES)
PAIRS_DEV = ("task.max_dev_examples=1000",)  # full mode: 1,000 of the 2,316 dev pairs, an even spread
TFIDF_SECONDS = 60.0  # the floor on all of RT's 9,071 sentences (tools/baseline_tfidf.py: "about a minute")


def _sizes(sizes: tuple[tuple[str, int], ...]) -> tuple[str, ...]:
    return tuple(f"model.{m}.{k}={v}" for m in ("generator", "discriminator") for k, v in sizes)


# Encoder sizes (layers × width) -> their overrides of the recipe; both models of every ELECTRA arm take the
# size, as the recipe's generator has its discriminator's shape (electra-mini.yaml), and the masked LM is that
# generator, so all three arms fine-tune the same architecture.
SIZES = {"2 × 64": _sizes(STUDENT_SIZES), "4 × 128": ()}
QUICK_SIZES = {"1 × 16": _sizes(QUICK_STUDENT_SIZES), "1 × 32": ()}  # over QUICK_PRETRAIN's 1 × 32
# Full mode, sized to run under two hours with --jobs 2 on 2 cores: ELECTRA and ELECTRA 15 % for 2,400 of the
# recipe's 5,000 steps at both sizes (twice disc_lr's and gen_size's 1,200: the 2 × 64 electra-mini student did
# not pay off downstream at the recipe's length, docs/recipes.md, so pretraining gets the budget), the masked LM
# for the steps of the same FLOPs (1.93× at 4 × 128, 1.77× at 2 × 64), two draws: 12 pretraining runs; 36
# fine-tuning runs of 3 seeds (24 on 3,000 RT sentences, 12 on 1,500 pairs: the end point only, against the 1,000
# dev pairs of PAIRS_DEV) and 4 of random init: 63 min at --jobs 2 with the four 4 × 128 ELECTRA-type runs cached,
# about 90 from scratch (docs/recipes.md). Pairs at both points on the whole dev split measured ~170 min: a pairs
# run took ~365 s against the plan's 191 s (its 2,316 long dev pairs, scored every epoch, are not priced). A third
# compute point or more steps would not fit.
FULL = Settings(PRETRAIN_RECIPE, seeds=(0, 1, 2), steps=2400, finetune=FULL_FINETUNE, draws=(0, 1))
QUICK = Settings(PRETRAIN_RECIPE, seeds=(0, 1), steps=12, pretrain=QUICK_PRETRAIN, finetune=QUICK_FINETUNE,
                 draws=(0, 1))
PAPER = ("ELECTRA (Clark et al., 2020) §3.4–3.5: at equal pretraining compute replaced-token detection beats "
         "masked LM, and the gap is largest for small models. Efficiency ablation (base-size models, GLUE dev): "
         "BERT 82.2, ELECTRA 15 % (the discriminator's loss on the 15 % masked positions only) 82.4, Replace MLM "
         "82.4, All-Tokens MLM 84.3, ELECTRA 85.0: most of ELECTRA's gain comes from learning at every position. "
         "ELECTRA-Small (14M parameters, 1M steps of 128 × 128) scores 79.9 on GLUE dev (docs/glue.md).")
OUTCOME = {1: "ELECTRA ahead", -1: "masked LM ahead", 0: "no difference both draws agree on"}
PLACES = {"between": "between them", "outside": "not between them", "undecided": "not placed (no difference)"}


def step_model_flops(cfg: Config) -> float:
    """Model FLOPs of one optimizer step of a pretraining config (`megakd.bench.flops.step_flops`: the generator's
    forward and backward counted, and under ELECTRA the discriminator's)."""
    cfg = finish_config(cfg)
    return step_flops(cfg, cfg.train.global_batch_size).model


def matched_steps(steps: int, electra_step: float, mlm_step: float) -> int:
    """The masked LM's steps of the FLOPs of `steps` ELECTRA steps: within half a masked-LM step of them."""
    return max(1, round(steps * electra_step / mlm_step))


def checkpoint_steps(steps: int) -> list[int]:
    """The steps of a run's POINTS compute points: every `save_every` = round(steps / POINTS), the last at the
    end (a point k < POINTS is within k/2 steps of k/POINTS of the run)."""
    every = max(1, round(steps / POINTS))
    return [every * k for k in range(1, POINTS) if every * k < steps] + [steps]


def scored_points(task: str, points: int) -> range:
    """The compute points (indices of a run's checkpoints) fine-tuned on `task`: all of them on RT, whose curve
    the verdict compares, and the last on pairs, the second task's check of the end point."""
    return range(points - 1, points) if task == "pairs" else range(points)


def _config(run: FindingRun, overrides: list[str]) -> Config:
    return load_config(run.recipe, [*SILENT_RUN, *overrides, "run.dir=_"])


def declare(run: FindingRun) -> ReportFn:
    steps = min(run.settings.steps, int(recipe_value(run.recipe, "train.max_steps")))
    sizes = QUICK_SIZES if run.quick else SIZES
    tasks = {t: TASKS[t] for t in (QUICK_TASKS if run.quick else TASKS)}
    draws = run.settings.draws
    runs: dict[tuple[str, str, int], tuple[PretrainRun, list[int]]] = {}  # (size, arm, draw) -> run, its points
    flops: dict[tuple[str, str], float] = {}  # (size, arm) -> one step's model FLOPs
    for size, size_overrides in sizes.items():
        base = [*run.settings.pretrain, *size_overrides]
        per_step = {arm: step_model_flops(_config(run, [*base, *o])) for arm, o in ARMS.items()}
        arm_steps = {arm: steps if arm != "MLM" else matched_steps(steps, per_step["ELECTRA"], per_step["MLM"])
                     for arm in ARMS}
        for arm, arm_overrides in ARMS.items():
            flops[size, arm] = per_step[arm]
            points = checkpoint_steps(arm_steps[arm])
            for draw in draws:
                pretrained = run.pretrain([*base, *arm_overrides, f"train.max_steps={arm_steps[arm]}",
                                           f"train.seed={draw}", f"run.save_every={points[0]}", "run.keep_last=0"])
                runs[size, arm, draw] = pretrained, points

    def finetune(task: str, overrides: list[str], encoder: PretrainRun):
        tuned = run.finetune([*overrides, *_task_overrides(run, task), run.seeds_override], encoder,
                             config=tasks[task])
        if task == "pairs":  # priced by its tokens (PAIR_TOKENS), not its count of examples
            job = run.jobs[tuned.key]
            job.seconds = run.costs.job_start + (job.seconds - run.costs.job_start) * PAIR_TOKENS
        return tuned

    tuned = {(size, arm, draw, k, task): finetune(task, [f"model.path={step_dir(r.path, points[k])}"], r)
             for (size, arm, draw), (r, points) in runs.items() for task in tasks
             for k in scored_points(task, len(points))}
    random_init = {(size, task): finetune(task, [f"model.path={runs[size, 'ELECTRA', draws[0]][0].path}",
                                                 "model.init=random"], runs[size, "ELECTRA", draws[0]][0])
                   for size in sizes for task in tasks}
    floors = {task: run.call(f"tfidf:{task}", f"tf-idf floor {Path(config).name}", tfidf_floor,
                             (str(config), [*run.settings.finetune, *_task_overrides(run, task)]),
                             run.costs.job_start + TFIDF_SECONDS * _sentences(run, task))
              for task, config in tasks.items()}

    def report() -> FindingReport:
        measured = {size: {draw: {"random": {t: seed_values(run.result(random_init[size, t])) for t in tasks},
                                  **{arm: {t: [seed_values(run.result(tuned[size, arm, draw, k, t]))
                                               for k in scored_points(t, len(runs[size, arm, draw][1]))]
                                           for t in tasks}
                                     for arm in ARMS}}
                           for draw in draws} for size in sizes}
        floor = {t: run.result(floors[t])["dev"]["accuracy"] for t in tasks}
        curves = {(size, arm): [flops[size, arm] * s for s in runs[size, arm, draws[0]][1]]
                  for size in sizes for arm in ARMS}

        def cell(size: str, draw: int, arm: str, task: str, k: int) -> str:
            scored = scored_points(task, len(curves[size, arm]))
            return mean_std_text(measured[size][draw][arm][task][k - scored.start]) if k in scored else "—"

        table = []
        for size in sizes:
            for arm in ARMS:
                pretraining = {draw: _pretraining(runs[size, arm, draw][0].path, arm) for draw in draws}
                for k, s in enumerate(runs[size, arm, draws[0]][1]):
                    table.append([size, arm, f"{s:,}", f"{curves[size, arm][k]:.3g}",
                                  " / ".join(pretraining[w] for w in draws) if k == len(curves[size, arm]) - 1
                                  else "—",
                                  *(cell(size, w, arm, t, k) for t in tasks for w in draws)])
            table.append([size, RANDOM, "0", "0", "—",
                          *(mean_std_text(measured[size][w]["random"][t]) for t in tasks for w in draws)])
        table.append(["—", TFIDF, "—", "—", "—", *(f"{floor[t]:.3f}" for t in tasks for _ in draws)])
        verdict, reason = verdict_of(measured)
        plot = _plot(measured, curves, floor, run.out_dir / "repro" / "electra_vs_mlm.png")
        return FindingReport(name="electra_vs_mlm", title="Replaced-token detection against masked LM per FLOP",
                             paper=PAPER, setup=_setup(run, steps, sizes, runs, flops, tasks),
                             columns=["encoder", "arm", "steps", "pretraining FLOPs",
                                      "end of pretraining (per draw)",
                                      *(f"{t} dev accuracy, draw {w}" for t in tasks for w in draws)],
                             rows=table, verdict=verdict, reason=reason, plots=[str(plot.relative_to(run.out_dir))])

    return report


def _task_overrides(run: FindingRun, task: str) -> tuple[str, ...]:
    """A task's own fine-tuning overrides beside the mode's (full mode: the pairs' train and dev counts)."""
    return (*FULL_PAIRS, *PAIRS_DEV) if task == "pairs" and not run.quick else ()


def _sentences(run: FindingRun, task: str) -> float:
    """The tf-idf job's training examples in RT sentences' worth (its cost is about linear in them)."""
    cfg = load_config(TASKS[task], [*run.settings.finetune, *_task_overrides(run, task)], cls=FinetuneConfig)
    examples = cfg.task.max_train_examples or RT_TRAIN_SENTENCES
    return examples / RT_TRAIN_SENTENCES * (PAIR_TOKENS if task == "pairs" else 1.0)


def tfidf_floor(config: str, overrides: list[str]) -> dict:
    """The tf-idf + logistic-regression floor of a fine-tuning config's task (`tools/baseline_tfidf.py`'s,
    recorded as it records it, so `megakd finetune` on the same task shows it too)."""
    from megakd.finetune.baselines import cache_tfidf_floor
    from megakd.finetune.tfidf import tfidf_baseline

    task = load_config(config, overrides, cls=FinetuneConfig).task
    result = tfidf_baseline(task)
    cache_tfidf_floor(task, result)
    return result


def _pretraining(path: Path, arm: str) -> str:
    """What a pretraining run reached by its end (last 10 % of logged steps): the discriminator's RTD F1, or the
    masked LM's accuracy."""
    rows = metric_rows(path)
    return f"MLM acc {tail_mean(rows, 'gen_acc'):.3f}" if arm == "MLM" else f"RTD F1 {tail_mean(rows, 'rtd_f1'):.3f}"


def _setup(run: FindingRun, steps: int, sizes: dict, runs: dict, flops: dict, tasks: dict) -> str:
    """The report's setup paragraph: arms, budgets, measurements and the rule it judges by."""
    draw = run.settings.draws[0]
    budgets = "; ".join(
        f"{size}: ELECTRA and ELECTRA 15 % {steps:,} steps, masked LM {runs[size, 'MLM', draw][1][-1]:,} "
        f"({flops[size, 'ELECTRA'] / flops[size, 'MLM']:.2f}× the FLOPs per step)" for size in sizes)
    seeds = ", ".join(map(str, run.seeds))
    return (f"`{run.command}`: `{run.recipe.name}` (DecoupledOptim, its generator at the discriminator's size) as "
            "ELECTRA; the same with `electra.rtd_positions=masked` as ELECTRA 15 % (the discriminator still reads "
            "every token, its loss only the masked ones; its logged RTD F1 still counts every token); "
            "`model.objective=mlm` as the masked LM (`bert-mini.yaml`: the generator alone, the discriminator's "
            f"shape), at encoder sizes {', '.join(sizes)}, each arm {run.pretrained_draws}. Equal pretraining FLOPs "
            "(`megakd/bench/flops.py`, matrix FLOPs of forward and backward, the generator's included): "
            f"{budgets}. Compute points: the checkpoints at half the FLOPs and at the end of each run (the "
            "half-way one is mid-schedule: its LR has not decayed). Downstream: each checkpoint fine-tuned on RT "
            "(`configs/finetune-rt.yaml`)" + (", and the last on the sentence-pair task (`configs/finetune-pairs"
                                              ".yaml`, chance 0.5)" if "pairs" in tasks else "") +
            f" with their defaults, seeds {seeds}, dev accuracy mean ± std, beside the same architecture from random "
            "init and the tf-idf + logistic-regression floor on the same split (`megakd/finetune/tfidf.py`). Rule, "
            "per encoder size and task, paired t-tests over fine-tuning seeds (p < 0.05) at each compute point: in "
            "a draw ELECTRA is ahead if it beats the masked LM significantly at some point and loses at none, "
            "behind in the mirror case; a task counts where both draws agree, and only where some arm beats random "
            "init significantly at the last point in both draws (else it cannot rank pretraining). Per size: "
            "ELECTRA ahead if a task says so and none says the opposite (and behind in the mirror case). "
            "Reproduced if ELECTRA is ahead at every size; not reproduced at this scale if it is behind at any "
            "size (the reason names the sizes); inconclusive otherwise. ELECTRA 15 % is placed by the same rule "
            "against each of the two: between them (below ELECTRA or above the masked LM), or not; it does not "
            "enter the verdict." + (run.note if run.quick else
                                     " Fine-tuning used 3,000 of RT's 9,071 training sentences and 1,500 of the "
                                     "25,397 training pairs (each an even spread, about the same number of tokens), "
                                     "RT's whole dev split and 1,000 of the 2,316 dev pairs (an even spread); the "
                                     "tf-idf floor is on the same splits."))


def curve_outcome(a: list[list[float]], b: list[list[float]]) -> tuple[int, list[PairedTest]]:
    """a against b along their compute points (per point, per-seed scores): +1 if a is significantly above at
    some point and below at none, −1 in the mirror case, 0 otherwise; and each point's test of a − b."""
    found = [compare(x, y) for x, y in zip(a, b, strict=True)]
    return _combined([o for o, _ in found]), [t for _, t in found]


def ranks_pretraining(by_draw: dict[int, dict], task: str) -> bool:
    """In every draw some arm's last compute point beats random init significantly on `task` (else the task
    cannot rank pretraining)."""
    return all(any(compare(m[arm][task][-1], m["random"][task])[0] == 1 for arm in ARMS) for m in by_draw.values())


def _ranking_tasks(by_draw: dict[int, dict]) -> list[str]:
    return [t for t in next(iter(by_draw.values()))["random"] if ranks_pretraining(by_draw, t)]


def _combined(outcomes: list[int]) -> int:
    """+1 if some outcome is +1 and none −1, −1 in the mirror case, 0 otherwise."""
    return 1 if 1 in outcomes and -1 not in outcomes else -1 if -1 in outcomes and 1 not in outcomes else 0


def arm_claim(by_draw: dict[int, dict], a: str, b: str) -> tuple[int, str]:
    """Arm `a` against arm `b` at one size ({draw: {arm: {task: [per point: per seed]}, random: {task}}}), the rule
    of the setup over the tasks that rank pretraining: per task and draw `curve_outcome`, counted where the draws
    agree; (+1 a ahead, −1 b ahead, 0 neither) and the tests."""
    outcomes, parts = [], []
    for task in _ranking_tasks(by_draw):
        per_draw = {w: curve_outcome(m[a][task], m[b][task]) for w, m in by_draw.items()}
        found = {o for o, _ in per_draw.values()}
        outcomes.append(found.pop() if len(found) == 1 else 0)
        tests = "; ".join(f"draw {w}: " + ", ".join(f"{name} {t.describe()}"
                                                    for name, t in zip(POINT_NAMES[-len(points):], points))
                          for w, (_, points) in per_draw.items())  # a task scored at the end only: "end"
        parts.append(f"{task}, {a} − {b}: {tests}" + ("" if len({o for o, _ in per_draw.values()}) == 1
                                                      else " (the draws disagree: not counted)"))
    return _combined(outcomes), "; ".join(parts)


def placement(by_draw: dict[int, dict]) -> tuple[str, str]:
    """Where ELECTRA 15 % sits at one size, by `arm_claim` against each of the other two: "between" if it is
    below ELECTRA or above the masked LM and outside them nowhere, "outside" if it is above ELECTRA or below the
    masked LM, "undecided" otherwise; and the outcomes."""
    below, _ = arm_claim(by_draw, "ELECTRA", "ELECTRA 15 %")
    above, _ = arm_claim(by_draw, "ELECTRA 15 %", "MLM")
    where = "outside" if -1 in (below, above) else "between" if 1 in (below, above) else "undecided"
    words = {1: "ahead", -1: "behind", 0: "no difference"}
    return where, f"ELECTRA against it: {words[below]}; it against the masked LM: {words[above]}"


def verdict_of(measured: dict[str, dict[int, dict]]) -> tuple[str, str]:
    """ELECTRA against the masked LM at every size ({size: {draw: {arm: {task: [per point]}, random}}}), and
    where ELECTRA 15 % sits."""
    claims, parts, behind = [], [], []
    for size, by_draw in measured.items():
        tasks = list(next(iter(by_draw.values()))["random"])
        unranked = [t for t in tasks if t not in _ranking_tasks(by_draw)]
        claim, why = arm_claim(by_draw, "ELECTRA", "MLM")
        claims.append(claim)
        if claim == -1:
            behind.append(size)
        where, placed = placement(by_draw)
        skipped = (f"{', '.join(unranked)}: no arm beats random init significantly in every draw, so "
                   f"{'it' if len(unranked) == 1 else 'they'} cannot rank pretraining") if unranked else ""
        parts.append(f"{size}: {OUTCOME[claim]} (" + "; ".join(filter(None, (why, skipped)))
                     + f"); ELECTRA 15 % {PLACES[where]} ({placed})")
    lead = f"ELECTRA loses to the masked LM at equal compute at {', '.join(behind)}. " if behind else ""
    return claims_verdict(claims), lead + ". ".join(parts) + "."


def _plot(measured: dict, curves: dict, floor: dict, path: Path) -> Path:
    """Per task: dev accuracy against pretraining FLOPs, a curve per arm and size (mean over draws of each draw's
    seed mean, bars: the draws' range), random init (at the left edge) and the tf-idf floor as lines."""
    plt = pyplot()
    tasks = list(floor)
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 3.6), squeeze=False)
    axes = axes[0]
    colors = dict(zip(ARMS, ("tab:blue", "tab:cyan", "tab:red")))
    styles = dict(zip(measured, ("--", "-")))
    for ax, task in zip(axes, tasks):
        for size, by_draw in measured.items():
            for arm in ARMS:
                per_draw = [[fmean(seeds) for seeds in m[arm][task]] for m in by_draw.values()]
                means = [fmean(v) for v in zip(*per_draw)]
                spread = [(max(v) - min(v)) / 2 for v in zip(*per_draw)]
                ax.errorbar(curves[size, arm][-len(means):], means, yerr=spread, fmt="o" + styles[size],
                            color=colors[arm], capsize=3, label=f"{arm}, {size}")
            ax.axhline(fmean(fmean(m["random"][task]) for m in by_draw.values()), color="gray",
                       linestyle=styles[size], linewidth=0.8)
        ax.axhline(floor[task], color="black", linestyle=":", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("pretraining FLOPs")
        ax.set_title(f"{task} dev accuracy (gray: random init, dotted: tf-idf)", fontsize=9)
    axes[0].legend(fontsize=7)
    return save_figure(fig, path)
