"""`megakd glue`: a model over the GLUE tasks, as the papers report it."""

from __future__ import annotations

import argparse

from megakd.cli.common import _Command, _examples, log, print_config, recipe_arguments, stop_exit
from megakd.config import load_config


def cmd_glue(args: argparse.Namespace) -> int:
    """A model over the GLUE tasks (megakd/glue/run.py); exit codes as for `megakd finetune`."""
    from megakd.glue.config import GlueConfig

    cfg = load_config(args.config, args.overrides, cls=GlueConfig)
    if args.print_config:
        print_config(cfg.finish(args.launch))
        return 0
    from megakd.glue.run import glue

    # the data is checked before run.dir is touched
    stopped = stop_exit(glue(cfg, resume=args.resume, launch=args.launch))
    if stopped is not None:
        return stopped
    log.info("GLUE finished; results in %s/results.json and results.md", cfg.run.dir)
    return 0


def add_glue(sub, command: _Command) -> None:
    p = command(sub, "glue", "GLUE as the papers report it: the benchmark's files, its metrics, seeds' medians, "
                "the test-set submission", _examples(
                    "megakd glue -c configs/glue.yaml model.path=runs/electra-tiny/hf/discriminator "
                    "glue.data_dir=glue_data glue.tasks=[cola,sst2,mrpc,stsb]",
                    "launch/torchrun.sh 8 glue -c configs/glue.yaml model.path=hf-base/discriminator "
                    "glue.data_dir=glue_data  # electra-base after megakd convert to-hf runs/electra-base hf-base",
                    note="docs/glue.md: GLUE on an offline cluster, the protocol, the submission; "
                         "tools/make_glue_data.py writes small stand-in GLUE files for a CPU run."))
    recipe_arguments(p, "configs/glue.yaml", "glue.tasks=[cola,rte]", choices=["auto"],
                     help="'auto': reuse finished tasks and seeds in run.dir and continue the unfinished seed from "
                          "its newest intact checkpoint")
    p.set_defaults(func=cmd_glue)
