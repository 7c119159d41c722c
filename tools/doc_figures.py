"""The README's and docs' figures that come from code, generated so that they cannot drift.

    python tools/doc_figures.py           # print each figure block as the code gives it now
    python tools/doc_figures.py --check   # exit 1 naming each block of the docs that differs (the docs test)
    python tools/doc_figures.py --write   # rewrite the blocks in place

A block is the text between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->` in its document
(inline or on lines of their own; GitHub shows neither marker). The blocks: the planner's rows
(`megakd plan`, the A100 preset, datasheet peaks), the storage reads of a 64-GPU electra-base job,
the scale gap of the findings (megakd/repro/scale.py), which findings were measured by older code
(`megakd repro all --plan` lists the commits since) and what one pass of each cluster recipe reads.
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
BLOCK = re.compile(r"<!-- figures:(?P<name>[\w-]+) -->(?P<body>.*?)<!-- /figures:(?P=name) -->", re.DOTALL)
PRESET = "a100"  # `megakd plan`'s default --gpu: the preset every plan figure below assumes


@cache
def _config(recipe: str, *overrides: str):
    from megakd.config import load_config
    from megakd.finish import finish_config

    return finish_config(load_config(ROOT / "configs" / recipe, list(overrides)))


def _best(recipe: str, gpus: int, mem: float, preset: str = PRESET, *overrides: str):
    from megakd.bench.planner import GPUS, plan

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
    from megakd.bench.planner import GPUS, storage_io

    cfg = _config("electra-base.yaml")
    best = _best("electra-base.yaml", 64, 80)
    io = storage_io(cfg, GPUS[PRESET], 64)
    whole_shard = io.readers * io.member_bytes * cfg.train.global_batch_size / io.step_bytes
    return (f"{io.step_bytes / 1e6:.3g} MB a step, {io.need_gbps(best.step_s):.2g} GB/s for the whole job at its "
            f"planned {best.step_s:.2f} s step: 10 GB/s leaves a wide margin. Below the need the plan prints "
            "`warning: storage-bound: N.Nx the compute step time` and times the run at the storage step. The "
            f"whole-shard loader (unindexed shards, or megakd before indexes; {max(cfg.data.num_workers, 1)} "
            f"workers × 64 ranks each reading the whole corpus) read {whole_shard:.0f} times as much")


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
            f"pretraining token positions than the dissertation's ({', '.join(tokens)}); teachers are "
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
}


def blocks(text: str) -> dict[str, str]:
    return {m.group("name"): m.group("body") for m in BLOCK.finditer(text)}


def stale_blocks(root: Path = ROOT, figures: dict[str, tuple[str, Callable[[], str]]] = FIGURES) -> list[str]:
    """One line per block that is missing from its document or differs from what the code gives now."""
    problems = []
    for name, (doc, make) in figures.items():
        found = blocks((root / doc).read_text(encoding="utf-8"))
        if name not in found:
            problems.append(f"{doc}: no <!-- figures:{name} --> block")
        elif found[name] != make():
            problems.append(f"{doc}: figures:{name} is stale: the code now gives {make()!r}")
    return problems


def write_blocks(root: Path = ROOT, figures: dict[str, tuple[str, Callable[[], str]]] = FIGURES) -> list[str]:
    """Rewrite every block in place; the names of those that changed."""
    changed = []
    for doc in sorted({doc for doc, _ in figures.values()}):
        path = root / doc
        text = path.read_text(encoding="utf-8")

        def replace(m: re.Match) -> str:
            if m.group("name") not in figures:
                return m.group(0)
            body = figures[m.group("name")][1]()
            if body != m.group("body"):
                changed.append(m.group("name"))
            return f"<!-- figures:{m.group('name')} -->{body}<!-- /figures:{m.group('name')} -->"

        new = BLOCK.sub(replace, text)
        if new != text:
            path.write_text(new, encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 naming each stale or missing block")
    mode.add_argument("--write", action="store_true", help="rewrite the blocks in README.md and docs/")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale_blocks()
        print("\n".join(problems) or "every figure block is current")
        return 1 if problems else 0
    if args.write:
        changed = write_blocks()
        print(f"rewrote {', '.join(changed)}" if changed else "every figure block was current")
        return 0
    for name, (doc, make) in FIGURES.items():
        print(f"{doc} figures:{name}\n{make()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
