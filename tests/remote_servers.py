"""Real object-store servers over a socket for the remote-shard tests: a moto S3 server and a small
HTTP server with Range support that can fail on purpose (5xx answers, or down for a while).

Fixtures live here and are imported explicitly by the test modules that use them
(``from tests.remote_servers import s3, s3_server, http_server``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
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
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        else:
            body = data
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self.wfile.write(body)


class _FileServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: RangeHTTPServer


class RangeHTTPServer:
    """Serves ``root`` over HTTP/1.1 with ``Range: bytes=a-b`` (206 + Content-Range) and HEAD sizes.

    ``fail(n, status)`` answers the next ``n`` requests with ``status``; ``stop()`` / ``start()``
    take it down and bring it back on the same port; ``restart_after(seconds)`` does both, later.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.lock = threading.Lock()
        self.fail_next = 0
        self.fail_status = 503
        self.requests = self.failed = self.ranged = 0
        self.connections: set[socket.socket] = set()  # open (keep-alive) connections, closed by stop()
        self.port = 0
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

    def restart_after(self, seconds: float) -> threading.Thread:
        self.stop()
        thread = threading.Timer(seconds, self.start)
        thread.start()
        return thread

    def fail(self, n: int, status: int = 503) -> None:
        with self.lock:
            self.fail_next, self.fail_status = n, status

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
        server.stop()

