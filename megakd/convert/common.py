"""What every conversion shares: its error type and all-or-nothing output directories."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megakd import fsutil
from megakd.errors import UserError


class ConversionError(UserError):
    """Bad conversion input; the one-line message names the file or key and what was expected."""


@contextmanager
def atomic_output_dir(out: str | Path, force: bool = False) -> Iterator[Path]:
    """`megakd.fsutil.atomic_output_dir` with conversion errors and the CLI's --force hint."""
    with fsutil.atomic_output_dir(out, force=force, error=ConversionError,
                                  hint=" (use --force to replace it)") as tmp:
        yield tmp
