"""Filesystem helpers shared by every command that writes an output directory."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megakd.errors import UserError


class OutputError(UserError, FileExistsError):
    """An output directory that cannot be written or published as asked (not empty, claimed by another
    command, changed meanwhile, disk full). A FileExistsError too, which the refusal used to be."""


@contextmanager
def atomic_output_dir(out: str | Path, *, force: bool = False, error: type[Exception] = OutputError,
                      hint: str = "") -> Iterator[Path]:
    """Yield a temporary sibling of `out`; publish it as `out` only if the block succeeds.

    A non-empty `out` is refused (raising `error`, with `hint` appended) unless `force`. For the
    command's life `out` is claimed: an exclusive lock on `.<name>.claim` beside it, so a second
    command writing the same `out` is refused at its start. Publishing deletes nothing the command
    did not write: `out` is replaced only if it is still as it was at the start (absent, empty, or
    with `force` the very files found then); one that someone else wrote into meanwhile is left alone,
    and the finished output is kept beside it under a name the error gives. An interrupted or failed
    write leaves no half-written directory, and a full disk is one line naming `out` (the partial
    output removed). What is published has the permissions the umask gives (`apply_umask`).
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise error(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise error(f"{out}: directory exists and is not empty{hint}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with _claimed(out, error):
            found = _listing(out)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
            try:
                yield tmp
                apply_umask(tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            _publish(tmp, out, found, error)
    except Exception as err:
        if not is_disk_full(err):
            raise
        raise error(f"{out}: no space left on device while writing it; the partial output was removed, nothing "
                    "else was changed") from None


def _listing(out: Path) -> dict[str, tuple[int, int]] | None:
    """Every file under `out` with its size and modification time (None: `out` does not exist)."""
    if not out.is_dir():
        return None
    return {str(p.relative_to(out)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(out.rglob("*"))}


def _publish(tmp: Path, out: Path, found: dict | None, error: type[Exception]) -> None:
    """`tmp` renamed to `out` if `out` is as `found` at the start; else kept, and `error` raised."""
    now = _listing(out)
    if now == found or not now:
        old = None
        if now:  # force, and still the files found at the start: set aside, deleted once the new one is in
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
        try:
            os.rename(tmp, out)  # onto an empty directory or none: atomic; a file written meanwhile fails it
        except OSError as err:
            if old is not None:
                old.rename(out)  # what was there goes back
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        else:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            return
    kept = out.parent / f"{out.name}.megakd-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    tmp.rename(kept)
    raise error(f"{out}: changed while this command ran (someone else wrote into it); left as it is, the finished "
                f"output is {kept}")


@contextmanager
def _claimed(out: Path, error: type[Exception]) -> Iterator[None]:
    """An exclusive flock on `.<out name>.claim` beside `out` while the block runs; removed after."""
    claim = out.parent / f".{out.name}.claim"
    fd = os.open(claim, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "another command"
        os.close(fd)
        raise error(f"{out}: being written by another megakd command ({holder}); wait for it to end or pick "
                    "another output") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}\n".encode(), 0)
        yield
    finally:
        claim.unlink(missing_ok=True)  # still locked: a command waiting for it opens a fresh one
        os.close(fd)


_STATUS = "/proc/self/status"


def umask() -> int:
    """The process's umask, read without changing it.

    `os.umask` reads only by setting: a file another thread (a data loader's, a library's) creates
    in between gets the stand-in umask. Linux (4.7 on) shows the umask in /proc/self/status, read
    afresh each call so that a umask set after import counts; elsewhere the stand-in is 0o077,
    which can only make such a file more private, never more open.
    """
    try:
        found = re.search(r"^Umask:\s*([0-7]+)$", Path(_STATUS).read_text(errors="replace"), re.MULTILINE)
    except OSError:
        found = None
    if found:
        return int(found.group(1), 8)
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def apply_umask(root: Path) -> None:
    """Give `root` and everything under it at least the permissions a plain open() or mkdir() gives
    under the umask (0o666 or 0o777 less it): called on an output just before it is published.

    Temporary files and directories are created private (mkstemp 0600, mkdtemp 0700) whatever the
    umask, and libraries write through them (safetensors, so also transformers' save_pretrained):
    published as they are, a colleague on a shared filesystem could not read them. Bits are only
    added: what a default ACL or a setgid directory gave an entry stays. Symbolic links are skipped.
    """
    mask = umask()
    for path in (root, *root.rglob("*")):
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            continue
        wanted = (0o777 if stat.S_ISDIR(mode) else 0o666) & ~mask
        if mode & wanted != wanted:
            path.chmod(stat.S_IMODE(mode) | wanted)


def is_disk_full(err: BaseException) -> bool:
    """ENOSPC/EDQUOT, also when a library wrapped the OSError in a RuntimeError (torch.save does).

    torch.save's zip writer may instead report only its symptom, a short write ("unexpected pos N
    vs M"): the bytes it asked for were not written, which on a local file is a full disk.
    """
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(sign in str(err) for sign in ("No space left on device", "file write failed", "unexpected pos ")):
            return True
        err = err.__cause__ or err.__context__
    return False


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
