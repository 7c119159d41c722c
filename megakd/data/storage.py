"""Where shards live: a local directory or an object-store prefix (``s3://``, ``gs://``, ``http(s)://``).

:class:`ShardStore` is the one door the data code goes through: whole objects, byte ranges of
an object, and writes. Local paths are plain file calls (no fsspec); URLs go through fsspec, with
the storage library's usual credentials (``AWS_*``, ``GOOGLE_APPLICATION_CREDENTIALS``, ...), never
the config file. Every request to a URL has megakd's own timeouts (``connect_timeout_s`` to connect,
``read_timeout_s`` without a byte arriving) and a byte budget: an object or a range is read to at most
the size asked for (the manifest's), so a server that stalls, or answers a length it never ends, fails
the try instead of holding it for minutes or filling memory (HTTP(S) and S3 are read by megakd's own
request here; other schemes get the timeouts their client library takes). Reads of a URL are retried
on transient errors (a reset connection, a timeout, a 5xx or throttling answer) with exponential
backoff; each retry is counted (``retries``) and a read that still fails after the last try raises
:class:`StorageError` naming the URL. A missing object, a refused permission or an answer over its
budget is not transient and fails at once. Credentials in a URL (``https://user:secret@host``) never
appear in what a store says (``user:***@``, :func:`redact`). Reads made inside
:func:`cancel_on` give up (:class:`ReadCancelled`) once its event is set: between tries and during
the backoff waits, so an abandoned read-ahead stops at once instead of retrying a dead endpoint.

A store is picklable and opens its fsspec filesystem lazily in the process that reads, so a
DataLoader worker never inherits a parent's connection pool or event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from megakd.errors import UserError, redact

logger = logging.getLogger(__name__)

OPEN_BLOCK = 1 << 22  # bytes an object store is asked for at a time when a whole object is streamed (open)
WHOLE_OBJECT_LIMIT = 1 << 30  # the budget of a whole-object read whose size nothing states (a manifest)
CHUNK = 1 << 16  # bytes taken from a response at a time, so its budget is checked as it arrives
REMOTE_SCHEMES = ("s3://", "gs://", "gcs://", "http://", "https://")
EXTRAS = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "http": "aiohttp", "https": "aiohttp"}


class StorageError(UserError):
    """A read or write of shard storage that failed for good (after the retries, for a transient error)."""


class ReadCancelled(BaseException):
    """A read given up because the reader that wanted it was closed (see :func:`cancel_on`).

    Neither a storage failure nor damaged data: a ``BaseException``, so no ``except Exception`` on the
    way up (the retry loop, the shard parser, the bad-shard bookkeeping) takes it for either.
    """


_cancel = threading.local()  # .event: the cancel event of this thread's reads (cancel_on), if any


@contextlib.contextmanager
def cancel_on(event: threading.Event | None) -> Iterator[None]:
    """Reads of this thread inside the block raise :class:`ReadCancelled` once ``event`` is set: before
    each try, instead of a retry after a failed one, and out of a backoff wait (which waits on the
    event). A request already under way is not interrupted; the read ends when it returns."""
    previous = getattr(_cancel, "event", None)
    _cancel.event = event
    try:
        yield
    finally:
        _cancel.event = previous


def check_cancelled() -> None:
    """Raise :class:`ReadCancelled` if this thread's reads were cancelled (:func:`cancel_on`)."""
    event = getattr(_cancel, "event", None)
    if event is not None and event.is_set():
        raise ReadCancelled("read cancelled: its reader was closed")


def is_remote(spec: str | Path) -> bool:
    return str(spec).startswith(REMOTE_SCHEMES)


def transient(error: BaseException) -> bool:
    """Whether trying again may help: connection trouble, timeouts, 5xx / 429 answers."""
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    status = getattr(error, "status", None) or getattr(error, "code", None)
    if isinstance(status, int) and 400 <= status < 500:
        return status in (408, 429)
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - only without the http extra
        aiohttp = None
    if aiohttp is not None and isinstance(error, aiohttp.ClientError):
        return True
    try:  # s3fs: botocore's connection errors (EndpointConnectionError, ...) are not OSErrors
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
    except ImportError:  # pragma: no cover - only without the s3 extra
        pass
    else:
        if isinstance(error, (BotoConnectionError, HTTPClientError)):
            return True
    return isinstance(error, (OSError, TimeoutError, ConnectionError))


class ShardStore:
    """A directory of shards, local or remote; names inside it are ``/``-separated relative paths."""

    def __init__(self, spec: str | Path, *, retries: int = 8, backoff_s: float = 0.25, max_backoff_s: float = 30.0,
                 connect_timeout_s: float = 10.0, read_timeout_s: float = 30.0):
        self.spec = str(spec).rstrip("/") if is_remote(spec) else str(spec)
        self.remote = is_remote(spec)
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.retried = 0  # transient failures retried so far, in this process
        self.fetched = 0  # bytes read so far, in this process
        self.requested = 0  # GETs asked of the storage so far (an object, a byte range, a block), in this process
        self._fs: Any = None
        self._fs_pid = -1

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fs": None, "_fs_pid": -1, "retried": 0, "fetched": 0, "requested": 0}

    def __repr__(self) -> str:
        return redact(self.spec)

    def url(self, name: str) -> str:
        """Where ``name`` is, for messages (credentials redacted); requests use :meth:`_address`."""
        return redact(self._address(name))

    def _address(self, name: str) -> str:
        return f"{self.spec}/{name}" if self.remote else str(Path(self.spec) / name)

    def child(self, name: str) -> ShardStore:
        """The store of a subdirectory (e.g. ``valid/``), with the same retry and timeout policy."""
        return ShardStore(self._address(name), retries=self.retries, backoff_s=self.backoff_s,
                          max_backoff_s=self.max_backoff_s, connect_timeout_s=self.connect_timeout_s,
                          read_timeout_s=self.read_timeout_s)

    @property
    def local_path(self) -> Path:
        if self.remote:
            raise ValueError(f"{self.spec} is not a local path")
        return Path(self.spec)

    # -- fsspec ------------------------------------------------------------------------------------
    def _filesystem(self):
        if self._fs is None or self._fs_pid != os.getpid():
            try:
                import fsspec
                from fsspec.core import url_to_fs
            except ImportError:  # pragma: no cover - fsspec comes with torch and datasets
                raise UserError(f"{self.spec}: reading a URL needs fsspec (pip install fsspec)") from None
            scheme = self.spec.split("://", 1)[0]
            try:
                fs, _ = url_to_fs(self.spec, skip_instance_cache=True, **self._timeouts(scheme))
            except ImportError:
                raise UserError(f"{self.spec}: reading {scheme}:// needs {EXTRAS.get(scheme, 'its fsspec backend')} "
                                f"(pip install 'megakd[remote]')") from None
            del fsspec
            self._fs, self._fs_pid = fs, os.getpid()
        return self._fs

    def _timeouts(self, scheme: str) -> dict:
        """The fsspec options that give every request of ``scheme`` this store's timeouts."""
        if scheme == "s3":  # botocore's socket timeouts
            return {"config_kwargs": {"connect_timeout": self.connect_timeout_s, "read_timeout": self.read_timeout_s}}
        import aiohttp  # http(s) and gcsfs speak aiohttp

        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s, sock_read=self.read_timeout_s)
        if scheme in ("http", "https"):
            return {"client_kwargs": {"timeout": timeout}}
        return {"requests_timeout": timeout} if scheme in ("gs", "gcs") else {}

    def _get(self, name: str, ranges: list[tuple[int, int]] | None = None,
             budget: int = WHOLE_OBJECT_LIMIT) -> list[bytes]:
        """GETs of object ``name``: one per byte range ``[start, end)`` (concurrently), or of the whole
        object (``ranges=None``), never reading more of an answer than its range, or ``budget`` for
        the whole object: over that is a :class:`StorageError`, not a longer wait or a full memory."""
        fs, address = self._filesystem(), self._address(name)
        asks = [(start, end, end - start) for start, end in ranges] if ranges is not None else [(None, None, budget)]
        if self.spec.startswith(("http://", "https://", "s3://")):
            from fsspec.asyn import sync

            get = self._http_get if self.spec.startswith("http") else self._s3_get

            async def together() -> list[bytes]:
                return list(await asyncio.gather(*(get(fs, name, address, *ask) for ask in asks)))

            return sync(fs.loop, together)
        got = []
        for start, end, limit in asks:  # other schemes: the client's own reads, checked after
            data = fs.cat_file(address, start=start, end=end)
            if len(data) > limit:
                raise self._over_budget(name, start, len(data), limit)
            got.append(data)
        return got

    def _over_budget(self, name: str, start: int | None, said: int | None, budget: int) -> StorageError:
        where = self.url(name) + (f" bytes [{start}, {start + budget})" if start is not None else "")
        what = f"says Content-Length {said}" if said is not None else "sends more bytes"
        return StorageError(f"{where}: the answer {what}, more than the {budget} asked for (a misbehaving server or "
                            "proxy); not read further")

    async def _http_get(self, fs, name: str, address: str, start: int | None, end: int | None, budget: int) -> bytes:
        headers = {"Range": f"bytes={start}-{end - 1}"} if start is not None else {}
        session = await fs.set_session()
        async with session.get(fs.encode_url(address), headers=headers, **fs.kwargs) as response:
            fs._raise_not_found_for_status(response, address)
            if start is not None and response.status == 200:  # a server that ignores Range: read the object's head
                return await _bounded(response.content.read, end, None, skip=start)
            if response.content_length is not None and response.content_length > budget:
                raise self._over_budget(name, start, response.content_length, budget)
            return await _bounded(response.content.read, budget,
                                  lambda: self._over_budget(name, start, None, budget))

    async def _s3_get(self, fs, name: str, address: str, start: int | None, end: int | None, budget: int) -> bytes:
        bucket, key, version = fs.split_path(address)
        extra = {"Range": f"bytes={start}-{end - 1}"} if start is not None else {}
        if version:
            extra["VersionId"] = version
        response = await fs._call_s3("get_object", Bucket=bucket, Key=key, **extra)
        body = response["Body"]
        try:
            said = response.get("ContentLength")
            if said is not None and said > budget:
                raise self._over_budget(name, start, said, budget)
            return await _bounded(body.read, budget, lambda: self._over_budget(name, start, None, budget))
        finally:
            body.close()

    def retrying(self, what: str, name: str, call):
        """``call()``, retried with exponential backoff while its error is transient."""
        delay, started = self.backoff_s, time.monotonic()
        cancel: threading.Event | None = getattr(_cancel, "event", None)
        for attempt in range(self.retries + 1):
            check_cancelled()
            try:
                return call()
            except Exception as error:  # fsspec backends raise many types; `transient` sorts them
                if cancel is not None and cancel.is_set():
                    raise ReadCancelled(f"{self.url(name)}: {what} cancelled") from None  # not a failure
                if not transient(error):
                    if isinstance(error, UserError):
                        raise  # already one line naming the object (a damaged shard, a bad sample)
                    if isinstance(error, FileNotFoundError):
                        raise FileNotFoundError(f"{self.url(name)}: not found") from None
                    raise StorageError(f"{self.url(name)}: {what} failed ({_said(error)})") from None
                if attempt == self.retries:
                    raise StorageError(f"{self.url(name)}: {what} still failing after {self.retries + 1} tries over "
                                       f"{time.monotonic() - started:.0f} s ({_said(error)})") from None
                self.retried += 1
                logger.warning("%s: %s failed (%s); retry %d of %d in %.2f s", self.url(name), what, _said(error),
                               attempt + 1, self.retries, delay)
                if cancel is None:
                    time.sleep(delay)
                elif cancel.wait(delay):
                    raise ReadCancelled(f"{self.url(name)}: {what} cancelled during the backoff") from None
                delay = min(2 * delay, self.max_backoff_s)
                if self.remote:
                    self._fs = None  # a fresh connection pool for the next try
        raise AssertionError("unreachable")

    # -- reads -------------------------------------------------------------------------------------
    def read(self, name: str, max_bytes: int = WHOLE_OBJECT_LIMIT) -> bytes:
        """The whole object ``name``, which must be at most ``max_bytes`` long (the size a manifest
        states, where one does): a longer one is refused before more than that is read."""
        if not self.remote:
            with open(Path(self.spec) / name, "rb") as f:
                data = f.read(max_bytes + 1)
            if len(data) > max_bytes:
                raise StorageError(f"{self.url(name)}: more than the {max_bytes} bytes expected; not read")
        else:
            data = self.retrying("read", name, lambda: self._get(name, budget=max_bytes)[0])
        self.fetched += len(data)
        self.requested += 1
        return data

    def read_ranges(self, name: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Bytes ``[start, end)`` of ``name`` for each range (fetched concurrently from object stores)."""
        if not ranges:
            return []
        url = self.url(name)
        if not self.remote:
            parts = []
            with open(self._address(name), "rb") as f:
                for start, end in ranges:
                    f.seek(start)
                    parts.append(f.read(end - start))
        else:
            parts = self.retrying(f"ranged read ({len(ranges)} ranges)", name, lambda: self._get(name, ranges))
        self.fetched += sum(len(part) for part in parts)
        self.requested += len(ranges)  # fsspec asks an object store for each range separately
        for (start, end), part in zip(ranges, parts):
            if len(part) != end - start:  # a shorter answer: the object is shorter than its manifest says
                raise StorageError(f"{url}: bytes [{start}, {end}) gave {len(part)} bytes (object truncated or "
                                   "replaced?)")
        return parts

    def size(self, name: str) -> int | None:
        """Size in bytes, or None if there is no such object."""
        if not self.remote:
            path = Path(self.spec) / name
            return path.stat().st_size if path.is_file() else None
        try:
            return int(self.retrying("stat", name, lambda: self._filesystem().size(self._address(name))))
        except FileNotFoundError:
            return None

    def open(self, name: str, size: int):
        """A sequential binary reader of the whole object, ``size`` bytes long (its manifest's; the
        streaming path of unindexed shards); the caller counts what it read with :meth:`streamed`.
        From an object store it reads ranges of :data:`OPEN_BLOCK` bytes, each within its budget."""
        if not self.remote:
            return open(Path(self.spec) / name, "rb")
        return io.BufferedReader(_RangedReader(self, name, size), buffer_size=OPEN_BLOCK)

    def streamed(self, size: int) -> None:
        """Count ``size`` bytes read through :meth:`open`: one request per block of an object store's."""
        self.fetched += size
        self.requested += -(-size // OPEN_BLOCK) if self.remote else 1

    # -- writes ------------------------------------------------------------------------------------
    def is_empty(self) -> bool:
        """No object under this prefix (a remote ``--out`` must be unused, like a local one)."""
        if not self.remote:
            path = Path(self.spec)
            return not path.exists() or (path.is_dir() and not any(path.iterdir()))
        fs = self._filesystem()
        try:
            return not self.retrying("list", "", lambda: fs.find(self.spec, maxdepth=None))
        except FileNotFoundError:
            return True

    def upload(self, local_dir: Path, last: str) -> None:
        """Copy every file of ``local_dir`` under this prefix, ``last`` (the manifest) after all others.

        Readers open the manifest first, so until it lands the prefix holds no data set at all:
        an interrupted upload is never read as a complete one.
        """
        fs = self._filesystem()
        # The manifests go last, the top one (which makes the data set visible) very last.
        files = sorted((p for p in local_dir.rglob("*") if p.is_file()),
                       key=lambda p: (p.name == last, -len(p.relative_to(local_dir).parts), str(p)))
        for path in files:
            name = path.relative_to(local_dir).as_posix()
            self.retrying("upload", name, lambda path=path, name=name: fs.put_file(str(path), self._address(name)))


def _said(error: BaseException) -> str:
    """An error's type and first line (credentials redacted), for a one-line message; a timeout says
    which of the store's timeouts it was where the client tells."""
    text = str(error).splitlines()[0][:200] if str(error) else ""
    if not text and isinstance(error, (TimeoutError, asyncio.TimeoutError)):
        text = "no answer within the store's timeout"
    return redact(f"{type(error).__name__}: {text}")


async def _bounded(read, budget: int, over, skip: int = 0) -> bytes:
    """The body ``read(n)`` gives, chunk by chunk, to at most ``budget`` bytes: more is ``over()``
    raised, or with ``over=None`` not read (the object's head was all that was wanted; its bytes from
    ``skip`` on are returned)."""
    parts, got = [], 0
    while chunk := await read(CHUNK):
        got += len(chunk)
        parts.append(chunk)
        if got > budget:
            if over is not None:
                raise over()
            break
    data = b"".join(parts)
    return data if over is not None else data[skip:budget]


class _RangedReader(io.RawIOBase):
    """A whole object of known size read sequentially as ranges of a store, each within its budget."""

    def __init__(self, store: ShardStore, name: str, size: int) -> None:
        self.store, self.name, self.size, self.at = store, name, size, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        end = min(self.size, self.at + min(len(buffer), OPEN_BLOCK))
        if end <= self.at:
            return 0
        data = self.store.retrying("read", self.name, lambda: self.store._get(self.name, [(self.at, end)])[0])
        if len(data) != end - self.at:
            raise StorageError(f"{self.store.url(self.name)}: bytes [{self.at}, {end}) gave {len(data)} bytes "
                               "(object truncated or replaced?)")
        buffer[:len(data)] = data
        self.at = end
        return len(data)


class ContentCache:
    """Immutable objects on local disk, each named by what it holds, used only if their bytes pass a check.

    Two kinds live in it: a shard's member index, named by its sha256 and checked against it; and
    the byte ranges of a shard that all DataLoader workers of a rank read between them, named by
    the shard's sha256 and the ranges, checked member by member against the shard's index
    (:func:`megakd.data.shard_reader.read_members`). What one reader fetched, the other readers on the node
    (workers, ranks) and later epochs read from here instead of from shared storage. A damaged or
    planted file fails its check and is ignored (and replaced), never trusted. One reader fetches a
    missing object while the others wait for it (a lock file; one older than ``wait_s`` is taken
    for a crashed fetcher's and broken), so a node fetches each object about once. A reader that
    abandons its fetches in flight gives their locks up (:meth:`release`). Any failure of the cache
    itself (read-only, full) falls back to fetching.
    """

    def __init__(self, root: str | Path, wait_s: float = 60.0) -> None:
        self.root = Path(root)
        self.wait_s = wait_s
        self._holding: set[Path] = set()  # the locks this object's fetches hold now

    @staticmethod
    def _sha256_is(name: str) -> Callable[[bytes], bool]:
        return lambda data: hashlib.sha256(data).hexdigest() == name

    def _valid(self, path: Path, valid: Callable[[bytes], bool]) -> bytes | None:
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if valid(data):
            return data
        path.unlink(missing_ok=True)
        return None

    def get(self, name: str, fetch: Callable[[], bytes], valid: Callable[[bytes], bool] | None = None) -> bytes:
        """The object ``name``: from the cache if its bytes are ``valid`` (default: they hash to
        ``name``), else ``fetch()``-ed (and kept if they are)."""
        valid = valid or self._sha256_is(name)
        path = self.root / name
        if (data := self._valid(path, valid)) is not None:
            return data
        lock = self.root / f"{name}.lock"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError:
            return fetch()
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return self._wait_for(path, lock, name, fetch, valid)
        except OSError:
            return fetch()
        self._holding.add(lock)
        try:
            # Another reader may have published the object between the look above and taking the lock.
            if (data := self._valid(path, valid)) is not None:
                return data
            data = fetch()
            if valid(data):
                with contextlib.suppress(OSError):
                    tmp = self.root / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
                    tmp.write_bytes(data)
                    os.replace(tmp, path)
            return data
        finally:
            os.close(fd)
            self._give_up(lock)

    def _give_up(self, lock: Path) -> None:
        try:
            self._holding.remove(lock)  # atomic: of this fetch's end and release(), one unlinks it
        except KeyError:
            return  # released already; the lock there now may be another reader's
        lock.unlink(missing_ok=True)

    def release(self) -> None:
        """Give up the locks of this object's fetches still in flight, which their reader abandons (a
        DataLoader worker that ends does not wait for them). The readers waiting for those objects
        fetch them themselves at once, instead of waiting ``wait_s`` for a lock nobody will remove."""
        for lock in list(self._holding):
            self._give_up(lock)

    def discard(self, name: str) -> None:
        """Remove ``name`` (no error if another reader already did)."""
        with contextlib.suppress(OSError):
            (self.root / name).unlink(missing_ok=True)

    def _wait_for(self, path: Path, lock: Path, name: str, fetch, valid) -> bytes:
        """Another reader is fetching ``name``: wait for its file; fetch alone if it never comes."""
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            time.sleep(0.02)
            check_cancelled()
            if (data := self._valid(path, valid)) is not None:
                return data
            try:
                if time.time() - lock.stat().st_mtime > self.wait_s:
                    lock.unlink(missing_ok=True)  # a fetcher that died holding it
                    return self.get(name, fetch, valid)
            except FileNotFoundError:
                return self.get(name, fetch, valid)  # the fetcher gave up without a file
        return fetch()
