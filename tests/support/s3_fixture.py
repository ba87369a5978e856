"""A live S3 endpoint for tests: moto's server on 127.0.0.1, and a fresh bucket per test.

Import the fixtures into a test module (``from tests.s3_fixture import s3``):

* ``s3``: a bucket on a server shared by the session (starting one costs about a second);
* ``s3_restartable``: a bucket on a server of its own, which the test may ``stop()`` and
  ``start()`` again on the same port. moto keeps its state in this process, so the bucket and
  its objects survive the restart, as they would on real S3. Clients reach that server
  through a TCP relay that ``stop()`` closes first, dropping every connection at that instant
  (moto's own shutdown keeps serving for up to half a second: too late to cut an upload).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import uuid
from dataclasses import dataclass, field
from typing import Iterator

import pytest

REGION = "us-east-1"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Relay:
    """Forwards loopback TCP connections from ``port`` to ``target``; ``stop`` cuts them all."""

    def __init__(self, port: int, target: int) -> None:
        self.port, self.target = port, target
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.05)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while self._listener is listener:
            try:
                client, _ = listener.accept()
            except (socket.timeout, OSError):
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


class LoopbackS3:
    """What tests use of an S3 endpoint on a loopback ``port`` with a ``bucket`` on it."""

    port: int
    bucket: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict:
        """What s3fs (and the tensorstore backend) need to reach this endpoint."""
        return {"client_kwargs": {"endpoint_url": self.url}}

    def root(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}"

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name=REGION)


@dataclass
class S3Endpoint(LoopbackS3):
    """A moto S3 server on a loopback port and one bucket on it."""

    port: int
    bucket: str = ""
    _server: object = field(default=None, repr=False)
    _relay: _Relay | None = field(default=None, repr=False)


    def keys(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix`` in the bucket, sorted (straight from the server)."""
        pages = self.client().get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        port = self._relay.target if self._relay is not None else self.port
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self._server.start()
        if self._relay is not None:
            self._relay.start()

    def stop(self) -> None:
        """Stop the server; with a relay, every connection drops at once."""
        if self._relay is not None:
            self._relay.stop()
        if self._server is not None:
            self._server.stop()
            self._server = None

    @property
    def running(self) -> bool:
        return self._server is not None

    def create_bucket(self) -> None:
        self.bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=self.bucket)

    def drop_bucket(self) -> None:
        client = self.client()
        for key in self.keys():
            client.delete_object(Bucket=self.bucket, Key=key)
        client.delete_bucket(Bucket=self.bucket)


@pytest.fixture(scope="session")
def _moto():
    """moto's server for the whole session, with fake credentials in the environment."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request
    with pytest.MonkeyPatch.context() as mp:
        for name, value in AWS_ENV.items():
            mp.setenv(name, value)
        mp.delenv("AWS_PROFILE", raising=False)
        mp.delenv("AWS_ENDPOINT_URL", raising=False)
        server = S3Endpoint(_free_port())
        server.start()
        yield server
        server.stop()


@pytest.fixture
def s3(_moto) -> S3Endpoint:
    """A fresh bucket on the session's moto server."""
    endpoint = S3Endpoint(_moto.port)  # holds no server handle: stop() does nothing
    endpoint.create_bucket()
    yield endpoint
    endpoint.drop_bucket()


@pytest.fixture
def s3_restartable(_moto) -> S3Endpoint:
    """A fresh bucket on a moto server of its own, which the test may stop and start."""
    port, target = _free_port(), _free_port()
    while target == port:
        target = _free_port()
    endpoint = S3Endpoint(port, _relay=_Relay(port, target))
    endpoint.start()
    try:
        endpoint.create_bucket()
        yield endpoint
    finally:
        if not endpoint.running:
            endpoint.start()
        try:  # moto's state is process-wide, shared with the session's server
            endpoint.drop_bucket()
        finally:
            endpoint.stop()


@contextlib.contextmanager
def store_responses() -> Iterator[dict[str, int]]:
    """Count, in this process, what the object store's responses to ranged reads carried
    (``bytes``: whole blocks of the storage's read cache included) and the ranges read
    past that cache (``ranges``), independently of the storage's own count."""
    from storage_backends.fsspec_store import FsspecStorage

    counts = {"bytes": 0, "ranges": 0}
    real_range, real_ranges = FsspecStorage._range, FsspecStorage._cat_ranges

    def counted_range(self, *args):
        data = real_range(self, *args)
        counts["bytes"] += len(data)
        return data

    def counted_ranges(self, full, starts, ends):
        pieces = real_ranges(self, full, starts, ends)
        counts["bytes"] += sum(len(p) for p in pieces)
        counts["ranges"] += len(starts)
        return pieces

    FsspecStorage._range, FsspecStorage._cat_ranges = counted_range, counted_ranges
    try:
        yield counts
    finally:
        FsspecStorage._range, FsspecStorage._cat_ranges = real_range, real_ranges
