"""The one exception type that means "bad input", as opposed to a bug.

`megakd.cli.main` prints a `UserError` as one line (`megakd: error: ...`) and exits 2; every other
exception keeps its traceback, so an internal bug is never disguised as a user mistake. Raise it
(or a subclass) only for input the user can fix: a config key, a file's contents, a command-line
argument. The message names the file or key and says what was expected. It subclasses ValueError
because callers and tests have long caught the data pipeline's checks as ValueError.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input the user can fix; the message names the file or key and what was expected."""


class LaunchError(UserError):
    """The config does not fit how the processes were started (e.g. backend.name=single under torchrun).

    Every rank of the launch raises the same one, so `megakd.cli.main` prints it on rank 0 only."""
