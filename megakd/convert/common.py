"""What every conversion shares: its error type and all-or-nothing output directories."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class ConversionError(ValueError):
    """Bad conversion input; the one-line message names the file or key and what was expected."""


@contextmanager
def atomic_output_dir(out: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `out`; publish it as `out` only if the block succeeds.

    A non-empty `out` is refused unless `force`, and then replaced only after the new one is
    complete, so an interrupted or failed conversion never leaves a half-written model behind.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConversionError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConversionError(f"{out}: directory exists and is not empty (use --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary output directory
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
