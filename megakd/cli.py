"""`megakd <command>`: the single entry point (pretrain, data, and the commands built on them).

Each command is a small function that parses its arguments and calls the library; errors in
user input (config keys, files) end the process with a one-line message and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import inspect
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from megakd.config import Config, ConfigError, load_config
from megakd.configio import (
    KeyDoc,
    config_key,
    config_keys,
    config_sections,
    config_to_dict,
    read_recipe,
    value_text,
)
from megakd.errors import LaunchError, UserError, redact
from megakd.repro import FINDINGS

log = logging.getLogger("megakd")


def _rank() -> int:
    """This process's rank under a launcher (torchrun, deepspeed: RANK; srun: SLURM_PROCID); 0 alone."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def setup_logging(level: str = "INFO") -> None:
    """One log format for every process; non-zero ranks only log warnings and errors."""
    rank = _rank()
    logging.basicConfig(
        level=getattr(logging, level) if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("matplotlib", "PIL", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_redacting)


def _redacting(record: logging.LogRecord) -> bool:
    """A log filter: a line never shows a URL's credentials (configs and storage errors are logged)."""
    message = record.getMessage()
    if (clean := redact(message)) != message:
        record.msg, record.args = clean, ()
    return True


def cmd_pretrain(args: argparse.Namespace) -> int:
    return _train(args, "run_pretraining")


def cmd_distill(args: argparse.Namespace) -> int:
    return _train(args, "run_distill")


def _train(args: argparse.Namespace, entry: str) -> int:
    """Train with `megakd.engine.pretrain.<entry>`, then (rank 0, unless stopped early) export the newest
    checkpoint to run.dir/hf. `--print-config` prints the finished config without importing the engine.

    Exit 0 when finished or stopped by SIGTERM/SIGUSR1 (preemption: a scheduler requeues the
    job); 130 (128 + SIGINT, the shell's code for Ctrl-C) when stopped by SIGINT, so a script or
    loop around the command stops too. Either way the checkpoint of the last step was written."""
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        from megakd.finish import finish_config

        print_config(finish_config(cfg))
        return 0
    from megakd.engine import pretrain

    run = getattr(pretrain, entry)
    started = time.monotonic()
    export = None
    if cfg.run.export_hf:  # written by rank 0 once the run finished, under its lock (`RunSession.export`)
        from megakd.convert import export_run

        export = export_run
    result = run(cfg, resume=args.resume, allow_change=tuple(args.allow_change), export=export)
    if result.preempted:
        log.warning("stopped at step %d; run the same command with --resume auto to continue", result.step)
        return EXIT_INTERRUPTED if result.interrupted else 0
    if result.export_stopped_by is not None:
        log.warning("stopped by %s during the HuggingFace export: nothing was exported (the partial export was "
                    "removed; the checkpoint of step %d is intact); run the same command with --resume auto, or "
                    "megakd convert to-hf %s %s/hf --force", signal.Signals(result.export_stopped_by).name,
                    result.step, result.run_dir, result.run_dir)
        return EXIT_INTERRUPTED if result.export_stopped_by == signal.SIGINT else 0
    if result.exported is not None:
        log.info("exported HuggingFace model to %s", result.exported)
    log.info("finished %d steps; run directory %s", result.step, result.run_dir)
    metrics = Path(result.run_dir) / "metrics.jsonl"
    if _rank() == 0 and metrics.is_file():  # rank 0 writes the metrics
        from megakd.engine.runlog import summarize_run

        log.info("%s", run_report(summarize_run(metrics), result.run_dir, time.monotonic() - started,
                                  result.exported))
    return 0


def run_report(summary: dict, run_dir: Path, seconds: float, exported: Path | None) -> str:
    """The end of every pretraining command: what the run learned, in the figures the README quotes."""
    minutes, secs = divmod(round(seconds), 60)
    lines = [f"summary of {run_dir}: step {summary['last_step']}, {minutes} min {secs} s in this command"]
    if summary["tail"]:
        first, last, rows = summary["tail_steps"]
        lines.append(f"  last 10 % of logged steps ({rows} lines, steps {first}-{last}): "
                     + ", ".join(f"{k} {v:.3f}" for k, v in summary["tail"].items()))
    if summary["best_val"]:
        lines.append("  best validation: " + ", ".join(f"{k} {v:.3f} (step {step})"
                                                        for k, (v, step) in summary["best_val"].items()))
    if summary["probe"]:
        (last, at), (best, best_at) = summary["probe"]["last"], summary["probe"]["best"]
        lines.append(f"  probe: accuracy {last:.3f} at step {at} (best {best:.3f} at step {best_at})")
    lines.append(f"  HuggingFace export: {exported}" if exported is not None
                 else "  HuggingFace export: none (run.export_hf=false); megakd convert to-hf makes one")
    lines.append(f"  metrics: {run_dir}/metrics.jsonl, plots: {run_dir}/plots/")
    return "\n".join(lines)


def cmd_finetune(args: argparse.Namespace) -> int:
    """Fine-tune on the configured backend; exit codes as for pretraining (0 also when stopped by
    SIGTERM/SIGUSR1 after a checkpoint, 130 on SIGINT, 2 after too many non-finite steps)."""
    from megakd.finetune.config import FinetuneConfig

    cfg = load_config(args.config, args.overrides, cls=FinetuneConfig)
    if args.print_config:  # without importing the engine, as for pretraining
        from megakd.finish import finish_backend

        finish_backend(cfg.backend)
        print_config(cfg)
        return 0
    from megakd.finetune.jobs import job_for
    from megakd.finetune.runtime import Runtime, describe

    run = job_for(cfg)

    def fine_tune(runtime) -> None:
        log.info("fine-tuning on %s", describe(runtime))
        summary = run(cfg, runtime)
        if runtime.is_main and summary.get("headline") in summary.get("metrics", {}):
            from megakd.finetune.baselines import baseline_report

            log.info("%s", baseline_report(cfg, summary))

    stopped = _in_runtime(Runtime(cfg, resume=args.resume), fine_tune)
    if stopped is not None:
        return stopped
    log.info("fine-tuning finished; summary in %s/summary.json", cfg.run.dir)
    return 0


def _in_runtime(runtime, body) -> int | None:
    """Open `runtime` and run `body(runtime)`, closing it however that ends: None when it finished, or
    the exit code of a stop signal after a checkpoint (0, or 130 for SIGINT)."""
    from megakd.finetune.runtime import Stopped

    try:
        runtime.open()
        body(runtime)
    except Stopped as stop:
        log.warning("stopped on a signal after a checkpoint; run the same command with --resume auto to continue")
        return EXIT_INTERRUPTED if stop.interrupted else 0
    finally:
        runtime.close()
    return None


def cmd_glue(args: argparse.Namespace) -> int:
    """A model over the GLUE tasks (megakd/glue/run.py); exit codes as for `megakd finetune`."""
    from megakd.glue.config import GlueConfig

    cfg = load_config(args.config, args.overrides, cls=GlueConfig)
    if args.print_config:
        print_config(cfg)
        return 0
    from megakd.finetune.runtime import Runtime, describe
    from megakd.glue.run import RESUMABLE_CHANGES, check_data, run_glue

    check_data(cfg)  # a missing split stops here, before run.dir is touched
    def glue(runtime) -> None:
        log.info("GLUE on %s", describe(runtime))
        run_glue(cfg, runtime)

    stopped = _in_runtime(Runtime(cfg, resume=args.resume, steering=RESUMABLE_CHANGES), glue)
    if stopped is not None:
        return stopped
    log.info("GLUE finished; results in %s/results.json and results.md", cfg.run.dir)
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
    if args.calibrate and not args.plan:
        raise UserError("--calibrate: times this machine for --plan; add --plan")
    if args.plan:
        if args.calibrate:
            costs = costs.calibrated(Path(args.work))
            print(f"calibrated on this machine: one configs/electra-mini.yaml step on one thread took "
                  f"{costs.electra_mini_step:.3g} s; every unit scaled by the same ratio")
        plan = plan_findings(names, args.work, quick=args.quick, seeds=seeds, recipe=args.recipe,
                             workers=args.jobs, costs=costs)
        print(plan.table(names, costs))
        from megakd.repro.report import staleness

        stale = staleness(args.out)
        if stale:
            print(f"\n{args.out}, section by section:\n" + "\n".join(f"  {line}" for line in stale))
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

    from megakd.data.shards import in_valid_split, write_shards
    from megakd.data.storage import ShardStore
    from megakd.data.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(args.tokenizer)
    options = {"samples_per_shard": args.samples_per_shard, "num_workers": args.workers,
               "min_tokens": args.min_tokens, "pack": args.pack, "shuffle": args.shuffle}
    fraction = args.valid_fraction
    if fraction and not 0.0 < fraction < 1.0:
        raise ConfigError(f"--valid-fraction: expected a fraction in (0, 1), got {fraction}")
    in_valid = functools.partial(in_valid_split, fraction=fraction)
    keep_train = (lambda text: not in_valid(text)) if fraction else None
    manifest = write_shards(args.input, tokenizer, args.seq_len, args.out, keep=keep_train, **options)
    log.info("%d samples in %d shards in %s", manifest["num_samples"], len(manifest["shards"]), args.out)
    if fraction:
        valid = ShardStore(args.out).url("valid")
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


def print_config(cfg: object) -> None:
    """`--print-config`: the config as the command would run it, as YAML a recipe can hold."""
    import yaml

    emit(yaml.safe_dump(config_to_dict(cfg), sort_keys=False).rstrip())


def _config_trees(args: argparse.Namespace) -> list[tuple[str, type]]:
    """(title, root dataclass) of the config trees `megakd config keys` describes, as its flags select."""
    from megakd.finetune.config import FinetuneConfig
    from megakd.glue.config import GlueConfig

    trees = [("megakd pretrain and megakd distill", Config), ("megakd finetune", FinetuneConfig),
             ("megakd glue", GlueConfig)]
    return trees[:1] if args.pretrain else trees[1:2] if args.finetune else trees[2:] if args.glue else trees


def _matches(pattern: str | None, key: str) -> bool:
    """A glob (any of *?[) matches the whole key; a plain pattern where a word of the key starts (`lr` finds
    `finetune.lr_select_frac` and `soteacher.lambda_lr`, not `labelreg.*`)."""
    if pattern is None:
        return True
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(key, pattern)
    return re.search(rf"(^|[._]){re.escape(pattern)}", key) is not None


def cmd_config_keys(args: argparse.Namespace) -> int:
    trees = [(title, cls, [k for k in config_keys(cls) if _matches(args.pattern, k.key)])
             for title, cls in _config_trees(args)]
    if not any(keys for _, _, keys in trees):
        raise UserError(f"no config key matches {args.pattern!r} (a glob like 'optim.*.lr', or a word of a "
                        "key)")
    if args.markdown:
        emit(reference_markdown(trees))
        return 0
    blocks = []
    for title, cls, keys in trees:
        if keys:
            rows = [(k.key, k.type, value_text(k.default), k.meaning) for k in keys]
            widths = [max(len(row[i]) for row in rows) for i in range(3)]
            header = f"{title} ({cls.__module__}.{cls.__name__}): key, type, default, meaning"
            lines = ["  ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[3]]) for row in rows]
            blocks.append("\n".join([header, *lines]))
    emit("\n\n".join(blocks))
    return 0


def reference_markdown(trees: list[tuple[str, type, list[KeyDoc]]]) -> str:
    """docs/configuration.md: per tree, each section's description and a table of its own keys."""
    root = Path(__file__).parents[1]
    sources = sorted({str(Path(inspect.getsourcefile(type(obj))).relative_to(root))
                      for _, cls, _ in trees for obj in _dataclasses_in(cls())})
    lines = ["# Configuration reference", "",
             "Every key of the two config trees: its type, its default and what it means. A recipe sets "
             "keys as nested YAML sections (`inherit: other.yaml` starts from another recipe); the command "
             "line takes `key=value` after the command, e.g. `megakd pretrain -c configs/electra-tiny.yaml "
             "train.max_steps=100`. `megakd config keys PATTERN` prints the same in the terminal; "
             "`--print-config` prints a recipe's every value.", "",
             "Generated by `megakd config keys --markdown > docs/configuration.md` from the comments above "
             f"and beside the fields in {', '.join(sources)}: edit those, then regenerate "
             "(tests/test_config_reference.py fails while this file is stale)."]
    for title, cls, keys in trees:
        lines += ["", f"## {title}", "", f"`{cls.__module__}.{cls.__name__}`"]
        for section, doc in config_sections(cls).items():
            own = [k for k in keys if k.key.rpartition(".")[0] == section]
            if not own:
                continue
            lines += ["", f"{'#' * (3 + section.count('.'))} `{section}`", ""]
            lines += [_markdown_text(doc), ""] if doc else []
            lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
            lines += [f"| `{k.key}` | `{_cell(k.type)}` | `{_cell(value_text(k.default))}` | "
                      f"{_cell(_markdown_text(k.meaning))} |" for k in own]
    return "\n".join(lines)


def _dataclasses_in(obj):
    """`obj` and every config section below it."""
    yield obj
    for f in dataclasses.fields(obj):
        if dataclasses.is_dataclass(getattr(obj, f.name)):
            yield from _dataclasses_in(getattr(obj, f.name))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _markdown_text(text: str) -> str:
    """A comment as Markdown text: outside `code`, < and > would read as HTML tags."""
    parts = text.split("`")
    return "`".join(part if i % 2 else part.replace("<", "&lt;").replace(">", "&gt;")
                    for i, part in enumerate(parts))


def recipe_summary(path: Path) -> tuple[str, str]:
    """(the command that runs the recipe, its description): the first sentence of its opening comment, with
    parenthesised asides dropped, cut at the first colon when that sentence is long."""
    data = read_recipe(path)
    if "glue" in data:
        command = "glue"
    elif set(data) - {config_key(f.name) for f in dataclasses.fields(Config)}:  # sections only fine-tuning has
        command = "finetune"
    else:
        command = "distill" if (data.get("distill") or {}).get("teacher") else "pretrain"
    header = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#") or line.startswith("#  ") or not line.strip("# "):
            break
        header.append(line.lstrip("#").strip())
    text = " ".join(header)
    while (shorter := re.sub(r"\s*\([^()]*\)", "", text)) != text:
        text = shorter
    sentence = re.split(r"(?<=\.)\s", text, maxsplit=1)[0]
    if len(sentence) > 100 and ": " in sentence:
        sentence = sentence.split(": ", 1)[0]
    return command, sentence.rstrip(":;,")


def cmd_config_recipes(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    paths = sorted(directory.glob("*.yaml"))
    if not paths:
        raise UserError(f"{directory}: no recipes (*.yaml) there")
    rows = [(str(_relative(p.absolute())), *recipe_summary(p)) for p in paths]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    emit("\n".join(f"{path:<{widths[0]}}  {command:<{widths[1]}}  {text}" for path, command, text in rows))
    return 0


def _relative(path: Path) -> Path:
    """`path` from the current directory when it is below it (configs/x.yaml in the repository)."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def emit(text: str) -> None:
    """The CLI's table output (bench, plan, config): plain stdout, so it can be piped or saved.

    A reader that stops early (`| head`) closes the pipe: that ends the output, not with a traceback.
    """
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Point stdout at devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


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


def cmd_doctor(args: argparse.Namespace) -> int:
    """Exit 0 when megakd's own requirements are met (GPU, NCCL and extras are reported, not required), else 1."""
    from megakd.bench.doctor import doctor_report

    text, base_ok = doctor_report()
    emit(text)
    return 0 if base_ok else 1


BENCH_PARTS = ("collectives", "matmul", "loader", "train")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
RECIPES = Path(__file__).parents[1] / "configs"  # in the source tree, as megakd/repro/runs.py finds it


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Epilog examples keep their lines; an option's default is shown unless empty or its help says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        empty = action.default in (None, [], argparse.SUPPRESS) or action.default is False  # 0 is a value
        if not action.option_strings or empty or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


class ReproHelpFormatter(HelpFormatter):
    """`megakd repro --help` shows the cost model's defaults, imported only then: megakd.repro.runs loads the
    engine, which no other command line needs for parsing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = super()._get_help_string(action)
        if action.dest != "unit_seconds":
            return text
        from megakd.repro.runs import Costs

        defaults = ", ".join(f"{f.name}={f.default:g}" for f in dataclasses.fields(Costs))
        return f"{text} (default: {defaults})"


def _examples(*lines: str, note: str = "") -> str:
    """An epilog: example command lines (a trailing `  # ...` says what one does), then a note."""
    return "\n".join(["examples:", *(f"  {line}" for line in lines), *(["", note] if note else [])])


# build_parser's command(parent, name, help_text, epilog): a sub-command parser with the common options.
_Command = Callable[..., argparse.ArgumentParser]
_RECIPES_NOTE = "Recipes: `megakd config recipes`; config keys: `megakd config keys PATTERN`."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megakd", description=__doc__.splitlines()[0], formatter_class=HelpFormatter,
        epilog=_examples("megakd pretrain -c configs/electra-tiny.yaml  # the CPU demo: minutes on 2 cores",
                         "megakd finetune -c configs/finetune-rt.yaml  # its discriminator on RT sentiment",
                         "megakd config recipes  # every recipe in configs/, one line each",
                         note="`megakd COMMAND --help` shows a command's options and examples; "
                              "`megakd config keys` every config key."))
    parser.add_argument("--version", action="version", version=f"megakd {_version()}")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS,
                        help="also accepted after the command")
    # The same option after the command; SUPPRESS keeps the value given before it when it is absent.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS,
                        help="DEBUG also keeps the traceback of an input error (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(parent, name: str, help_text: str, epilog: str, formatter: type = HelpFormatter):
        return parent.add_parser(name, help=help_text, description=help_text, epilog=epilog, parents=[common],
                                 formatter_class=formatter)

    # One function per command, in the order `megakd --help` lists them.
    for add in (_add_pretrain, _add_finetune, _add_glue, _add_distill, _add_eval_rtd, _add_repro, _add_data,
                _add_convert, _add_bench, _add_plan, _add_doctor, _add_config):
        add(sub, command)
    return parser


def _add_pretrain(sub, command: _Command) -> None:
    p = command(sub, "pretrain", "ELECTRA (DecoupledOptim or original) or BERT-MLM pretraining", _examples(
        "megakd pretrain -c configs/electra-tiny.yaml train.max_steps=100 run.dir=runs/quick",
        "megakd pretrain -c configs/electra-tiny.yaml --resume auto  # continue from the newest checkpoint",
        "launch/torchrun.sh 2 pretrain -c configs/electra-mini-long.yaml  # two data-parallel ranks",
        note=_RECIPES_NOTE))
    _training_arguments(p, "configs/electra-tiny.yaml", "train.max_steps=100")
    p.set_defaults(func=cmd_pretrain)


def _add_finetune(sub, command: _Command) -> None:
    p = command(sub, "finetune", "sequence (pair) classification/regression: fine-tuning, label "
                "regularisation, SoTeacher, TGT", _examples(
                    "megakd finetune -c configs/finetune-rt.yaml  # the discriminator of electra-tiny.yaml",
                    "megakd finetune -c configs/finetune-rt.yaml model.path=runs/electra-mini "
                    "finetune.seeds=[1,2,3]",
                    "launch/torchrun.sh 2 finetune -c configs/finetune-rt.yaml  # backend.name auto: ddp",
                    note=_RECIPES_NOTE))
    p.add_argument("-c", "--config", required=True, help="YAML recipe, e.g. configs/finetune-rt.yaml")
    p.add_argument("--resume", choices=["auto"], help="'auto': reuse finished seeds in run.dir and continue the "
                   "unfinished one from its newest intact checkpoint")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. finetune.seeds=[1,2,3]")
    p.set_defaults(func=cmd_finetune)


def _add_glue(sub, command: _Command) -> None:
    p = command(sub, "glue", "GLUE as the papers report it: the benchmark's files, its metrics, seeds' medians, "
                "the test-set submission", _examples(
                    "megakd glue -c configs/glue.yaml model.path=runs/electra-tiny/hf/discriminator "
                    "glue.data_dir=glue_data glue.tasks=[cola,sst2,mrpc,stsb]",
                    "launch/torchrun.sh 8 glue -c configs/glue.yaml model.path=hf-base/discriminator "
                    "glue.data_dir=glue_data  # electra-base after megakd convert to-hf runs/electra-base hf-base",
                    note="docs/glue.md: GLUE on an offline cluster, the protocol, the submission; "
                         "tools/make_glue_data.py writes small stand-in GLUE files for a CPU run."))
    p.add_argument("-c", "--config", required=True, help="YAML recipe, e.g. configs/glue.yaml")
    p.add_argument("--resume", choices=["auto"], help="'auto': reuse finished tasks and seeds in run.dir and "
                   "continue the unfinished seed from its newest intact checkpoint")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. glue.tasks=[cola,rte]")
    p.set_defaults(func=cmd_glue)


def _add_distill(sub, command: _Command) -> None:
    p = command(sub, "distill", "DWT: pretraining with a frozen teacher MLM (distill.teacher) on the "
                "student's MLM loss", _examples(
                    "megakd pretrain -c configs/dwt-tiny.yaml model.generator.num_layers=2 "
                    "run.dir=runs/dwt-teacher-2l",
                    "megakd distill -c configs/dwt-tiny.yaml distill.teacher=runs/dwt-teacher-2l",
                    "megakd distill -c configs/dwt-weak.yaml  # teacher: runs/bert-mini (bert-mini.yaml)",
                    note=_RECIPES_NOTE))
    _training_arguments(p, "configs/dwt-weak.yaml", "distill.teacher=runs/teacher")
    p.set_defaults(func=cmd_distill)


def _add_eval_rtd(sub, command: _Command) -> None:
    p = command(sub, "eval-rtd", "score discriminators against one fixed generator on fixed masked data (RTD "
                "accuracy, precision, recall, F1 as JSON)", _examples(
                    "megakd eval-rtd --generator runs/rtd-generator-tiny --discriminator runs/electra-tiny "
                    "--shards data/shards",
                    "megakd eval-rtd --generator runs/rtd-generator-tiny --discriminator runs/electra-tiny "
                    "runs/dwt-electra-tiny --shards data/shards --batches 200 --out rtd.json",
                    note="Every model trained on one tokenizer, e.g. with data.tokenizer=data/tok "
                         "data.shards=data/shards (`megakd data --help`)."))
    p.add_argument("--generator", required=True, help="run, checkpoint, megakd model dir or HF ELECTRA generator")
    p.add_argument("--discriminator", required=True, nargs="+", help="one or more runs, checkpoints, megakd model "
                   "dirs or HF ElectraForPreTraining dirs")
    p.add_argument("--shards", required=True,
                   help="shard directory (or s3://, gs://, http(s):// URL) from `megakd data shards`")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the generator's own)")
    p.add_argument("--batches", type=int, default=50, help="batches scored")
    p.add_argument("--batch-size", type=int, default=32, help="samples per batch")
    p.add_argument("--seed", type=int, default=0, help="fixes the masks and the generator's samples")
    p.add_argument("--mask-prob", type=float, default=0.15, help="fraction of tokens masked and resampled")
    p.add_argument("--out", help="also write the JSON report to this file")
    p.set_defaults(func=cmd_eval_rtd)


def _add_repro(sub, command: _Command) -> None:
    p = command(sub, "repro", "re-run one of the papers' findings at CPU scale and write its section of "
                "docs/REPRODUCTION.md (paper numbers, measured mean ± std over seeds, verdict)", _examples(
                    "megakd repro all --plan  # minutes per finding; runs nothing",
                    "megakd repro dwt --quick --out /tmp/REPRODUCTION.md  # tiny settings, in minutes",
                    "megakd repro lambda disc_lr --jobs 2"), ReproHelpFormatter)
    p.add_argument("name", nargs="+", choices=(*FINDINGS, "all"),
                   help="the findings to run together (jobs of different findings share the cores), or all")
    p.add_argument("--quick", action="store_true", help="small settings, for tests of the report's structure")
    p.add_argument("--seeds", type=int, nargs="+", help="override the finding's seeds")
    p.add_argument("--recipe", help="the pretraining recipe the finding trains from (default: the finding's own; "
                   "with several: replaces configs/electra-mini.yaml in disc_lr, soteacher and tgt)")
    p.add_argument("--out", default="docs/REPRODUCTION.md", help="the report (its other sections are kept)")
    p.add_argument("--work", default="runs/repro", help="scratch directory for the runs")
    p.add_argument("--jobs", type=int, default=2,
                   help="jobs at a time (default 2, for 2 cores): with more than one, each runs in a single-thread "
                   "process; 1 runs them one after the other in this process")
    p.add_argument("--plan", action="store_true",
                   help="print the estimated minutes per finding and in total, and run nothing")
    p.add_argument("--unit-seconds", nargs="+", metavar="NAME=SECONDS",
                   help="the plan's cost model: seconds per unit of work")
    p.add_argument("--calibrate", action="store_true",
                   help="with --plan: time a few training steps here (about 20 s) and plan with this machine's speed")
    p.set_defaults(func=cmd_repro)


def _add_data(sub, command: _Command) -> None:
    corpus = "megakd/data/corpus/austen.jsonl.gz megakd/data/corpus/kjv.jsonl.gz"
    data_examples = (f"megakd data tokenizer --input {corpus} --vocab-size 8000 --out data/tok",
                     f"megakd data shards --input {corpus} --tokenizer data/tok --seq-len 128 "
                     "--out data/shards --valid-fraction 0.01",
                     "megakd pretrain -c configs/electra-tiny.yaml data.tokenizer=data/tok "
                     "data.shards=data/shards")
    data = command(sub, "data", "tokenizer training and WebDataset shard writing", _examples(*data_examples))
    data_sub = data.add_subparsers(dest="data_command", required=True)
    t = command(data_sub, "tokenizer", "train a cased SentencePiece BPE tokenizer",
                _examples(*data_examples[::2]))
    t.add_argument("--input", nargs="+", required=True, help="text/.gz/.jsonl files or directories")
    t.add_argument("--vocab-size", type=int, required=True, help="pieces in the vocabulary")
    t.add_argument("--out", required=True, help="the tokenizer directory")
    t.add_argument("--input-sentence-size", type=int, default=2_000_000,
                   help="sentences sampled for training (bounds memory on large corpora)")
    t.add_argument("--seed", type=int, default=0, help="the sentence sample's seed")
    t.set_defaults(func=cmd_data_tokenizer)
    s = command(data_sub, "shards", "tokenize and pack documents into WebDataset shards",
                _examples(*data_examples[1:]))
    s.add_argument("--input", nargs="+", required=True, help="text/.gz/.jsonl files, directories or HF datasets")
    s.add_argument("--tokenizer", required=True,
                   help="a megakd tokenizer dir, or an HF tokenizer/model dir (WordPiece vocab.txt or tokenizer.json)")
    s.add_argument("--seq-len", type=int, required=True, help="tokens per sample")
    s.add_argument("--out", required=True,
                   help="the shard directory, or an s3:// or gs:// prefix (uploaded, manifest last)")
    s.add_argument("--samples-per-shard", type=int, default=10_000, help="samples in each shard file")
    s.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    s.add_argument("--valid-fraction", type=float, default=0.0,
                   help="hold out this fraction of documents (by a hash of their text) as OUT/valid/, "
                        "which pretraining finds by itself for train.eval_every")
    s.add_argument("--min-tokens", type=int, default=8, help="drop document pieces with fewer tokens")
    s.add_argument("--pack", action="store_true",
                   help="pack several short documents into one sample (per-document positions and attention)")
    s.add_argument("--shuffle", action="store_true",
                   help="write each shard's samples in a seeded random order (for data.read_block > 1)")
    s.set_defaults(func=cmd_data_shards)


def _add_convert(sub, command: _Command) -> None:
    convert_examples = ("megakd convert to-hf runs/electra-tiny runs/electra-tiny-hf  # OUT/discriminator, "
                        "OUT/generator",
                        "megakd convert from-hf runs/electra-tiny-hf/discriminator models/electra-tiny-disc",
                        "megakd finetune -c configs/finetune-rt.yaml model.path=models/electra-tiny-disc")
    conv = command(sub, "convert", "HuggingFace export/import", _examples(*convert_examples))
    conv_sub = conv.add_subparsers(dest="convert_command", required=True)
    for name, help_text, src_help, examples in (
        ("to-hf", "run/checkpoint/model dir -> HF dirs (ELECTRA: OUT/discriminator, OUT/generator)",
         "run directory (newest checkpoint), checkpoint directory or megakd model directory",
         ("megakd convert to-hf runs/electra-tiny runs/electra-tiny-hf",
          "megakd convert to-hf runs/electra-tiny/checkpoints/step_00000400 runs/step400-hf --force")),
        ("from-hf", "local HF BERT/ELECTRA dir -> megakd model directory", "local HF model directory",
         convert_examples[1:]),
    ):
        c = command(conv_sub, name, help_text, _examples(*examples))
        c.add_argument("src", help=src_help)
        c.add_argument("out", help="output directory (written atomically)")
        c.add_argument("--force", action="store_true", help="replace a non-empty OUT")
        c.set_defaults(func=cmd_convert)


def _add_bench(sub, command: _Command) -> None:
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


def _add_plan(sub, command: _Command) -> None:
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


def _add_doctor(sub, command: _Command) -> None:
    d = command(sub, "doctor", "what this machine has (torch, CUDA, NCCL, Triton, DeepSpeed, GPUs, launcher "
                "variables) against what megakd needs, and what will not work here", _examples(
                    "megakd doctor  # on a login node, then on a GPU node (srun megakd doctor)",
                    "megakd doctor > doctor.txt  # beside a bug report"))
    d.set_defaults(func=cmd_doctor)


def _add_config(sub, command: _Command) -> None:
    cf = command(sub, "config", "the config keys (types, defaults, meanings) and the recipes in configs/",
                 _examples("megakd config keys 'optim.*.lr'  # a glob on the whole key; or a word of the key",
                           "megakd config keys --finetune lr",
                           "megakd config recipes"))
    cf_sub = cf.add_subparsers(dest="config_command", required=True)
    k = command(cf_sub, "keys", "every config key with its type, default and meaning, read from the config "
                "dataclasses", _examples(
                    "megakd config keys backend",
                    "megakd config keys --pretrain 'model.discriminator.*'",
                    "megakd config keys --markdown > docs/configuration.md  # regenerate the reference"))
    k.add_argument("pattern", nargs="?",
                   help="a glob on the whole key (optim.*.lr), or a word the key has (lr, teacher)")
    tree = k.add_mutually_exclusive_group()
    tree.add_argument("--pretrain", action="store_true", help="only the keys of pretrain and distill")
    tree.add_argument("--finetune", action="store_true", help="only the keys of finetune")
    tree.add_argument("--glue", action="store_true", help="only the keys of glue")
    k.add_argument("--markdown", action="store_true", help="print the reference, docs/configuration.md")
    k.set_defaults(func=cmd_config_keys)
    r = command(cf_sub, "recipes", "the recipes in configs/: path, command and what each is for", _examples(
        "megakd config recipes",
        "megakd config recipes | grep finetune",
        "megakd pretrain -c configs/electra-mini.yaml --print-config  # a recipe's every value"))
    r.add_argument("dir", nargs="?", default=str(RECIPES), help="a directory of recipes (default: configs/)")
    r.set_defaults(func=cmd_config_recipes)



def _training_arguments(p: argparse.ArgumentParser, recipe: str, override: str) -> None:
    """The arguments pretrain and distill share."""
    p.add_argument("-c", "--config", required=True, help=f"YAML recipe, e.g. {recipe}")
    p.add_argument("--resume", metavar="{auto,PATH}",
                   help="'auto' (newest intact checkpoint in run.dir, if any) or a checkpoint directory")
    p.add_argument("--allow-change", action="append", default=[], metavar="KEY",
                   help="at resume, let this state-bearing config key differ from the checkpoint's and take "
                        "effect (repeatable), e.g. --allow-change optim.discriminator.lr")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("overrides", nargs="*", help=f"key=value overrides, e.g. {override}")


EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT

# Operating-system errors that mean bad input (a path that is missing, taken, of the wrong kind
# or not writable). Others (disk full, I/O errors) are not the user's input and keep their traceback.
_INPUT_OS_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


def _one_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.filename is not None:
        return redact(f"{err.filename}: {err.strerror.lower() if err.strerror else err}")
    return redact(" ".join(str(err).split()))


def _version() -> str:
    try:
        return version("megakd")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


_OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")  # key=value, as megakd.configio.parse_override reads it


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
        if not isinstance(err, LaunchError) or _rank() == 0:  # the same on every rank: said once
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
