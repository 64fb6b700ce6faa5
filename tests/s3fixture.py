"""A real S3 endpoint for tests: moto's server app on 127.0.0.1, in a thread of this process.

``MotoS3.stop()`` cuts the server the way a crash would (listening socket and open
connections closed); ``restart()`` brings it back on the same port with its data. moto's
``ThreadedMotoServer.stop()`` keeps the listening socket and keep-alive connections open,
so it is not used. ``FaultProxy`` sits in front of it and answers the first N requests with
an S3 error (503 SlowDown by default), to exercise retries against real HTTP.
"""

from __future__ import annotations

import contextlib
import datetime
import http.client
import logging
import socket
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import ThreadedWSGIServer

log = logging.getLogger(__name__)


class _CuttableServer(ThreadedWSGIServer):
    """werkzeug's threaded server that remembers open connections so stop() can cut them."""

    def __init__(self, *args: object, **kwargs: object):
        self.open_requests: set[socket.socket] = set()
        self._lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):  # type: ignore[no-untyped-def]
        with self._lock:
            self.open_requests.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):  # type: ignore[no-untyped-def]
        with self._lock:
            self.open_requests.discard(request)
        super().shutdown_request(request)

    def cut(self) -> None:
        with self._lock:
            victims = list(self.open_requests)
        for sock in victims:
            with contextlib.suppress(OSError):  # already closed by its handler
                sock.shutdown(socket.SHUT_RDWR)


class MotoS3:
    """moto's S3 server on ``host``; port 0 picks a free port, kept across restart()."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host, self.port = host, port
        self._server: _CuttableServer | None = None
        self._thread: threading.Thread | None = None
        self._client = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        if self._server is not None:
            return
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
        app = DomainDispatcherApplication(create_backend_app)
        server = _CuttableServer(self.host, self.port, app, handler=MotoRequestHandler)
        self.port = server.server_port
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        log.info("moto S3 server at %s", self.endpoint_url)

    def stop(self) -> None:
        """Cut the server: stop accepting, close the port and every open connection."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        server.cut()
        if self._thread is not None:
            self._thread.join(timeout=10)
        log.info("moto S3 server at %s stopped", self.endpoint_url)

    def restart(self) -> None:
        """Start again on the same port; moto keeps its buckets and objects in this process."""
        self.stop()
        self.start()

    def reset(self) -> None:
        """Forget every bucket and object (moto's reset API)."""
        req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=10) as reply:
            reply.read()

    def date_back(self, bucket: str, seconds: float) -> int:
        """Date every object of ``bucket`` ``seconds`` earlier in the server's own records (the
        server runs in this process): an object store's API cannot set a date back, and a test
        of a grace period must not wait it out. How many objects it dated back."""
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        found = s3_backends[DEFAULT_ACCOUNT_ID]["global"].buckets[bucket]
        keys = [k for name in list(found.keys) for k in found.keys.getlist(name)]
        parts = [p for upload in found.multiparts.values() for p in upload.parts.values()]
        for key in keys + parts:  # objects, and the parts of unfinished multipart uploads
            key.last_modified -= datetime.timedelta(seconds=seconds)
        return len(keys) + len(parts)

    def client(self):  # type: ignore[no-untyped-def]
        """A plain boto3 client on this server, for test set-up and inspection (made once)."""
        if self._client is None:
            import boto3

            self._client = boto3.client(
                "s3",
                endpoint_url=self.endpoint_url,
                aws_access_key_id="testing",
                aws_secret_access_key="testing",
                region_name="us-east-1",
            )
        return self._client


_ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
    "<Message>injected by the test proxy</Message><RequestId>fault</RequestId></Error>"
)
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-connection"}


class FaultProxy:
    """An HTTP proxy to ``target``: after ``after`` good requests, ``faults`` get ``status``."""

    def __init__(
        self, target: str, faults: int, status: int = 503, code: str = "SlowDown", after: int = 0
    ):
        self.target = urlsplit(target)
        self.faults, self.status, self.code, self.after = faults, status, code, after
        self.requests = 0
        self.faulted = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def _take_fault(self) -> bool:
        with self._lock:
            self.requests += 1
            if self.requests > self.after and self.faulted < self.faults:
                self.faulted += 1
                return True
            return False

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                log.debug("proxy: " + format, *args)

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        n = int(self.rfile.readline().split(b";")[0], 16)
                        if n == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(n)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _reply(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
                self.send_response(status)
                for name, value in headers:
                    if name.lower() not in _HOP and name.lower() != "content-length":
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _any(self) -> None:
                body = self._body()
                if proxy._take_fault():
                    xml = _ERROR_XML.format(code=proxy.code).encode()
                    self._reply(proxy.status, [("Content-Type", "application/xml")], xml)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(
                    proxy.target.hostname, proxy.target.port, timeout=30
                )
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    reply = conn.getresponse()
                    data = reply.read()
                    self._reply(reply.status, reply.getheaders(), data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        return Handler


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoS3]:
    """One moto S3 server for the whole session (a test that stops it must restart it)."""
    server = MotoS3()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server: MotoS3, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh, empty bucket on a freshly reset server, with test credentials in the env."""
    if not s3_server.running:
        s3_server.start()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("FSSPEC_S3_ENDPOINT_URL", s3_server.endpoint_url)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    s3_server.reset()
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=bucket)
    yield bucket
    if not s3_server.running:  # a fault test left it stopped
        s3_server.start()


__all__ = ["FaultProxy", "MotoS3", "s3_bucket", "s3_server"]
