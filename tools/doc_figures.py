"""The README's and docs' figures that come from code, generated so that they cannot drift.

    python tools/doc_figures.py           # print each figure block as the code gives it now
    python tools/doc_figures.py --check   # exit 1 naming each block of the docs that differs (the docs test)
    python tools/doc_figures.py --write   # rewrite the blocks in place (minutes: it re-runs the read simulation)
    python tools/doc_figures.py --write --only plan-table plan-readme

A block is the text between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->` in its document
(inline or on lines of their own; GitHub shows neither marker). The blocks: the planner's rows
(`megakd plan`, the A100 preset, datasheet peaks), the storage reads of a 64-GPU electra-base job,
the scale gap of the findings (megakd/repro/scale.py), which findings were measured by older code
(`megakd repro all --plan` lists the commits since), what one pass of each cluster recipe reads, and
the simulated reads per rank (tools/sim_reads.py; minutes, so these blocks carry a fingerprint of the
code that computed them and the check compares the fingerprint).
tests/test_docs.py fails while a block is stale, so a code change that moves a figure fails until
the docs are regenerated.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

ROOT = Path(__file__).parents[1]
BLOCK = re.compile(r"<!-- figures:(?P<name>[\w-]+)(?: code=(?P<code>\w+))? -->(?P<body>.*?)<!-- /figures:(?P=name) -->",
                   re.DOTALL)
PRESET = "a100"  # `megakd plan`'s default --gpu: the preset every plan figure below assumes


@cache
def _config(recipe: str, *overrides: str):
    from megakd.config import load_config
    from megakd.finish import finish_config

    return finish_config(load_config(ROOT / "configs" / recipe, list(overrides)))


def _best(recipe: str, gpus: int, mem: float, preset: str = PRESET, *overrides: str):
    from megakd.bench.hardware import GPUS
    from megakd.bench.planner import plan

    return next(p for p in plan(_config(recipe, *overrides), GPUS[preset], gpus, mem) if p.fits)


def _hours(plan, steps: int) -> str:
    return f"{plan.step_s * steps / 3600:.1f} h"


def plan_readme() -> str:
    """The README's plan sentence: electra-base on one node of 8 x 40 GB."""
    cfg = _config("electra-base.yaml")
    best = _best("electra-base.yaml", 8, 40)
    steps = cfg.train.max_steps
    return (f"For electra-base on 8 × 40 GB A100s (the default `--gpu a100` preset: datasheet peaks, not "
            f"measured): ZeRO-{best.layout.zero_stage}, micro-batch {best.layout.micro_batch} × "
            f"{best.accumulation}, {best.total_gib:.1f} GiB per GPU, {best.step_s:.2f} s per step, "
            f"{_hours(best, steps)} for {steps:,} steps")


def _layout(best) -> str:
    L = best.layout
    pipeline = f", {L.pipeline_stages} stages" if L.pipeline_stages > 1 else ""
    ckpt = ", checkpointing" if L.checkpointing else ""
    return f"ZeRO-{L.zero_stage}{pipeline}, micro {L.micro_batch}, accum {best.accumulation}{ckpt}"


def plan_table() -> str:
    """docs/distributed.md's predicted table (A100, bf16, the recipes' Table A.1 batch and steps)."""
    from megakd.bench.memory import parameter_counts

    steps = _config("electra-base.yaml").train.max_steps
    lines = ["", f"| config | GPUs | best layout | GiB/GPU | step | {steps:,} steps |", "|---|---|---|---|---|---|"]
    for recipe in ("electra-base.yaml", "electra-large.yaml"):
        cfg = _config(recipe)
        assert cfg.train.max_steps == steps, f"{recipe}: the table's last column assumes {steps:,} steps"
        name = recipe.removesuffix(".yaml")
        for i, (gpus, mem) in enumerate(((8, 40), (8, 80), (64, 80))):
            best = _best(recipe, gpus, mem)
            label = f"{name} ({parameter_counts(cfg)['total'] / 1e6:.1f}M params)" if i == 0 else name
            lines.append(f"| {label} | {gpus} × {mem} GB | {_layout(best)} | {best.total_gib:.1f} | "
                         f"{best.step_s:.2f} s | {_hours(best, cfg.train.max_steps)} |")
    v100 = _best("electra-base.yaml", 8, 32, "v100", "train.precision=fp16")
    lines += ["", f"(V100-32GB, fp16: electra-base on 8 GPUs, {_layout(v100)}, {v100.step_s:.2f} s/step, "
                  f"{_hours(v100, steps)}.)", ""]
    return "\n".join(lines)


def storage_sentence() -> str:
    """docs/distributed.md's storage example: electra-base on 64 A100s."""
    from megakd.bench.hardware import GPUS
    from megakd.bench.planner import storage_io

    cfg = _config("electra-base.yaml")
    best = _best("electra-base.yaml", 64, 80)
    io = storage_io(cfg, GPUS[PRESET], 64)
    whole_shard = io.readers * io.member_bytes * cfg.train.global_batch_size / io.step_bytes
    return (f"{io.step_bytes / 1e6:.3g} MB a step, {io.need_gbps(best.step_s):.2g} GB/s for the whole job at its "
            f"planned {best.step_s:.2f} s step: 10 GB/s leaves a wide margin. Below the need the plan prints "
            "`warning: storage-bound: N.Nx the compute step time` and times the run at the storage step. The "
            f"whole-shard loader (unindexed shards, or megakd before indexes; {max(cfg.data.num_workers, 1)} "
            f"workers × 64 ranks each reading the whole corpus) read {whole_shard:.0f} times as much")


def computed_step() -> str:
    """docs/performance.md's computed electra-base step on one node of 8 A100s and of 8 H100s."""
    from megakd.bench.hardware import GPUS
    from megakd.bench.memory import parameter_counts
    from megakd.bench.planner import ParallelPlan, evaluate
    from megakd.bench.step_time import predict_step, prediction_table

    cfg = _config("electra-base.yaml")
    micro, gpus = cfg.train.micro_batch_size, 8
    accumulation = cfg.train.global_batch_size // (micro * gpus)
    params = parameter_counts(cfg)["total"]
    predictions = {}
    for name in ("a100", "h100"):
        comm = evaluate(cfg, GPUS[name], gpus, 80, ParallelPlan(cfg.backend.zero_stage, 1, micro, False)).comm_s
        predictions[GPUS[name].name] = predict_step(cfg, GPUS[name], micro, accumulation, params / gpus, comm)
    return "\n" + prediction_table(predictions) + "\n"


CLUSTER_RECIPES = ("electra-base.yaml", "electra-large.yaml", "rtd-generator-base.yaml", "dwt-base-weak.yaml",
                   "dwt-base-student.yaml")


def recipe_data() -> str:
    """docs/cluster.md's data table: what one pass of each cluster recipe reads (steps x batch x seq_len)."""
    from megakd.bench.planner import sample_member_bytes

    lines = ["", "| recipe | steps × batch × seq_len | token positions (10⁹) | samples (10⁶) | shards on disk |",
             "|---|---|---|---|---|"]
    for recipe in CLUSTER_RECIPES:
        cfg = _config(recipe)
        samples = cfg.train.max_steps * cfg.train.global_batch_size
        shard_bytes = samples * sample_member_bytes(cfg.data.seq_len, cfg.model.generator.vocab_size)
        lines.append(f"| `configs/{recipe}` | {cfg.train.max_steps:,} × {cfg.train.global_batch_size:,} × "
                     f"{cfg.data.seq_len} | {samples * cfg.data.seq_len / 1e9:.3g} | {samples / 1e6:.3g} | "
                     f"{shard_bytes / 1e9:.3g} GB |")
    return "\n".join([*lines, ""])


# The read simulation takes minutes: its blocks carry a fingerprint of the code it runs (`code=`), and the
# check compares that instead of re-running it; --write re-runs it.
SIMULATED_READS_CODE = ("tools/sim_reads.py", "megakd/data/order.py", "megakd/data/shard_reader.py",
                        "megakd/data/shards.py")


def code_fingerprint(paths: tuple[str, ...]) -> str:
    """What the files do (megakd/repro/report.py's reading: no docstrings, comments or layout), hashed."""
    import hashlib

    from megakd.repro.report import code_meaning

    meaning = [repr(code_meaning(p, (ROOT / p).read_text(encoding="utf-8"))) for p in paths]
    return hashlib.sha256("\0".join(meaning).encode()).hexdigest()[:12]


@cache
def _simulated_reads() -> tuple[dict, ...]:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import sim_reads
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return tuple(sim_reads.simulate(sim_reads.parser().parse_args([])))


def _row(world: int, workers: int) -> dict:
    return next(r for r in _simulated_reads() if r["world"] == world and r["workers"] == workers)


def reads_bound() -> str:
    """The README's bound on a rank's reads, over every simulated worker count (tools/sim_reads.py defaults)."""
    rows = _simulated_reads()
    largest = max(r["world"] for r in rows)
    upto = max(r["ratio"] for r in rows if r["world"] <= 256)
    return (f"≤ {upto:.2f} × its share of the corpus up to 256 ranks, "
            f"{max(r['ratio'] for r in rows if r['world'] == largest):.2f} × at {largest:,}")


def reads_at_64() -> str:
    """The README's storage sentence: 64 ranks x 4 workers."""
    r = _row(64, 4)
    share = r["share"] * r["world"]
    return (f"at 64 ranks × 4 workers a rank reads {r['ratio']:.2f}× its share of the corpus per epoch, where "
            f"the whole-shard reader read {r['old_rank'] / share:.0f} corpora ({r['old_rank'] / r['rank_max']:.0f}×")


def reads_table() -> str:
    """docs/data.md's table: rows at 4 workers per rank."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from sim_reads import human
    finally:
        sys.path.remove(str(ROOT / "tools"))
    lines = ["", "| world | share per rank | fetched, largest rank | ÷ share | no cache | whole-shard reader |",
             "|---:|---:|---:|---:|---:|---:|"]
    for world in (1, 8, 64, 256, 1024):
        r = _row(world, 4)
        saved = r["old_rank"] / r["rank_max"]
        lines.append(f"| {world:,} | {human(r['share'])} | {human(r['rank_max'])} | {r['ratio']:.2f} | "
                     f"{r['uncached_ratio']:.3g} | {human(r['old_rank'])} "
                     f"({f'{saved:.2g}' if saved < 10 else f'{saved:,.0f}'}×) |")
    return "\n".join([*lines, ""])


def _ratio(text: str) -> float:
    return float(text.replace(",", "").rstrip("×"))


def scale_gap() -> str:
    """The README's summary of docs/REPRODUCTION.md's scale table (megakd/repro/scale.py computes both)."""
    from megakd.repro.scale import scale_rows

    rows = scale_rows()
    params = {r[0].strip("`"): re.search(r"\(([\d.,]+×) fewer here\)", r[2]).group(1) for r in rows}
    tokens = {r[0].strip("`"): m.group(1) for r in rows if (m := re.search(r"\(([\d.,]+×) fewer here\)", r[4]))}
    teachers = [m.groups() for r in rows if (m := re.fullmatch(r"([\d.]+)× → ([\d.]+)×", r[3]))]

    def span(values) -> str:
        low, high = min(values, key=_ratio), max(values, key=_ratio)
        return low if low == high else f"{low} to {high}"

    return (f"{span(params.values())} fewer parameters than the papers' models "
            f"({', '.join(f'{k} {v}' for k, v in params.items())}) and {span(tokens.values())} fewer "
            f"pretraining token positions than the papers' pretraining ({', '.join(tokens)}); teachers are "
            f"{span([here + '×' for _, here in teachers])} their students (the papers: "
            f"{span([paper + '×' for paper, _ in teachers])})")


def findings_staleness() -> str:
    """Which sections of docs/REPRODUCTION.md come from the code as it is (megakd/repro/report.py decides)."""
    from megakd.repro.report import measured_by_current_code, section_changes

    states = section_changes(ROOT / "docs" / "REPRODUCTION.md")
    current = [name for name, (stamp, changes) in states.items() if measured_by_current_code(stamp, changes)]
    older = [f"{name} ({stamp or 'not stamped'})" for name, (stamp, changes) in states.items()
             if name not in current]
    return (f"Measured by the current code: {', '.join(current) or 'none'}; by older code: "
            f"{', '.join(older) or 'none'} (`megakd repro all --plan` lists the commits since each)")


FIGURES: dict[str, tuple[str, Callable[[], str]]] = {
    "plan-readme": ("README.md", plan_readme),
    "scale-gap": ("README.md", scale_gap),
    "findings-staleness": ("README.md", findings_staleness),
    "plan-table": ("docs/distributed.md", plan_table),
    "storage": ("docs/distributed.md", storage_sentence),
    "recipe-data": ("docs/cluster.md", recipe_data),
    "step-computed": ("docs/performance.md", computed_step),
    "reads-bound": ("README.md", reads_bound),
    "reads-at-64": ("README.md", reads_at_64),
    "reads-table": ("docs/data.md", reads_table),
}
# Blocks checked by the fingerprint of the code that computes them, not by re-running it.
FINGERPRINTED = {"reads-bound": SIMULATED_READS_CODE, "reads-at-64": SIMULATED_READS_CODE,
                 "reads-table": SIMULATED_READS_CODE}


def blocks(text: str) -> dict[str, re.Match]:
    return {m.group("name"): m for m in BLOCK.finditer(text)}


def stale_blocks(root: Path = ROOT, figures: dict[str, tuple[str, Callable[[], str]]] = FIGURES,
                 fingerprinted: dict[str, tuple[str, ...]] = FINGERPRINTED) -> list[str]:
    """One line per block that is missing from its document or differs from what the code gives now (for a
    fingerprinted block: whose code's fingerprint differs from the one it was written with)."""
    problems = []
    for name, (doc, make) in figures.items():
        found = blocks((root / doc).read_text(encoding="utf-8"))
        if name not in found:
            problems.append(f"{doc}: no <!-- figures:{name} --> block")
        elif name in fingerprinted:
            if found[name].group("code") != code_fingerprint(fingerprinted[name]):
                problems.append(f"{doc}: figures:{name} was written by other code than "
                                f"{', '.join(fingerprinted[name])} is now (--write re-runs it: minutes)")
        elif found[name].group("body") != make():
            problems.append(f"{doc}: figures:{name} is stale: the code now gives {make()!r}")
    return problems


def write_blocks(root: Path = ROOT, figures: dict[str, tuple[str, Callable[[], str]]] = FIGURES,
                 fingerprinted: dict[str, tuple[str, ...]] = FINGERPRINTED, only: set[str] | None = None) -> list[str]:
    """Rewrite the blocks (`only`: those named) in place; the names of those that changed."""
    changed = []
    for doc in sorted({doc for doc, _ in figures.values()}):
        path = root / doc
        text = path.read_text(encoding="utf-8")

        def replace(m: re.Match) -> str:
            name = m.group("name")
            if name not in figures or only is not None and name not in only:
                return m.group(0)
            body = figures[name][1]()
            code = f" code={code_fingerprint(fingerprinted[name])}" if name in fingerprinted else ""
            opening = f"<!-- figures:{name}{code} -->"
            if opening + body != m.group(0)[: -len(f"<!-- /figures:{name} -->")]:
                changed.append(name)
            return f"{opening}{body}<!-- /figures:{name} -->"

        new = BLOCK.sub(replace, text)
        if new != text:
            path.write_text(new, encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 naming each stale or missing block")
    mode.add_argument("--write", action="store_true", help="rewrite the blocks in README.md and docs/")
    parser.add_argument("--only", nargs="+", choices=FIGURES, help="with --write: only these blocks")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale_blocks()
        print("\n".join(problems) or "every figure block is current")
        return 1 if problems else 0
    if args.write:
        changed = write_blocks(only=set(args.only) if args.only else None)
        print(f"rewrote {', '.join(changed)}" if changed else "every figure block was current")
        return 0
    for name, (doc, make) in FIGURES.items():
        if name not in FINGERPRINTED:  # the simulation takes minutes: --write runs it
            print(f"{doc} figures:{name}\n{make()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
