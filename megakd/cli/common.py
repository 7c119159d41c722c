"""What the command modules share (the log, the exit code of an interrupt, epilogs, the recipe arguments,
table output, `--print-config`), apart from megakd.cli itself, which imports every command module."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from megakd.configio import config_to_dict

log = logging.getLogger("megakd")


EXIT_INTERRUPTED = 130  # 128 + SIGINT


def stop_exit(outcome) -> int | None:
    """The exit code of a run a stop signal ended after its checkpoint (`megakd.engine.run.Outcome`): 0 for
    SIGTERM/SIGUSR1 (a scheduler requeues the job), 130 for SIGINT (a script or loop around the command
    stops too); None when the run finished."""
    if not outcome.stopped:
        return None
    at = f" (step {outcome.step})" if outcome.step is not None else ""
    log.warning("stopped on a signal after a checkpoint%s; run the same command with --resume auto to continue", at)
    return EXIT_INTERRUPTED if outcome.interrupted else 0


def print_config(cfg: object) -> None:
    """`--print-config`: the config as the command would run it, as YAML a recipe can hold."""
    import yaml

    emit(yaml.safe_dump(config_to_dict(cfg), sort_keys=False).rstrip())


def emit(text: str) -> None:
    """The CLI's table output (bench, plan, config): plain stdout, so it can be piped or saved.

    A reader that stops early (`| head`) closes the pipe: that ends the output, not with a traceback.
    """
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Point stdout at devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Epilog examples keep their lines; an option's default is shown unless empty or its help says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        empty = action.default in (None, [], argparse.SUPPRESS) or action.default is False  # 0 is a value
        if not action.option_strings or empty or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def _examples(*lines: str, note: str = "") -> str:
    """An epilog: example command lines (a trailing `  # ...` says what one does), then a note."""
    return "\n".join(["examples:", *(f"  {line}" for line in lines), *(["", note] if note else [])])


# build_parser's command(parent, name, help_text, epilog): a sub-command parser with the common options.
_Command = Callable[..., argparse.ArgumentParser]
_RECIPES_NOTE = "Recipes: `megakd config recipes`; config keys: `megakd config keys PATTERN`."


def recipe_arguments(p: argparse.ArgumentParser, recipe: str, override: str, *, allow_change: bool = False,
                     **resume) -> None:
    """The arguments of the commands that run a recipe (pretrain, distill, finetune, glue): `resume` is how
    the command reads --resume; `allow_change` adds pretraining's --allow-change."""
    p.add_argument("-c", "--config", required=True, help=f"YAML recipe, e.g. {recipe}")
    p.add_argument("--resume", **resume)
    if allow_change:
        p.add_argument("--allow-change", action="append", default=[], metavar="KEY",
                       help="at resume, let this state-bearing config key differ from the checkpoint's and take "
                            "effect (repeatable), e.g. --allow-change optim.discriminator.lr")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("overrides", nargs="*", help=f"key=value overrides, e.g. {override}")
