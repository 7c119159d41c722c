"""`megakd bench`: the cluster benchmark, and `megakd bench plot` of its results."""

from __future__ import annotations

import argparse
from pathlib import Path

from megakd.cli.common import _Command, _examples, emit, log
from megakd.config import ConfigError, load_config

BENCH_PARTS = ("collectives", "matmul", "loader", "train")


def _bytes_arg(text: str) -> int:
    units = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}
    number, unit = text.upper().rstrip("B")[:-1], text.upper().rstrip("B")[-1:]
    if unit.isdigit():
        number, unit = number + unit, ""
    try:
        return int(float(number) * units[unit])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a size like 4096, 1K, 64M or 1G, got {text!r}") from None


def cmd_bench(args: argparse.Namespace) -> int:
    import json

    from megakd.bench.plots import plot_bandwidth, plot_scaling

    out = Path(args.out)
    if args.rest[:1] == ["plot"]:
        files = args.rest[1:]
        if not files:
            raise ConfigError("bench plot: expected one or more JSON files written by `megakd bench`")
        results = [json.loads(Path(f).read_text()) for f in files]
        out.mkdir(parents=True, exist_ok=True)
        written = [plot_bandwidth(results, [Path(f).stem for f in files], out / "bandwidth.png"),
                   plot_scaling(results, out / "scaling.png")]
        log.info("wrote %s", ", ".join(str(w) for w in written if w))
        return 0
    from megakd.bench.cluster import run_bench
    from megakd.bench.report import format_bench

    parts = tuple(args.parts.split(","))
    unknown = set(parts) - set(BENCH_PARTS)
    if unknown:
        raise ConfigError(f"--parts: expected a comma list of {', '.join(BENCH_PARTS)}; "
                          f"got {sorted(unknown)}")
    if args.config is None and {"loader", "train"} & set(parts):
        raise ConfigError("bench: -c CONFIG is needed for the loader and train measurements (or --parts without them)")
    if args.min_bytes > args.max_bytes or args.factor < 2:
        raise ConfigError("--min-bytes/--max-bytes/--factor: expected min <= max and factor >= 2")
    cfg = load_config(args.config, args.rest)
    sizes = []
    size = args.min_bytes
    while size <= args.max_bytes:
        sizes.append(size)
        size *= args.factor
    res = run_bench(cfg, parts=parts, sizes=sizes, iters=args.iters, matmul_n=args.matmul_n,
                    loader_batches=args.loader_batches, train_steps=args.steps, train_warmup=args.warmup,
                    peak_tflops=args.peak_tflops)
    if args.launch.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"bench_w{res['world_size']}.json"
        path.write_text(json.dumps(res, indent=1))
        emit(format_bench(res))
        pngs = [plot_bandwidth([res], [f"world {res['world_size']}"], out / f"bandwidth_w{res['world_size']}.png")
                ] if "collectives" in res else []
        log.info("wrote %s", ", ".join(str(p) for p in [path, *pngs]))
    return 0


def add_bench(sub, command: _Command) -> None:
    b = command(sub, "bench", "cluster benchmark: collectives, matmul, data loader, training throughput; "
                "'bench plot A.json B.json' draws results", _examples(
                    "megakd bench --parts matmul  # one process: the device's matmul peak",
                    "launch/torchrun.sh 2 bench -c configs/electra-tiny.yaml train.micro_batch_size=16",
                    "megakd bench plot bench/bench_w1.json bench/bench_w2.json --out bench/plots"))
    b.add_argument("-c", "--config", help="pretraining recipe for the loader and train parts")
    b.add_argument("--parts", default=",".join(BENCH_PARTS), metavar="PART[,PART...]",
                   help=f"what to measure, a comma list of {', '.join(BENCH_PARTS)}")
    b.add_argument("--min-bytes", type=_bytes_arg, default=_bytes_arg("4K"), help="smallest message")
    b.add_argument("--max-bytes", type=_bytes_arg, default=_bytes_arg("64M"), help="largest message")
    b.add_argument("--factor", type=int, default=4, help="message size step")
    b.add_argument("--iters", type=int, default=5, help="timed iterations per collective and matmul")
    b.add_argument("--matmul-n", type=int, default=2048, help="matmul size (n x n by n x n)")
    b.add_argument("--loader-batches", type=int, default=20, help="batches the loader measurement reads")
    b.add_argument("--steps", type=int, default=5, help="timed training steps")
    b.add_argument("--warmup", type=int, default=2, help="untimed training steps first")
    b.add_argument("--peak-tflops", type=float, help="per-device peak for MFU (default: the measured matmul)")
    b.add_argument("--out", default="bench", help="directory for bench_wN.json and the PNG plots")
    b.add_argument("rest", nargs="*", help="key=value config overrides, or: plot FILE.json [FILE.json ...]")
    b.set_defaults(func=cmd_bench)
