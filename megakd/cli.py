"""`megakd <command>`: the single entry point (pretrain, data, and the commands built on them).

Each command is a small function that parses its arguments and calls the library; errors in
user input (config keys, files) end the process with a one-line message and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from importlib.metadata import PackageNotFoundError, version

from megakd.config import ConfigError, load_config
from megakd.errors import UserError
from megakd.repro import FINDINGS

log = logging.getLogger("megakd")


def setup_logging(level: str = "INFO") -> None:
    """One log format for every process; non-zero ranks only log warnings and errors."""
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    logging.basicConfig(
        level=getattr(logging, level) if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("matplotlib", "PIL", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def cmd_pretrain(args: argparse.Namespace) -> int:
    from megakd.engine.pretrain import run_pretraining

    return _train(args, run_pretraining)


def cmd_distill(args: argparse.Namespace) -> int:
    from megakd.engine.pretrain import run_distill

    return _train(args, run_distill)


def _train(args: argparse.Namespace, run) -> int:
    """Train, then (rank 0, unless stopped early) export the newest checkpoint to run.dir/hf.

    Exit 0 when finished or stopped by SIGTERM/SIGUSR1 (preemption: a scheduler requeues the
    job); 130 (128 + SIGINT, the shell's code for Ctrl-C) when stopped by SIGINT, so a script or
    loop around the command stops too. Either way the checkpoint of the last step was written."""
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        import yaml

        from megakd.config import config_to_dict
        from megakd.engine.pretrain import resolve_config

        emit(yaml.safe_dump(config_to_dict(resolve_config(cfg)), sort_keys=False).rstrip())
        return 0
    result = run(cfg, resume=args.resume, allow_change=tuple(args.allow_change))
    if result.preempted:
        log.warning("stopped at step %d; run the same command with --resume auto to continue", result.step)
        return EXIT_INTERRUPTED if result.interrupted else 0
    if cfg.run.export_hf and int(os.environ.get("RANK", "0")) == 0:
        from megakd.convert import export_run

        log.info("exported HuggingFace model to %s", export_run(result.run_dir))
    log.info("finished %d steps; run directory %s", result.step, result.run_dir)
    return 0


def cmd_finetune(args: argparse.Namespace) -> int:
    """Fine-tune on the configured backend; exit codes as for pretraining (0 also when stopped by
    SIGTERM/SIGUSR1 after a checkpoint, 130 on SIGINT, 1 after too many non-finite losses)."""
    from megakd.finetune.config import FinetuneConfig
    from megakd.finetune.jobs import job_for
    from megakd.finetune.runtime import Runtime, Stopped, describe

    cfg = load_config(args.config, args.overrides, cls=FinetuneConfig)
    run = job_for(cfg)
    runtime = Runtime(cfg, resume=args.resume)
    try:
        runtime.open()
        log.info("fine-tuning on %s", describe(runtime))
        run(cfg, runtime)
    except Stopped as stop:
        log.warning("stopped on a signal after a checkpoint; run the same command with --resume auto to continue")
        return EXIT_INTERRUPTED if stop.interrupted else 0
    except FloatingPointError as err:
        print(f"megakd: error: {err}", file=sys.stderr)
        return 1
    finally:
        runtime.close()
    log.info("fine-tuning finished; summary in %s/summary.json", cfg.run.dir)
    return 0


def cmd_eval_rtd(args: argparse.Namespace) -> int:
    import json

    from megakd.eval.rtd import evaluate_rtd

    report = evaluate_rtd(args.generator, args.discriminator, args.shards, args.tokenizer,
                          num_batches=args.batches, batch_size=args.batch_size, seed=args.seed,
                          mask_prob=args.mask_prob)
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    sys.stdout.write(text + "\n")
    return 0


def cmd_repro(args: argparse.Namespace) -> int:
    from megakd.repro import FINDINGS, plan_findings, run_findings
    from megakd.repro.runs import Costs

    names = list(FINDINGS) if "all" in args.name else list(dict.fromkeys(args.name))
    seeds = tuple(args.seeds) if args.seeds else None
    if args.jobs < 1:
        raise UserError(f"--jobs: expected a positive number of jobs, got {args.jobs}")
    try:
        costs = Costs.parse(args.unit_seconds or [])
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.plan:
        plan = plan_findings(names, args.work, quick=args.quick, seeds=seeds, recipe=args.recipe,
                             workers=args.jobs, costs=costs)
        print(plan.table(names, costs))
        return 0
    run_findings(names, args.out, args.work, quick=args.quick, seeds=seeds, recipe=args.recipe, workers=args.jobs,
                 costs=costs)
    return 0


def cmd_data_tokenizer(args: argparse.Namespace) -> int:
    from megakd.data.tokenizer import train_tokenizer

    tok = train_tokenizer(args.input, args.vocab_size, args.out, input_sentence_size=args.input_sentence_size,
                          seed=args.seed)
    log.info("tokenizer with %d pieces (vocab hash %s) in %s", tok.vocab_size, tok.vocab_hash, args.out)
    return 0


def cmd_data_shards(args: argparse.Namespace) -> int:
    import functools
    from pathlib import Path

    from megakd.data.shards import in_valid_split, write_shards
    from megakd.data.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(args.tokenizer)
    options = {"samples_per_shard": args.samples_per_shard, "num_workers": args.workers,
               "min_tokens": args.min_tokens, "pack": args.pack}
    fraction = args.valid_fraction
    if fraction and not 0.0 < fraction < 1.0:
        raise ConfigError(f"--valid-fraction: expected a fraction in (0, 1), got {fraction}")
    in_valid = functools.partial(in_valid_split, fraction=fraction)
    keep_train = (lambda text: not in_valid(text)) if fraction else None
    manifest = write_shards(args.input, tokenizer, args.seq_len, args.out, keep=keep_train, **options)
    log.info("%d samples in %d shards in %s", manifest["num_samples"], len(manifest["shards"]), args.out)
    if fraction:
        valid = Path(args.out) / "valid"
        manifest = write_shards(args.input, tokenizer, args.seq_len, valid, keep=in_valid, **options)
        log.info("held out %d samples in %d shards in %s", manifest["num_samples"], len(manifest["shards"]), valid)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from megakd.convert import from_hf, to_hf

    if args.convert_command == "to-hf":
        written = to_hf(args.src, args.out, force=args.force)
        log.info("wrote %s", ", ".join(f"{args.out}/{d} ({arch})" for d, arch in written.items()))
    else:
        kind, _ = from_hf(args.src, args.out, force=args.force)
        log.info("wrote megakd %s model directory %s", kind, args.out)
    return 0


def emit(text: str) -> None:
    """The CLI's table output (bench, plan): plain stdout, so it can be piped or saved."""
    print(text, flush=True)


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
    from pathlib import Path

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
    unknown = set(parts) - {"collectives", "matmul", "loader", "train"}
    if unknown:
        raise ConfigError(f"--parts: expected a comma list of collectives, matmul, loader, train; got {sorted(unknown)}")
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
    if int(os.environ.get("RANK", "0")) == 0:
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"bench_w{res['world_size']}.json"
        path.write_text(json.dumps(res, indent=1))
        emit(format_bench(res))
        pngs = [plot_bandwidth([res], [f"world {res['world_size']}"], out / f"bandwidth_w{res['world_size']}.png")
                ] if "collectives" in res else []
        log.info("wrote %s", ", ".join(str(p) for p in [path, *pngs]))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from megakd.bench.memory import parameter_counts
    from megakd.bench.planner import GPUS, hardware_from_bench, model_flops, plan
    from megakd.bench.report import format_plan
    from megakd.engine.pretrain import resolve_config

    cfg = resolve_config(load_config(args.config, [*args.overrides, *args.set_overrides]))
    hw = hardware_from_bench(args.bench) if args.bench else GPUS[args.gpu]
    plans = plan(cfg, hw, args.gpus, args.gpu_mem, zero=args.zero, pp=args.pp, micro_batches=args.micro_batch,
                 efficiency=args.efficiency, overlap=args.overlap, reserve_gib=args.reserve_gb)
    counts = parameter_counts(cfg)
    emit(format_plan(cfg, hw, args.gpus, args.gpu_mem, counts, model_flops(cfg), plans, args.top, args.efficiency))
    if args.json:
        Path(args.json).write_text(json.dumps({"parameters": counts, "flops": model_flops(cfg).to_dict(),
                                               "plans": [p.to_dict() for p in plans]}, indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megakd", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"megakd {_version()}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pretrain", help="ELECTRA (DecoupledOptim or original) or BERT-MLM pretraining")
    p.add_argument("-c", "--config", required=True, help="YAML recipe, e.g. configs/electra-tiny.yaml")
    p.add_argument("--resume", help="'auto' (newest intact checkpoint in run.dir, if any) or a checkpoint directory")
    p.add_argument("--allow-change", action="append", default=[], metavar="KEY",
                   help="at resume, let this state-bearing config key differ from the checkpoint's and take effect "
                        "(repeatable), e.g. --allow-change optim.discriminator.lr")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.max_steps=100")
    p.set_defaults(func=cmd_pretrain)

    p = sub.add_parser("finetune", help="sequence (pair) classification/regression: fine-tuning, label "
                       "regularisation, SoTeacher, TGT")
    p.add_argument("-c", "--config", required=True, help="YAML recipe, e.g. configs/finetune-rt.yaml")
    p.add_argument("--resume", choices=["auto"], help="'auto': reuse finished seeds in run.dir and continue the "
                   "unfinished one from its newest intact checkpoint")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. finetune.seeds=[1,2,3]")
    p.set_defaults(func=cmd_finetune)

    p = sub.add_parser("distill", help="DWT: pretraining with a frozen teacher MLM (distill.teacher) on the "
                       "student's MLM loss")
    p.add_argument("-c", "--config", required=True, help="YAML recipe, e.g. configs/dwt-weak.yaml")
    p.add_argument("--resume", help="'auto' (newest intact checkpoint in run.dir, if any) or a checkpoint directory")
    p.add_argument("--allow-change", action="append", default=[], metavar="KEY",
                   help="at resume, let this state-bearing config key differ from the checkpoint's and take effect "
                        "(repeatable), e.g. --allow-change optim.discriminator.lr")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. distill.teacher=runs/teacher")
    p.set_defaults(func=cmd_distill)

    p = sub.add_parser("eval-rtd", help="score discriminators against one fixed generator on fixed masked data "
                       "(RTD accuracy, precision, recall, F1 as JSON)")
    p.add_argument("--generator", required=True, help="run, checkpoint, megakd model dir or HF ELECTRA generator")
    p.add_argument("--discriminator", required=True, nargs="+", help="one or more runs, checkpoints, megakd model "
                   "dirs or HF ElectraForPreTraining dirs")
    p.add_argument("--shards", required=True, help="shard directory from `megakd data shards`")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the generator's own)")
    p.add_argument("--batches", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="fixes the masks and the generator's samples")
    p.add_argument("--mask-prob", type=float, default=0.15)
    p.add_argument("--out", help="also write the JSON report to this file")
    p.set_defaults(func=cmd_eval_rtd)

    p = sub.add_parser("repro", help="re-run one of the papers' findings at CPU scale and write its section of "
                       "docs/REPRODUCTION.md (paper numbers, measured mean ± std over seeds, verdict)")
    p.add_argument("name", nargs="+", choices=(*FINDINGS, "all"),
                   help="the findings to run together (jobs of different findings share the cores), or all")
    p.add_argument("--quick", action="store_true", help="small settings, for tests of the report's structure")
    p.add_argument("--seeds", type=int, nargs="+", help="override the finding's seeds")
    p.add_argument("--recipe", help="the pretraining recipe the finding trains from (default: the finding's own; "
                   "with all: replaces configs/electra-mini.yaml in disc_lr, soteacher, labelreg and tgt)")
    p.add_argument("--out", default="docs/REPRODUCTION.md", help="the report (its other sections are kept)")
    p.add_argument("--work", default="runs/repro", help="scratch directory for the runs")
    p.add_argument("--jobs", type=int, default=2,
                   help="jobs at a time (default 2, for 2 cores): with more than one, each runs in a single-thread "
                   "process; 1 runs them one after the other in this process")
    p.add_argument("--plan", action="store_true",
                   help="print the estimated minutes per finding and in total, and run nothing")
    p.add_argument("--unit-seconds", nargs="+", metavar="NAME=SECONDS",
                   help="the plan's cost model: electra_mini_step, rt_epoch, job_start (defaults in the README)")
    p.set_defaults(func=cmd_repro)

    data = sub.add_parser("data", help="tokenizer training and WebDataset shard writing")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    t = data_sub.add_parser("tokenizer", help="train a cased SentencePiece BPE tokenizer")
    t.add_argument("--input", nargs="+", required=True, help="text/.gz/.jsonl files or directories")
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--input-sentence-size", type=int, default=2_000_000,
                   help="sentences sampled for training (bounds memory on large corpora)")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_data_tokenizer)
    s = data_sub.add_parser("shards", help="tokenize and pack documents into WebDataset shards")
    s.add_argument("--input", nargs="+", required=True, help="text/.gz/.jsonl files, directories or HF datasets")
    s.add_argument("--tokenizer", required=True,
                   help="a megakd tokenizer dir, or an HF tokenizer/model dir (WordPiece vocab.txt or tokenizer.json)")
    s.add_argument("--seq-len", type=int, required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--samples-per-shard", type=int, default=10_000)
    s.add_argument("--workers", type=int, default=1)
    s.add_argument("--valid-fraction", type=float, default=0.0,
                   help="hold out this fraction of documents (by a hash of their text) as OUT/valid/, "
                        "which pretraining finds by itself for train.eval_every")
    s.add_argument("--min-tokens", type=int, default=8, help="drop document pieces with fewer tokens")
    s.add_argument("--pack", action="store_true",
                   help="pack several short documents into one sample (per-document positions and attention)")
    s.set_defaults(func=cmd_data_shards)

    conv = sub.add_parser("convert", help="HuggingFace export/import")
    conv_sub = conv.add_subparsers(dest="convert_command", required=True)
    for name, help_text, src_help in (
        ("to-hf", "run/checkpoint/model dir -> HF dirs (ELECTRA: OUT/discriminator, OUT/generator)",
         "run directory (newest checkpoint), checkpoint directory or megakd model directory"),
        ("from-hf", "local HF BERT/ELECTRA dir -> megakd model directory", "local HF model directory"),
    ):
        c = conv_sub.add_parser(name, help=help_text)
        c.add_argument("src", help=src_help)
        c.add_argument("out", help="output directory (written atomically)")
        c.add_argument("--force", action="store_true", help="replace a non-empty OUT")
        c.set_defaults(func=cmd_convert)

    b = sub.add_parser("bench", help="cluster benchmark: collectives, matmul, data loader, training throughput; "
                                     "'bench plot A.json B.json' draws results")
    b.add_argument("-c", "--config", help="pretraining recipe for the loader and train parts")
    b.add_argument("--parts", default="collectives,matmul,loader,train", help="comma list of what to measure")
    b.add_argument("--min-bytes", type=_bytes_arg, default=_bytes_arg("4K"))
    b.add_argument("--max-bytes", type=_bytes_arg, default=_bytes_arg("64M"))
    b.add_argument("--factor", type=int, default=4, help="message size step")
    b.add_argument("--iters", type=int, default=5, help="timed iterations per collective and matmul")
    b.add_argument("--matmul-n", type=int, default=2048)
    b.add_argument("--loader-batches", type=int, default=20)
    b.add_argument("--steps", type=int, default=5, help="timed training steps")
    b.add_argument("--warmup", type=int, default=2, help="untimed training steps first")
    b.add_argument("--peak-tflops", type=float, help="per-device peak for MFU (default: the measured matmul)")
    b.add_argument("--out", default="bench", help="directory for bench_wN.json and the PNG plots")
    b.add_argument("rest", nargs="*", help="key=value config overrides, or: plot FILE.json [FILE.json ...]")
    b.set_defaults(func=cmd_bench)

    pl = sub.add_parser("plan", help="memory/throughput planner: layouts that fit, best first")
    pl.add_argument("config", help="pretraining recipe, e.g. configs/electra-base.yaml")
    pl.add_argument("--gpus", type=int, required=True)
    pl.add_argument("--gpu-mem", type=float, required=True, help="memory per GPU in GB (GiB), e.g. 40 or 80")
    pl.add_argument("--gpu", choices=["v100", "a100", "h100"], default="a100", help="peak and bandwidth preset")
    pl.add_argument("--bench", help="JSON from `megakd bench`: measured peak and bandwidth instead of the preset")
    pl.add_argument("--zero", type=int, help="only this ZeRO stage (default: 0-3)")
    pl.add_argument("--pp", type=int, help="only this many pipeline stages (default: every divisor of --gpus)")
    pl.add_argument("--micro-batch", type=int, nargs="+", help="only these micro-batch sizes")
    pl.add_argument("--efficiency", type=float, default=0.45, help="fraction of peak the model FLOPs reach")
    pl.add_argument("--overlap", type=float, default=0.0, help="fraction of communication hidden by compute")
    pl.add_argument("--reserve-gb", type=float, default=2.0, help="memory kept free (CUDA context, fragmentation)")
    pl.add_argument("--top", type=int, default=10)
    pl.add_argument("--json", help="also write every evaluated layout here")
    pl.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. train.precision=fp16")
    pl.add_argument("--set", dest="set_overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="the same as a positional key=value (kept for older scripts)")
    pl.set_defaults(func=cmd_plan)
    return parser


EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT

# Operating-system errors that mean bad input (a path that is missing, taken, of the wrong kind
# or not writable). Others (disk full, I/O errors) are not the user's input and keep their traceback.
_INPUT_OS_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


def _one_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.filename is not None:
        return f"{err.filename}: {err.strerror.lower() if err.strerror else err}"
    return " ".join(str(err).split())
def _version() -> str:
    try:
        return version("megakd")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


_OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")  # key=value, as megakd.config.parse_override reads it


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse with `key=value` overrides accepted anywhere on the line.

    argparse stops filling a `nargs="*"` positional at the first option, so in
    `pretrain -c X a=1 --resume auto b=2` the `b=2` would be "unrecognized". Leftover overrides are
    appended, in order, to the command's override list; anything else left over is an error.
    """
    args, extra = parser.parse_known_args(argv)
    overrides = [a for a in extra if _OVERRIDE.match(a)]
    unknown = [a for a in extra if not _OVERRIDE.match(a)]
    target = "rest" if hasattr(args, "rest") else "overrides"
    if overrides and not hasattr(args, target):
        unknown = extra
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if overrides:
        setattr(args, target, [*getattr(args, target), *overrides])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    setup_logging(args.log_level)
    try:
        return args.func(args)
    except (UserError, *_INPUT_OS_ERRORS) as err:
        # Bad input: one line naming the file or key, exit 2. Any other exception is a bug and
        # keeps its traceback; --log-level DEBUG keeps it here too.
        if args.log_level == "DEBUG":
            raise
        print(f"megakd: error: {_one_line(err)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        # A second Ctrl-C during training (the first one asks for a checkpoint), or one before
        # training started.
        print("megakd: interrupted: stopped at once, nothing saved since the last checkpoint", file=sys.stderr)
        return EXIT_INTERRUPTED


def console() -> None:
    """The `megakd` executable (and `python -m megakd.cli`, as the launchers run it): `main`, then
    `exit_process`, which leaves a distributed run without the abort at interpreter teardown."""
    code = main()
    if "megakd.engine.backends" not in sys.modules:  # nothing could have created a process group
        sys.exit(code)
    from megakd.engine.backends import exit_process

    exit_process(code)


if __name__ == "__main__":
    console()
