"""Filesystem helpers shared by every command that writes an output directory."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_output_dir(out: str | Path, *, force: bool = False, error: type[Exception] = FileExistsError,
                      hint: str = "") -> Iterator[Path]:
    """Yield a temporary sibling of `out`; publish it as `out` only if the block succeeds.

    A non-empty `out` is refused (raising `error`, with `hint` appended) unless `force`, and then
    replaced only after the new one is complete, so an interrupted or failed write never leaves a
    half-written directory behind and never destroys the old one early.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise error(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise error(f"{out}: directory exists and is not empty{hint}")
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


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
