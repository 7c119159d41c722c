"""`megakd pretrain` and `megakd distill`: one training entry each, the same arguments and run report."""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path

from megakd.cli.common import (
    _RECIPES_NOTE,
    EXIT_INTERRUPTED,
    _Command,
    _examples,
    log,
    print_config,
    recipe_arguments,
    stop_exit,
)
from megakd.config import load_config


def cmd_pretrain(args: argparse.Namespace) -> int:
    return _train(args, distill=False)


def cmd_distill(args: argparse.Namespace) -> int:
    return _train(args, distill=True)


def _train(args: argparse.Namespace, distill: bool) -> int:
    """Pretrain (or distill) in the run shell, then (rank 0, unless stopped early) export the newest checkpoint
    to run.dir/hf. `--print-config` prints the finished config without importing the engine.

    Exit 0 when finished or stopped by SIGTERM/SIGUSR1, 130 when stopped by SIGINT (`stop_exit`); either way
    the checkpoint of the last step was written."""
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        from megakd.finish import finish_config

        print_config(finish_config(cfg, launch=args.launch))
        return 0
    from megakd.engine.pretrain import run_distill, run_pretraining

    started = time.monotonic()
    export = None
    if cfg.run.export_hf:  # written by rank 0 once the run finished, under its lock (`RunSession.export`)
        from megakd.convert import export_run

        export = export_run
    outcome = (run_distill if distill else run_pretraining)(cfg, resume=args.resume,
                                                           allow_change=tuple(args.allow_change), export=export,
                                                           launch=args.launch)
    stopped = stop_exit(outcome)
    if stopped is not None:
        return stopped
    run_dir = Path(cfg.run.dir)
    if outcome.export_stopped_by is not None:
        log.warning("stopped by %s during the HuggingFace export: nothing was exported (the partial export was "
                    "removed; the checkpoint of step %d is intact); run the same command with --resume auto, or "
                    "megakd convert to-hf %s %s/hf --force", signal.Signals(outcome.export_stopped_by).name,
                    outcome.step, run_dir, run_dir)
        return EXIT_INTERRUPTED if outcome.export_stopped_by == signal.SIGINT else 0
    if outcome.exported is not None:
        log.info("exported HuggingFace model to %s", outcome.exported)
    log.info("finished %d steps; run directory %s", outcome.step, run_dir)
    metrics = run_dir / "metrics.jsonl"
    if args.launch.rank == 0 and metrics.is_file():  # rank 0 writes the metrics
        from megakd.engine.runlog import summarize_run

        log.info("%s", run_report(summarize_run(metrics), run_dir, time.monotonic() - started, outcome.exported))
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


def add_pretrain(sub, command: _Command) -> None:
    p = command(sub, "pretrain", "ELECTRA (DecoupledOptim or original) or BERT-MLM pretraining", _examples(
        "megakd pretrain -c configs/electra-tiny.yaml train.max_steps=100 run.dir=runs/quick",
        "megakd pretrain -c configs/electra-tiny.yaml --resume auto  # continue from the newest checkpoint",
        "launch/torchrun.sh 2 pretrain -c configs/electra-mini-long.yaml  # two data-parallel ranks",
        note=_RECIPES_NOTE))
    _training_arguments(p, "configs/electra-tiny.yaml", "train.max_steps=100")
    p.set_defaults(func=cmd_pretrain)


def add_distill(sub, command: _Command) -> None:
    p = command(sub, "distill", "DWT: pretraining with a frozen teacher MLM (distill.teacher) on the "
                "student's MLM loss", _examples(
                    "megakd pretrain -c configs/dwt-tiny.yaml model.generator.num_layers=2 "
                    "run.dir=runs/dwt-teacher-2l",
                    "megakd distill -c configs/dwt-tiny.yaml distill.teacher=runs/dwt-teacher-2l",
                    "megakd distill -c configs/dwt-weak.yaml  # teacher: runs/bert-mini (bert-mini.yaml)",
                    note=_RECIPES_NOTE))
    _training_arguments(p, "configs/dwt-weak.yaml", "distill.teacher=runs/teacher")
    p.set_defaults(func=cmd_distill)


def _training_arguments(p: argparse.ArgumentParser, recipe: str, override: str) -> None:
    """The arguments pretrain and distill share."""
    recipe_arguments(p, recipe, override, allow_change=True, metavar="{auto,PATH}",
                     help="'auto' (newest intact checkpoint in run.dir, if any) or a checkpoint directory")
