"""The one exception type that means "bad input", as opposed to a bug.

`megakd.cli.main` prints a `UserError` as one line (`megakd: error: ...`) and exits 2; every other
exception keeps its traceback, so an internal bug is never disguised as a user mistake. Raise it
(or a subclass) only for input the user can fix: a config key, a file's contents, a command-line
argument. The message names the file or key and says what was expected. It subclasses ValueError
because callers and tests have long caught the data pipeline's checks as ValueError.
"""

from __future__ import annotations

import re
from typing import Any

_CREDENTIALS = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)([^/@\s:]*)(:[^/@\s]*)?@")


def redact(text: str) -> str:
    """``text`` with the password (or lone token) of every ``scheme://user:secret@`` URL in it as ``***``:
    what megakd writes or logs (configs, messages, log lines) never carries a URL's credentials."""
    return _CREDENTIALS.sub(lambda m: f"{m[1]}{m[2]}:***@" if m[3] else f"{m[1]}***@", text)


def redact_values(tree: Any) -> Any:
    """A config tree (dicts, lists, scalars) with :func:`redact` applied to every string in it."""
    if isinstance(tree, dict):
        return {k: redact_values(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(redact_values(v) for v in tree)
    return redact(tree) if isinstance(tree, str) else tree


class UserError(ValueError):
    """Bad input the user can fix; the message names the file or key and what was expected."""


class LaunchError(UserError):
    """The config does not fit how the processes were started (e.g. backend.name=single under torchrun).

    Every rank of the launch raises the same one, so `megakd.cli.main` prints it on rank 0 only."""
