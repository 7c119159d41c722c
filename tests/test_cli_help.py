"""The command line helps by itself: examples that run, recipes listed, options where users type them."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import pytest
import yaml

from megakd.cli import build_parser, main, parse_args
from megakd.config import Config, ConfigError, load_config
from megakd.configio import config_to_dict
from megakd.finetune.config import FinetuneConfig
from megakd.glue.config import GlueConfig
from megakd.store.rundir import flatten

REPO = Path(__file__).parents[1]
SHELL_OPERATORS = {">", "|", "&&", ";"}


def _parsers(parser: argparse.ArgumentParser, name: str = "megakd"):
    """(command line, parser) of the program and of every (sub)command."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


PARSERS = dict(_parsers(build_parser()))


def _example_lines(parser: argparse.ArgumentParser) -> list[str]:
    lines = (parser.epilog or "").splitlines()
    return [line.strip() for line in lines if line.startswith(("  megakd ", "  launch/"))]


def _argv(line: str) -> list[str]:
    """The megakd arguments of an example line: without a launcher prefix, a comment, a redirect or a pipe."""
    words = shlex.split(line, comments=True)
    cut = next((i for i, w in enumerate(words) if w in SHELL_OPERATORS), len(words))
    words = words[:cut]
    if words[0] == "megakd":
        return words[1:]
    assert words[0] == "launch/torchrun.sh" and words[1].isdigit(), line
    assert (REPO / words[0]).is_file()
    return words[2:] if not words[2].startswith("-") else ["pretrain", *words[2:]]


EXAMPLES = sorted({line for parser in PARSERS.values() for line in _example_lines(parser)})


@pytest.mark.parametrize("command", PARSERS)
def test_every_help_ends_with_two_or_three_examples(command):
    parser = PARSERS[command]
    lines = _example_lines(parser)
    assert 2 <= len(lines) <= 3, (command, parser.epilog)
    assert parser.formatter_class is not argparse.HelpFormatter  # keeps the example lines as written
    assert parser.format_help().rstrip().endswith((lines[-1], parser.epilog.splitlines()[-1]))


@pytest.mark.parametrize("line", EXAMPLES)
def test_examples_parse_and_name_recipes_that_load(line):
    """Each example is a real command line: it parses, its repository paths exist, its config loads."""
    args = parse_args(build_parser(), _argv(line))
    for word in shlex.split(line, comments=True):
        if word.startswith(("configs/", "megakd/", "launch/")):
            assert (REPO / word).exists(), (line, word)
    recipe = getattr(args, "config", None)
    if recipe:
        cls = {"finetune": FinetuneConfig, "glue": GlueConfig}.get(args.command, Config)
        overrides = getattr(args, "overrides", None) or getattr(args, "rest", [])
        load_config(REPO / recipe, [*overrides, *getattr(args, "set_overrides", [])], cls=cls)


@pytest.mark.parametrize("argv, level", [
    (["pretrain", "-c", "X", "--log-level", "DEBUG"], "DEBUG"),
    (["--log-level", "WARNING", "finetune", "-c", "X"], "WARNING"),
    (["data", "shards", "--input", "f", "--tokenizer", "t", "--seq-len", "8", "--out", "o",
      "--log-level", "ERROR"], "ERROR"),
    (["config", "recipes"], "INFO"),
])
def test_log_level_is_accepted_before_or_after_the_command(argv, level):
    assert parse_args(build_parser(), argv).log_level == level


def test_log_level_after_the_command_takes_effect(tmp_path):
    """DEBUG keeps the traceback of an input error instead of the one-line message."""
    argv = ["pretrain", "-c", "configs/electra-tiny.yaml", f"run.dir={tmp_path}", "train.max_stpes=3"]
    assert main(argv) == 2
    with pytest.raises(ConfigError, match="train.max_stpes"):
        main([*argv, "--log-level", "DEBUG"])


def test_finetune_print_config_prints_the_resolved_config_and_writes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["finetune", "-c", "configs/finetune-rt.yaml", "--print-config", f"run.dir={run}",
                 "finetune.seeds=[4,5]"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["finetune"]["seeds"] == [4, 5] and printed["backend"]["name"] == "single"  # auto, resolved
    overrides = [f"{k}={json.dumps(v)}" for k, v in flatten(printed).items()]
    reloaded = load_config(None, overrides, cls=FinetuneConfig)
    assert flatten(config_to_dict(reloaded)) == flatten(printed)
    assert not run.exists()


def test_option_help_shows_values_instead_of_pointing_elsewhere():
    for command in ("megakd pretrain", "megakd distill"):
        assert "--resume {auto,PATH}" in PARSERS[command].format_usage()
    bench = " ".join(PARSERS["megakd bench"].format_help().split())
    assert "a comma list of collectives, matmul, loader, train (default: collectives,matmul,loader,train)" \
        in bench
    assert "electra_mini_step=0.37" in " ".join(PARSERS["megakd repro"].format_help().split())
    pointing = [(command, action.dest) for command, parser in PARSERS.items() for action in parser._actions
                if "README" in (action.help or "")]
    assert not pointing


def test_recipes_lists_every_config_with_its_command_and_a_description(capsys):
    assert main(["config", "recipes"]) == 0
    rows = {line.split()[0]: line.split(None, 2)[1:] for line in capsys.readouterr().out.splitlines()}
    paths = sorted(f"configs/{p.name}" for p in (REPO / "configs").glob("*.yaml"))
    assert sorted(rows) == paths
    demo = "The CPU demo: a small ELECTRA on the bundled Austen + KJV corpus."
    assert rows["configs/electra-tiny.yaml"] == ["pretrain", demo]
    assert rows["configs/dwt-weak.yaml"][0] == "distill" and rows["configs/finetune-rt.yaml"][0] == "finetune"
    for path, (command, description) in rows.items():
        assert len(description) > 10, path
        load_config(REPO / path, cls={"finetune": FinetuneConfig, "glue": GlueConfig}.get(command, Config))  # validates


def test_a_reader_that_stops_early_ends_the_output_without_a_traceback():
    """`megakd config keys | head -1`: the closed pipe ends the listing quietly, exit 0."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "megakd.cli", "config", "keys"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO)
    first = proc.stdout.readline()
    proc.stdout.close()  # the reader goes away after one line, as `head -1` does
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0 and first, stderr
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr
