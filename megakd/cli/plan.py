"""`megakd plan`: the memory/throughput planner, without the engine (tests/test_cli.py checks it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megakd.cli.common import _Command, _examples, emit
from megakd.config import Config, ConfigError, load_config
from megakd.errors import UserError


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from megakd.bench.hardware import GPUS, hardware_from_bench
    from megakd.bench.memory import parameter_counts
    from megakd.bench.planner import GEMM_EFFICIENCY, model_flops, plan, storage_io
    from megakd.bench.report import format_plan
    from megakd.finish import finish_config

    cfg = finish_config(load_config(args.config, [*args.overrides, *args.set_overrides]))
    hw = hardware_from_bench(args.bench, GPUS[args.gpu]) if args.bench else GPUS[args.gpu]
    storage = storage_io(cfg, hw, args.gpus, storage_gbps=args.storage_gbps,
                         corpus_samples=args.corpus_samples)
    efficiency = GEMM_EFFICIENCY if args.efficiency is None else args.efficiency
    plans = plan(cfg, hw, args.gpus, args.gpu_mem, zero=args.zero, pp=args.pp, micro_batches=args.micro_batch,
                 efficiency=efficiency, overlap=args.overlap, reserve_gib=args.reserve_gb)
    counts = parameter_counts(cfg)
    table = format_plan(cfg, hw, args.gpus, args.gpu_mem, counts, model_flops(cfg), plans, args.top,
                        efficiency, storage)
    if args.emit_overrides:  # stdout: only the words, for $(megakd plan ... --emit-overrides) in a launcher line
        print(table.split("\n\n")[0], file=sys.stderr)
        emit(" ".join(_runnable_overrides(args, cfg, plans)))
    else:
        emit(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"parameters": counts, "flops": model_flops(cfg).to_dict(),
                                               "storage": storage.to_dict(),
                                               "plans": [p.to_dict() for p in plans]}, indent=1))
    return 0


def _runnable_overrides(args: argparse.Namespace, cfg: Config, plans: list) -> list[str]:
    """The user's overrides and the fastest fitting layout that megakd's config validation accepts (the
    planner also weighs layouts the pipeline backend refuses, e.g. ZeRO-1 or bf16 with pipeline stages)."""
    from megakd.bench.planner import layout_overrides

    given = [*args.overrides, *args.set_overrides]
    refused = []
    for rank, p in enumerate((p for p in plans if p.fits), 1):
        words = [*given, *layout_overrides(cfg, p.layout)]
        try:
            load_config(args.config, words)
        except ConfigError as err:
            refused.append((rank, str(err)))
            continue
        print(f"layout #{rank}: ZeRO-{p.layout.zero_stage}, {p.layout.pipeline_stages} pipeline stage(s), "
              f"micro-batch {p.layout.micro_batch} x {p.accumulation} accumulation on {args.gpus} GPUs, "
              f"step {p.step_s:.2f} s" + "".join(f"\n  skipped #{r}: {why}" for r, why in refused), file=sys.stderr)
        return words
    reasons = "; ".join(dict.fromkeys(why for _, why in refused))  # each reason once
    raise UserError(f"--emit-overrides: no layout fits in {args.gpu_mem:g} GB"
                    + (f" that megakd runs ({len(refused)} refused: {reasons})" if refused else "")
                    + "; try more GPUs, --gpu-mem or other --zero/--pp")


def add_plan(sub, command: _Command) -> None:
    pl = command(sub, "plan", "memory/throughput planner: layouts that fit, best first", _examples(
        "megakd plan configs/electra-base.yaml --gpus 64 --gpu-mem 80 --gpu h100 --storage-gbps 10",
        "megakd plan configs/electra-base.yaml --gpus 8 --gpu-mem 80 --bench bench/bench_w8.json",
        "megakd plan configs/electra-base.yaml --gpus 64 --gpu-mem 80 --emit-overrides  # launcher line words"))
    pl.add_argument("config", help="pretraining recipe, e.g. configs/electra-base.yaml")
    pl.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    pl.add_argument("--gpu-mem", type=float, required=True, help="memory per GPU in GB (GiB), e.g. 40 or 80")
    pl.add_argument("--gpu", choices=["v100", "a100", "h100"], default="a100", help="peak and bandwidth preset")
    pl.add_argument("--bench", help="JSON from `megakd bench`: measured peak and bandwidth instead of the preset")
    pl.add_argument("--zero", type=int, help="only this ZeRO stage (default: 0-3)")
    pl.add_argument("--pp", type=int, help="only this many pipeline stages (default: every divisor of --gpus)")
    pl.add_argument("--micro-batch", type=int, nargs="+", help="only these micro-batch sizes")
    pl.add_argument("--efficiency", type=float,
                    help="fraction of the dense matmul peak the large GEMMs reach (default 0.7; attention, "
                         "elementwise work, the vocabulary head and the optimizer are modelled part by part: "
                         "docs/performance.md)")
    pl.add_argument("--overlap", type=float, default=0.0, help="fraction of communication hidden by compute")
    pl.add_argument("--reserve-gb", type=float, default=2.0, help="memory kept free (CUDA context, fragmentation)")
    pl.add_argument("--top", type=int, default=10, help="layouts printed")
    pl.add_argument("--json", help="also write every evaluated layout here")
    pl.add_argument("--emit-overrides", action="store_true",
                    help="print only the fastest runnable layout as key=value overrides for the launcher line "
                         "(with the given overrides; the hardware and the chosen row go to stderr)")
    pl.add_argument("--storage-gbps", metavar="GBPS",
                    help="aggregate shared-storage read bandwidth in GB/s (1 GB = 1e9 bytes): a step "
                         "takes at least its reads / this; a warning when that bounds the step "
                         "(default: unbounded)")
    pl.add_argument("--corpus-samples", type=int, metavar="N",
                    help="samples in the corpus, for the per-node index read and the old loader's epoch "
                         "(default: num_samples of <data.shards>/manifest.json, else max_steps x batch)")
    pl.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. train.precision=fp16")
    pl.add_argument("--set", dest="set_overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="the same as a positional key=value (kept for older scripts)")
    pl.set_defaults(func=cmd_plan)
