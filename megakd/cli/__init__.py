"""`megakd <command>`: the single entry point (pretrain, data, and the commands built on them).

Each command is a small function that parses its arguments and calls the library; its module
(megakd/cli/<command>.py) holds both its arguments and that function. Errors in user input (config
keys, files) end the process with a one-line message and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from importlib.metadata import PackageNotFoundError, version

from megakd.cli.bench import add_bench
from megakd.cli.common import EXIT_INTERRUPTED, HelpFormatter, _examples
from megakd.cli.config import add_config
from megakd.cli.convert import add_convert
from megakd.cli.data import add_data
from megakd.cli.doctor import add_doctor
from megakd.cli.eval_rtd import add_eval_rtd
from megakd.cli.finetune import add_finetune
from megakd.cli.glue import add_glue
from megakd.cli.plan import add_plan
from megakd.cli.pretrain import add_distill, add_pretrain
from megakd.cli.repro import add_repro
from megakd.errors import LaunchError, UserError, redact
from megakd.launch import Launch


def setup_logging(level: str = "INFO", rank: int = 0) -> None:
    """One log format for every process; non-zero ranks only log warnings and errors."""
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


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


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
    for add in (add_pretrain, add_finetune, add_glue, add_distill, add_eval_rtd, add_repro, add_data,
                add_convert, add_bench, add_plan, add_doctor, add_config):
        add(sub, command)
    return parser


EXIT_USER_ERROR = 2


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
    args.launch = Launch.from_environ()  # the launch environment, read once: the handlers pass it on
    setup_logging(args.log_level, args.launch.rank)
    try:
        return args.func(args)
    except (UserError, *_INPUT_OS_ERRORS) as err:
        # Bad input: one line naming the file or key, exit 2. Any other exception is a bug and
        # keeps its traceback; --log-level DEBUG keeps it here too.
        if args.log_level == "DEBUG":
            raise
        if not isinstance(err, LaunchError) or args.launch.rank == 0:  # the same on every rank: said once
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
