"""Peer replication of the memory tier: after a rank step is published in this rank's
segment, a background thread sends it to the same local rank on the next ``replicas`` nodes of
a ring by node, which store it as ``ckpt-<job>-<their node>-replica-r<origin>``.

Plain TCP, one connection per step and peer: a dead or slow peer costs a timeout on the sender
thread and a counted failure, never a training step, and leaves no collective half done
(a background gloo recv cannot be cancelled, and a failed one can poison the group). The newest
step supersedes one still waiting to be sent. Each connection carries the job's secret
(exchanged at start-up through the process group), the step's file names and sizes, the files,
and ``rank.json`` last; the receiver publishes the replica by renaming its staging directory,
so a replica is whole or absent; the digests in ``rank.json`` are checked when it is loaded.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import shutil
import socket
import struct
import threading
from typing import Any, Callable

from ckpt._format.names import step_dir
from ckpt._memory.tier import (RANK_DOC, STAGING, commit_dir, own_segment, plain_name,
                          rank_steps, replica_name, retire_rank_steps, tree_bytes)

log = logging.getLogger("ckpt")

_HEADER_MAX = 64 << 20
_BLOCK = 1 << 20


def new_secret() -> str:
    return secrets.token_hex(16)


def advertised_host() -> str:
    """The address peers reach this process at: CKPT_REPLICA_HOST, else the interface that
    routes to torchrun's MASTER_ADDR, else the default route's, else the hostname's. A
    loopback address is a last resort (on the master's own host MASTER_ADDR often resolves to
    one, which no other host can reach)."""
    host = os.environ.get("CKPT_REPLICA_HOST")
    if host:
        return host
    found = []
    for target in (os.environ.get("MASTER_ADDR"), "10.255.255.255"):
        if target:
            try:  # a UDP connect sends nothing: it only picks the outgoing interface
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    s.connect((target, 9))
                    found.append(s.getsockname()[0])
            except OSError:
                pass
    try:
        found.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    return next((a for a in found if not a.startswith("127.")), found[0] if found
                else "127.0.0.1")


def ring_targets(me: int, nodes: list[str], local_ranks: list[int], replicas: int) -> list[int]:
    """The ranks that hold ``me``'s replicas: the same local rank (or, where that node has
    fewer ranks, one of them) on each of the next ``replicas`` nodes, ordered by node name."""
    order = sorted(set(nodes))
    mine = order.index(nodes[me])
    out = []
    for k in range(1, min(replicas, len(order) - 1) + 1):
        node = order[(mine + k) % len(order)]
        there = sorted((local_ranks[r], r) for r in range(len(nodes)) if nodes[r] == node)
        out.append(next((r for lr, r in there if lr == local_ranks[me]),
                        there[local_ranks[me] % len(there)][1]))
    return out


class Replicator:
    """This rank's replication: a sender thread for its own steps, a TCP server for peers'.

    Args:
        shm_dir, job, node: where replica segments go and how they are named.
        keep: replica generations kept per origin rank.
        budget: the most bytes one replica segment may hold (None: what fits in ``shm_dir``).
        timeout: seconds any one connect/send/receive may take.
        count: called with "replicated", "failed" or "superseded" (metrics).
    """

    def __init__(self, *, shm_dir: str, job: str, node: str, keep: int,
                 budget: int | None = None, timeout: float = 60.0,
                 count: Callable[[str], None] | None = None) -> None:
        self.shm_dir, self.job, self.node, self.keep = shm_dir, job, node, keep
        self.budget = budget
        self.timeout = timeout
        self._count = count or (lambda what: None)
        self.secret = ""
        self.targets: list[tuple[str, int]] = []
        self._server = socket.create_server(("", 0))
        self.address = (advertised_host(), self._server.getsockname()[1])
        # A test seam: clear() holds received replicas before they are stored.
        self.hold = threading.Event()
        self.hold.set()
        self._owners: dict[int, Any] = {}
        self._lock = threading.Condition()
        self._pending: tuple[int, str, int] | None = None  # (step, step dir, origin)
        self._busy = False
        self._closed = False
        self._threads = [threading.Thread(target=self._accept, name="ckpt-replica-recv",
                                          daemon=True),
                         threading.Thread(target=self._send_loop, name="ckpt-replica-send",
                                          daemon=True)]
        for t in self._threads:
            t.start()

    def connect(self, targets: list[tuple[str, int]], secret: str) -> None:
        """Where this rank's steps go, and the job's shared secret."""
        self.targets, self.secret = targets, secret

    # -- sending --------------------------------------------------------------------------
    def submit(self, step: int, step_path: str, origin: int) -> None:
        """Queue ``step`` (its directory in this rank's segment) for the peers; returns at
        once. A step still waiting is replaced by this newer one."""
        if not self.targets:
            return
        with self._lock:
            if self._pending is not None:
                self._count("superseded")
                log.info("ckpt._memory.replication step=%d superseded by step=%d", self._pending[0],
                         step)
            self._pending = (step, step_path, origin)
            self._lock.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or being sent; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self._pending is None and not self._busy,
                                       timeout)

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                job, self._pending, self._busy = self._pending, None, True
            for target in self.targets:
                try:
                    self._send(target, *job)
                    self._count("replicated")
                except Exception as e:  # a dead or slow peer must never fail a save
                    self._count("failed")
                    log.warning("ckpt._memory.replication step=%d to %s:%d failed: %s", job[0],
                                target[0], target[1], e)
            with self._lock:
                self._busy = False
                self._lock.notify_all()

    def _send(self, target: tuple[str, int], step: int, path: str, origin: int) -> None:
        names = sorted(n for n in os.listdir(path) if n != RANK_DOC)
        files = [(n, os.path.getsize(os.path.join(path, n))) for n in names]
        with open(os.path.join(path, RANK_DOC), "rb") as f:
            doc = f.read()
        header = json.dumps({"secret": self.secret, "job": self.job, "origin": origin,
                             "step": step, "files": files, "doc": len(doc)}).encode()
        with socket.create_connection(target, timeout=self.timeout) as sock:
            sock.sendall(struct.pack("!Q", len(header)) + header)
            for name, size in files:
                with open(os.path.join(path, name), "rb") as f:
                    if sock.sendfile(f, 0, size) != size:
                        raise OSError(f"{name} changed while it was sent")
            sock.sendall(doc)
            reply = _recv_exact(sock, 2)
        if reply != b"OK":
            raise OSError(f"the peer refused step {step}")

    # -- receiving --------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._receive, args=(conn,), name="ckpt-replica-store",
                             daemon=True).start()

    def _receive(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self.timeout)
            try:
                (n,) = struct.unpack("!Q", _recv_exact(conn, 8))
                if n > _HEADER_MAX:
                    raise ValueError(f"a {n}-byte header")
                head = json.loads(_recv_exact(conn, n))
                if not (self.secret and hmac.compare_digest(str(head.get("secret")),
                                                            self.secret)):
                    raise PermissionError("a connection without the job's secret")
                origin, step = _int(head["origin"]), _int(head["step"])
                files = [(_plain(name), _int(size)) for name, size in head["files"]]
                self.hold.wait()
                self._store(conn, origin, step, files, _int(head["doc"]))
                conn.sendall(b"OK")
            except Exception as e:
                self._count("failed")
                log.warning("ckpt._memory.replication receiving failed: %s", e)

    def _store(self, conn: socket.socket, origin: int, step: int,
               files: list[tuple[str, int]], doc_size: int) -> None:
        segment = os.path.join(self.shm_dir, replica_name(self.job, self.node, origin))
        with self._lock:
            if self._closed:
                raise OSError("closed")
            if origin not in self._owners:
                self._owners[origin] = own_segment(segment)
        need = sum(size for _, size in files) + doc_size
        if self.budget is not None and tree_bytes(segment) + need > self.budget:
            raise OSError(f"{segment} would exceed the memory budget ({self.budget}) with step "
                          f"{step} ({need} bytes)")
        st = os.statvfs(self.shm_dir)
        if need > st.f_bavail * st.f_frsize:
            raise OSError(f"{self.shm_dir} has no room for step {step} of rank {origin} "
                          f"({need} bytes)")
        staging = os.path.join(segment, f"{STAGING}{step_dir(step)}-{secrets.token_hex(6)}")
        os.mkdir(staging)
        try:
            for name, size in files:
                with open(os.path.join(staging, name), "wb") as f:
                    _copy(conn, f, size)
            doc = _recv_exact(conn, doc_size)
            parsed = json.loads(doc)
            if parsed.get("step") != step or parsed.get("rank") != origin:
                raise ValueError("rank.json names another step or rank")
            with open(os.path.join(staging, RANK_DOC), "wb") as f:
                f.write(doc)
            commit_dir(staging, os.path.join(segment, step_dir(step)))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        retire_rank_steps(segment, self.keep)
        log.info("ckpt._memory.replication stored step=%d of rank=%d in %s", step, origin, segment)

    # -- lifetime -----------------------------------------------------------------------------
    def close(self, drain: float = 0.0, remove_upto: int | None = None) -> None:
        """Stop (after up to ``drain`` seconds for the step being sent); release the replica
        segments, removing those whose newest step is <= ``remove_upto`` (persisted)."""
        if drain:
            self.drain(drain)
        with self._lock:
            self._closed = True
            self._pending = None
            self._lock.notify_all()
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone may not)
        except OSError:
            pass
        self._server.close()
        self.hold.set()
        with self._lock:
            owners, self._owners = self._owners, {}
        for origin, owner in owners.items():
            segment = os.path.dirname(owner.name)
            steps = rank_steps(segment)
            if remove_upto is not None and (not steps or steps[-1] <= remove_upto):
                shutil.rmtree(segment, ignore_errors=True)
            owner.close()


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def _plain(name: Any) -> str:
    """A data file name of a step: plain (see ``plain_name``) and not the rank document."""
    if plain_name(name) == RANK_DOC:
        raise ValueError(f"{name!r} is not a plain data file name")
    return name


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _copy(sock: socket.socket, f: Any, size: int) -> None:
    buf = bytearray(min(size, _BLOCK) or 1)
    view, left = memoryview(buf), size
    while left:
        k = sock.recv_into(view[:min(left, len(buf))])
        if not k:
            raise ConnectionError(f"the peer closed the connection {left} bytes early")
        f.write(view[:k])
        left -= k
