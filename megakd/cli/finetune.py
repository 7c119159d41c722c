"""`megakd finetune`: sequence (pair) classification/regression on a pretrained model."""

from __future__ import annotations

import argparse

from megakd.cli.common import (
    _RECIPES_NOTE,
    _Command,
    _examples,
    log,
    print_config,
    recipe_arguments,
    stop_exit,
)
from megakd.config import load_config


def cmd_finetune(args: argparse.Namespace) -> int:
    """Fine-tune on the configured backend; exit codes as for pretraining (0 also when stopped by
    SIGTERM/SIGUSR1 after a checkpoint, 130 on SIGINT, 2 after too many non-finite steps)."""
    from megakd.finetune.config import FinetuneConfig

    cfg = load_config(args.config, args.overrides, cls=FinetuneConfig)
    if args.print_config:  # without importing the engine, as for pretraining
        print_config(cfg.finish(args.launch))
        return 0
    from megakd.finetune.jobs import finetune

    outcome = finetune(cfg, resume=args.resume, launch=args.launch)
    stopped = stop_exit(outcome)
    if stopped is not None:
        return stopped
    summary = outcome.summary
    if args.launch.rank == 0 and summary.get("headline") in summary.get("metrics", {}):
        from megakd.finetune.baselines import baseline_report

        log.info("%s", baseline_report(cfg, summary))
    log.info("fine-tuning finished; summary in %s/summary.json", cfg.run.dir)
    return 0


def add_finetune(sub, command: _Command) -> None:
    p = command(sub, "finetune", "sequence (pair) classification/regression: fine-tuning, label "
                "regularisation, SoTeacher, TGT", _examples(
                    "megakd finetune -c configs/finetune-rt.yaml  # the discriminator of electra-tiny.yaml",
                    "megakd finetune -c configs/finetune-rt.yaml model.path=runs/electra-mini "
                    "finetune.seeds=[1,2,3]",
                    "launch/torchrun.sh 2 finetune -c configs/finetune-rt.yaml  # backend.name auto: ddp",
                    note=_RECIPES_NOTE))
    recipe_arguments(p, "configs/finetune-rt.yaml", "finetune.seeds=[1,2,3]", choices=["auto"],
                     help="'auto': reuse finished seeds in run.dir and continue the unfinished one from its newest "
                          "intact checkpoint")
    p.set_defaults(func=cmd_finetune)
