"""Real object-store servers over a socket for the remote-shard tests: a moto S3 server and a small
HTTP server with Range support that can fail on purpose (5xx answers, or down for a while).

Two ways to run each. In a thread of the test process (``MotoS3``, ``RangeHTTPServer``: cheap,
inspectable counters, ``fail(n)``), or in a child process of their own (``S3Process``,
``HTTPProcess``: ``stop()`` kills it, so every connection, kept-alive ones included, drops at once,
and no DataLoader worker forked by the test holds a copy of its listening socket). Outages are
tested with the child processes: a thread-served "stopped" server still answers the connections
already open (werkzeug) or, with workers, still accepts on the inherited socket.

Fixtures live here and are imported explicitly by the test modules that use them
(``from tests.remote_servers import s3, s3_server, http_server, s3_process, http_process``).
The child processes run this module: ``python -m tests.remote_servers {s3,http} --port P ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest

AWS_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


# -- S3 (moto) -------------------------------------------------------------------------------------
class MotoS3:
    """A moto S3 server in a thread. Its objects live in this process (moto's global backend), so a
    server stopped and started again on the same port still holds them."""

    def __init__(self, recording: Path | None = None) -> None:
        import moto.moto_api
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        if recording is not None:  # moto's request recorder (off until `recording()`) writes here, not in cwd
            moto.moto_api.recorder._location = str(recording)
        self._cls = ThreadedMotoServer
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.host, self.port = self.server.get_host_and_port()
        self.running = True

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        # One attempt per botocore call: the retries under test are ShardStore's own, and a
        # stopped server then fails a read at once instead of after botocore's ~10 s of backoff.
        return {**AWS_ENV, "AWS_ENDPOINT_URL": self.endpoint, "AWS_MAX_ATTEMPTS": "1"}

    @contextlib.contextmanager
    def recording(self):
        """Record the requests made inside the block; yields a list filled with (method, key) on exit."""
        import requests

        api = f"{self.endpoint}/moto-api/recorder"
        requests.post(f"{api}/reset-recording", timeout=10).raise_for_status()
        requests.post(f"{api}/start-recording", timeout=10).raise_for_status()
        got: list[tuple[str, str]] = []
        try:
            yield got
        finally:
            requests.post(f"{api}/stop-recording", timeout=10).raise_for_status()
            text = requests.get(f"{api}/download-recording", timeout=10).text
            for line in text.splitlines():
                entry = json.loads(line)
                got.append((entry["method"], urlsplit(entry["url"]).path.lstrip("/")))

    def stop(self) -> None:
        """Stop answering and close the listening socket (connections are refused, not left hanging)."""
        if self.running:
            self.server.stop()
            self.server._server.server_close()
            self.running = False

    def start(self) -> None:
        """Start again on the same port."""
        if not self.running:
            self.server = self._cls(ip_address=self.host, port=self.port, verbose=False)
            self.server.start()
            self.running = True

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="test", aws_secret_access_key="test")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    server = MotoS3(recording=tmp_path_factory.mktemp("moto") / "recording")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def s3_env(s3_server):
    """The AWS_* variables that reach the moto server, for one test module (subprocesses inherit them)."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_server.env().items():
            mp.setenv(k, v)
        yield s3_server.env()


@dataclass
class S3Bucket:
    server: MotoS3
    name: str
    client: object = field(repr=False)

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.name}/{prefix}".rstrip("/")

    def keys(self, prefix: str = "") -> list[str]:
        got = self.client.list_objects_v2(Bucket=self.name, Prefix=prefix)
        return sorted(o["Key"] for o in got.get("Contents", []))

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.name, Key=key)["Body"].read()

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.name, Key=key, Body=data)


@pytest.fixture
def s3(s3_server, s3_env) -> S3Bucket:
    """A fresh bucket on the session's moto server, with the AWS_* variables that reach it set."""
    s3_server.start()  # a test that stopped it may have failed before starting it again
    client = s3_server.client()
    name = f"corpus-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    yield S3Bucket(s3_server, name, client)
    s3_server.start()


# -- HTTP with Range -------------------------------------------------------------------------------
class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall
    server: _FileServer

    def log_message(self, *args) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        with self.server.owner.lock:
            self.server.owner.connections.add(self.request)

    def finish(self) -> None:
        with self.server.owner.lock:
            self.server.owner.connections.discard(self.request)
        super().finish()

    def _fail(self) -> bool:
        owner = self.server.owner
        with owner.lock:
            owner.requests += 1
            if owner.fail_next > 0:
                owner.fail_next -= 1
                owner.failed += 1
                status = owner.fail_status
            else:
                return False
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()
        return True

    def _file(self) -> Path | None:
        rel = self.path.split("?", 1)[0].lstrip("/")
        self.server.owner.hold_if_asked(rel)
        path = (self.server.owner.root / rel).resolve()
        root = self.server.owner.root.resolve()
        if root not in path.parents or not path.is_file():
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        return path

    def do_HEAD(self) -> None:
        if self._fail() or (path := self._file()) is None:
            return
        self.send_response(200)
        self.send_header("Content-Length", str(path.stat().st_size))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()

    def do_GET(self) -> None:
        if self._fail() or (path := self._file()) is None:
            return
        data = path.read_bytes()
        spec = self.headers.get("Range")
        if spec:
            first, _, last = spec.removeprefix("bytes=").partition("-")
            if not first:  # a suffix: the last N bytes
                start, end = max(0, len(data) - int(last)), len(data) - 1
            else:
                start, end = int(first), min(int(last) if last else len(data) - 1, len(data) - 1)
            if start >= len(data) or start > end:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            with self.server.owner.lock:
                self.server.owner.ranged += 1
            body = data[start:end + 1]
            if (mode := self.server.owner.misbehaves(path)) is not None:
                self._misbehave(mode, body, start, len(data))
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        else:
            body = data
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self.wfile.write(body)


    def _misbehave(self, mode: str, body: bytes, start: int, size: int) -> None:
        """Answer a range request as a hostile or broken server would (see RangeHTTPServer.misbehave)."""
        owner = self.server.owner
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{size}")
        if mode == "stall":  # the true length, half the body, then nothing until released
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            owner.released.wait(60)
            self.close_connection = True
            return
        if mode == "lying-length":
            self.send_header("Content-Length", str(10**13))
        else:  # "endless": no length at all, a body read until the connection closes
            self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        chunk = body * (1 + (1 << 16) // max(1, len(body)))
        sent = 0
        with contextlib.suppress(OSError):  # the client hung up: what a read with a budget does
            while not owner.released.is_set() and sent < 1 << 33:
                self.wfile.write(chunk)
                sent += len(chunk)
        with owner.lock:
            owner.misbehaved_bytes = max(owner.misbehaved_bytes, sent)


class _FileServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # socketserver's 5 drops some of the readers' connections: each retried 1 s later
    owner: RangeHTTPServer

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # a client that went away (a worker ended, a read abandoned): not the server's error
        super().handle_error(request, client_address)


class RangeHTTPServer:
    """Serves ``root`` over HTTP/1.1 with ``Range: bytes=a-b`` (206 + Content-Range) and HEAD sizes.

    ``fail(n, status)`` answers the next ``n`` requests with ``status``; ``hold(stems)`` keeps every
    request for a file with one of those stems unanswered until ``release()`` (a request hung in
    flight); ``misbehave(mode, stems)`` answers their range requests as a stalling or lying server
    would, until ``release()``; ``stop()`` / ``start()`` take it down and bring it back on the same port (in this
    process: DataLoader workers forked meanwhile keep its listening socket open, so test outages
    with :class:`HTTPProcess`).
    """

    def __init__(self, root: Path, port: int = 0) -> None:
        self.root = Path(root)
        self.lock = threading.Lock()
        self.fail_next = 0
        self.fail_status = 503
        self.requests = self.failed = self.ranged = 0
        self.held_stems: frozenset[str] = frozenset()
        self.held = 0  # requests being held now
        self.released = threading.Event()
        self.connections: set[socket.socket] = set()  # open (keep-alive) connections, closed by stop()
        self.misbehaving: tuple[str, frozenset[str], int] | None = None  # (mode, stems, good answers left)
        self.misbehaved = 0  # range requests answered badly so far
        self.misbehaved_bytes = 0  # the most body bytes one bad answer got out before the client hung up
        self.port = port
        self._server: _FileServer | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        if self._server is not None:
            return
        deadline = time.monotonic() + 10
        while True:
            try:
                server = _FileServer(("127.0.0.1", self.port), _Handler)
                break
            except OSError:  # the old socket may linger for a moment
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        server.owner = self
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
            with self.lock:  # a stopped server also drops the connections it kept alive
                for conn in self.connections:
                    try:
                        conn.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                self.connections.clear()

    def fail(self, n: int, status: int = 503) -> None:
        with self.lock:
            self.fail_next, self.fail_status = n, status

    def hold(self, stems) -> None:
        self.released.clear()
        self.held_stems = frozenset(stems)

    def release(self) -> None:
        self.held_stems = frozenset()
        self.misbehaving = None
        self.released.set()

    def misbehave(self, mode: str, stems, after: int = 0) -> None:
        """After ``after`` more good ones, answer every range request for a file with one of these stems
        badly: ``"stall"`` (headers with the true length and half the body, then silence until
        ``release()``), ``"lying-length"`` (``Content-Length: 10**13`` and a body that never ends) or
        ``"endless"`` (no length, a body that never ends)."""
        self.released.clear()
        with self.lock:
            self.misbehaving = (mode, frozenset(stems), after)

    def misbehaves(self, path: Path) -> str | None:
        """The bad answer due for this range request of ``path`` (counting down the good ones), if any."""
        with self.lock:
            if self.misbehaving is None or path.stem not in self.misbehaving[1]:
                return None
            mode, stems, good = self.misbehaving
            if good > 0:
                self.misbehaving = (mode, stems, good - 1)
                return None
            self.misbehaved += 1
            return mode

    def hold_if_asked(self, rel: str) -> None:
        """Called by each request: wait (up to a minute) while its file's stem is held."""
        if Path(rel).stem not in self.held_stems:
            return
        with self.lock:
            self.held += 1
        self.released.wait(60)
        with self.lock:
            self.held -= 1

    def refuses(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) != 0


@pytest.fixture
def http_server(tmp_path):
    """``serve(root)`` → a running :class:`RangeHTTPServer` on ``root``; every one is stopped at the end."""
    servers: list[RangeHTTPServer] = []

    def serve(root: Path) -> RangeHTTPServer:
        servers.append(RangeHTTPServer(root))
        return servers[-1]

    yield serve
    for server in servers:
        server.release()
        server.stop()



# -- the same servers in a child process each ---------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]


class _Restart(threading.Thread):
    """``server._listen(spare, at)`` in a thread; ``join()`` raises what it raised."""

    def __init__(self, server: ServerProcess, spare: subprocess.Popen, at: float) -> None:
        super().__init__(daemon=True)
        self.server, self.spare, self.at, self.error = server, spare, at, None
        self.start()

    def run(self) -> None:
        try:
            self.server._listen(self.spare, self.at)
        except BaseException as error:  # raised by join(), in the test's thread
            self.error = error

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error


class ServerProcess:
    """A server in a child process on a fixed port: ``stop()`` kills the process (SIGKILL: every
    connection is reset by the kernel, none is answered again), ``start()`` runs a new one on the same
    port and returns once it accepts connections. ``outages`` holds each stop-to-accepting time (s).

    A child first gets ready (imports; for S3, its objects loaded), says so on stdout, then waits
    for a line on stdin before it binds the port: ``restart_after`` readies the new server before
    it kills the old one, so an outage lasts as long as asked, not as long as a start takes.
    """

    kind = ""

    def __init__(self) -> None:
        from megakd.engine.backends import free_local_port  # here: the server processes stay free of torch

        self.port = free_local_port()
        self.proc: subprocess.Popen | None = None
        self.outages: list[float] = []
        self._stopped_at: float | None = None
        self._spare: subprocess.Popen | None = None  # readied by restart_after, listening soon

    @property
    def running(self) -> bool:
        return self.proc is not None

    def _args(self) -> list[str]:
        return []

    def _spawn(self) -> subprocess.Popen:
        """A child that is ready to listen (and waits to be told)."""
        proc = subprocess.Popen([sys.executable, "-m", "tests.remote_servers", self.kind, "--port", str(self.port),
                                 *self._args()], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        if not ready or proc.stdout.readline() != b"ready\n":  # EOF: it died
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{self.kind} server exited {proc.returncode}: "
                               f"{proc.stderr.read().decode(errors='replace')[-2000:]}")
        return proc

    def _listen(self, proc: subprocess.Popen, at: float | None = None, timeout: float = 30.0) -> None:
        """Tell the ready child ``proc`` to listen, from ``at`` (a ``time.monotonic()``) on; return once
        it accepts connections."""
        deadline = time.monotonic() + timeout
        if at is not None:
            time.sleep(max(0.0, at - time.monotonic()))
        while True:
            with contextlib.suppress(BrokenPipeError):  # a child that died: its stderr says why
                proc.stdin.write(b"listen\n")
                proc.stdin.close()
            while proc.poll() is None:
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", self.port)) == 0:
                        break
                if time.monotonic() > deadline:
                    proc.kill()
                    proc.wait()
                    raise TimeoutError(f"{self.kind} server on port {self.port} not up after {timeout:.0f} s")
                time.sleep(0.01)
            if proc.poll() is None:
                break
            error = proc.stderr.read().decode(errors="replace")
            if "Address already in use" not in error or time.monotonic() > deadline:  # the old one may linger
                raise RuntimeError(f"{self.kind} server on port {self.port} exited {proc.returncode}: {error[-2000:]}")
            time.sleep(0.05)
            proc = self._spawn()
        for pipe in (proc.stdout, proc.stderr):  # nothing reads them from now on: a full pipe must never block it
            pipe.close()
        self.proc, self._spare = proc, None
        if self._stopped_at is not None:
            self.outages.append(time.monotonic() - self._stopped_at)
            self._stopped_at = None

    def start(self) -> None:
        if self.proc is None:
            self._listen(self._spawn())

    def _save(self) -> None:
        """Keep what the running server holds for the next one (S3)."""

    def stop(self) -> None:
        if self.proc is not None:
            self._save()
            self._kill()

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            self._stopped_at = time.monotonic()

    def restart_after(self, seconds: float) -> _Restart:
        """Kill the server now; a new one (same port, same objects) listens ``seconds`` later. Returns
        the thread that starts it."""
        self._save()
        self._spare = self._spawn()
        self._kill()
        return _Restart(self, self._spare, time.monotonic() + seconds)

    def close(self) -> None:
        self._kill()
        self._stopped_at = None
        if self._spare is not None:  # a restart still under way (the test failed before it ended)
            self._spare.kill()
            self._spare.wait()
            self._spare = None


class StoreProcess(ServerProcess):
    """An object store in a child process whose objects outlive it in ``state`` (how, each store says),
    so a new server on the same port serves the same objects, as a real store does. ``env()``: the
    variables that make the store's client library reach it."""

    def __init__(self, state: Path) -> None:
        super().__init__()
        self.state = Path(state).resolve()
        self.state.mkdir(parents=True, exist_ok=True)
        self.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        raise NotImplementedError

    def _args(self) -> list[str]:
        return ["--state", str(self.state)]

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.state, ignore_errors=True)


class S3Process(StoreProcess):
    """moto's S3 server in a child process. moto keeps its objects in memory, so the objects are
    copied to ``state`` before a stop and a new server loads them back before it listens on the
    port."""

    kind = "s3"

    def env(self) -> dict[str, str]:
        return {**AWS_ENV, "AWS_ENDPOINT_URL": self.endpoint, "AWS_MAX_ATTEMPTS": "1"}  # see MotoS3.env

    def client(self):
        return _client(self.endpoint)

    def upload(self, local_dir: Path, url: str) -> None:
        """Every file under ``local_dir`` to the ``s3://bucket/prefix`` ``url`` (the bucket made if new)."""
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=bucket)
        for path in sorted(p for p in Path(local_dir).rglob("*") if p.is_file()):
            key = f"{prefix}/{path.relative_to(local_dir).as_posix()}".lstrip("/")
            client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())

    def _save(self) -> None:
        if self.proc is not None:
            _dump(self.client(), self.state)


class GCSProcess(StoreProcess):
    """gcp-storage-emulator (the GCS JSON API) in a child process; it keeps its objects on disk in ``state``."""

    kind = "gcs"

    def env(self) -> dict[str, str]:
        # gcsfs >= 2026 first asks a gRPC control API for the bucket's layout, which no emulator
        # serves (a 60 s timeout per bucket); its plain JSON-API file system is what megakd reads.
        return {"STORAGE_EMULATOR_HOST": self.endpoint, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def _fs(self):
        import gcsfs

        return gcsfs.GCSFileSystem(token="anon", project="test", endpoint_url=self.endpoint)

    def make_bucket(self, name: str) -> None:
        fs = self._fs()
        if not fs.exists(name):
            fs.mkdir(name)

    def upload(self, local_dir: Path, url: str) -> None:
        """Every file under ``local_dir`` to the ``gs://bucket/prefix`` ``url`` (the bucket made if new)."""
        path = url.removeprefix("gs://")
        self.make_bucket(path.partition("/")[0])
        fs = self._fs()
        for file in sorted(p for p in Path(local_dir).rglob("*") if p.is_file()):
            fs.pipe_file(f"{path}/{file.relative_to(local_dir).as_posix()}", file.read_bytes())


class HTTPProcess(ServerProcess):
    """:class:`RangeHTTPServer` on ``root`` in a child process."""

    kind = "http"

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = Path(root)
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _args(self) -> list[str]:
        return ["--root", str(self.root)]


def _client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id="test", aws_secret_access_key="test")


def _dump(client, state: Path) -> None:
    """Every object of every bucket to ``state/<bucket>/<key>`` (what was there before is replaced)."""
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    for bucket in client.list_buckets()["Buckets"]:
        (state / bucket["Name"]).mkdir()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket["Name"]):
            for obj in page.get("Contents", []):
                path = state / bucket["Name"] / obj["Key"]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(client.get_object(Bucket=bucket["Name"], Key=obj["Key"])["Body"].read())


def _load(client, state: Path) -> None:
    for bucket in sorted(p for p in state.iterdir() if p.is_dir()):
        client.create_bucket(Bucket=bucket.name)
        for path in sorted(p for p in bucket.rglob("*") if p.is_file()):
            client.put_object(Bucket=bucket.name, Key=path.relative_to(bucket).as_posix(), Body=path.read_bytes())


def _wait_for_listen() -> None:
    """Say "ready", then wait for ServerProcess._listen's "listen" line; exit if the test process goes
    away first (stdin closed without it) or at any time later (a server never outlives its test run)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
    print("ready", flush=True)
    if sys.stdin.readline() != "listen\n":
        sys.exit(0)


def _serve_s3(port: int, state: Path) -> None:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    loader = None
    if state.is_dir() and any(state.iterdir()):
        # Load the objects through a server on another port first: the server on `port` starts
        # with them, so a reader never sees the bucket empty or missing (moto's backend is shared
        # by the servers of a process).
        loader = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        loader.start()
        host, loader_port = loader.get_host_and_port()
        _load(_client(f"http://{host}:{loader_port}"), state)
    if loader is not None:
        loader.stop()
    _wait_for_listen()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    threading.Event().wait()


def _serve_gcs(port: int, state: Path) -> None:
    from gcp_storage_emulator.server import create_server

    logging.getLogger("gcp_storage_emulator").setLevel(logging.ERROR)
    server = create_server("127.0.0.1", port, data_dir=str(state))  # reads what an earlier server stored
    _wait_for_listen()
    server.start()
    threading.Event().wait()


def _serve_http(port: int, root: Path) -> None:
    _wait_for_listen()
    RangeHTTPServer(root, port=port)
    threading.Event().wait()


@contextlib.contextmanager
def _reachable(server: StoreProcess):
    """``server`` with its ``env()`` set for the test; closed (and its state removed) after."""
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in server.env().items():
                mp.setenv(k, v)
            yield server
    finally:
        server.close()


@pytest.fixture
def s3_process(tmp_path):
    """An :class:`S3Process` (empty), with the AWS_* variables that reach it set for the test."""
    with _reachable(S3Process(tmp_path / "s3_state")) as server:
        yield server


@pytest.fixture
def gcs_process(tmp_path):
    """A :class:`GCSProcess` (empty), with the variables that make gcsfs reach it set for the test."""
    with _reachable(GCSProcess(tmp_path / "gcs_state")) as server:
        yield server


@pytest.fixture
def http_process():
    """``serve(root)`` → a running :class:`HTTPProcess` on ``root``; every one is killed at the end."""
    servers: list[HTTPProcess] = []

    def serve(root: Path) -> HTTPProcess:
        servers.append(HTTPProcess(root))
        return servers[-1]

    yield serve
    for server in servers:
        server.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a test server in this process (see ServerProcess)")
    parser.add_argument("kind", choices=["s3", "gcs", "http"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--state", type=Path, help="s3: the objects to start with, as <bucket>/<key> files; "
                        "gcs: the emulator's storage directory")
    parser.add_argument("--root", type=Path, help="http: the directory served")
    args = parser.parse_args()
    if args.kind == "s3":
        _serve_s3(args.port, args.state)
    elif args.kind == "gcs":
        _serve_gcs(args.port, args.state)
    else:
        _serve_http(args.port, args.root)
