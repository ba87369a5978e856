"""The replica receiver: stores the steps that peers of this job send to this rank (the wire is
``ckpt/_memory/replica_wire.py``), and gives nothing to a connection before it authenticates.

What a connection costs before it proves it holds the job's key: a handler thread out of
``connections`` (an excess connection is closed at once, so a flood never makes threads), 40
bytes sent, 64 bytes read, within ``auth_timeout`` seconds of its accept in all (a peer that
trickles is dropped at that deadline). Nothing is allocated for what it announces and nothing
is parsed: the header's length, the header (at most ``HEADER_MAX``) and its JSON come only
after the handshake, and no directory exists for a peer before then.

An authenticated peer is one of the job's ranks; still, what it sends is bounded: one
transfer at a time per origin rank (the next one waits up to ``RESERVE_WAIT`` seconds for it
to end, then is refused: a peer that holds a transfer open delays it no longer, and a waiting
connection holds only its handler thread), each checked before a byte is stored against the
origin's budget (its replica segment's bytes plus the step's announced size, at most
``budget``) and against the free space of ``shm_dir`` less what the transfers in flight have
reserved; each 1 MiB block must arrive within ``timeout`` seconds; a replica is published by
renaming its staging directory (whole or absent); only the newest ``keep`` generations per
origin are kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import socket
import threading
import time
from typing import Any, Callable

from ckpt.errors import CheckpointError
from ckpt._format.names import step_dir
from ckpt._memory import replica_wire as wire
from ckpt._memory.private import segment_names
from ckpt._memory.tier import (RANK_DOC, STAGING, commit_dir, node_prefix, own_segment,
                               plain_name, rank_steps, replica_name, retire_rank_steps,
                               tree_bytes, write_private)

log = logging.getLogger("ckpt")

_BLOCK = 1 << 20
#: Seconds an origin's step waits for the end of its previous one before it is refused.
RESERVE_WAIT = 5.0
# A replica's files: new (a duplicate name in a header fails), never through a link, 0600.
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class ReplicaReceiver:
    """A TCP server for peers' replicas, bound to ``host`` (the address the job advertises).

    Args:
        host: the address to listen on (and that peers are given).
        shm_dir, job, node: where replica segments go and how they are named.
        keep: replica generations kept per origin rank.
        budget: the most bytes one origin's replica segment may hold (None: what fits).
        timeout: seconds a header, and each block of data, may take to arrive.
        auth_timeout: seconds from accept within which a connection must authenticate.
        connections: connections handled at once; more are closed on arrival.
        count: called with "failed" when a connection does not deliver a replica.
    """

    def __init__(self, *, host: str, shm_dir: str, job: str, node: str, keep: int,
                 budget: int | None, timeout: float, auth_timeout: float = 10.0,
                 connections: int = 8, count: Callable[[str], None] | None = None) -> None:
        self.shm_dir, self.job, self.node, self.keep = shm_dir, job, node, keep
        self.budget, self.timeout, self.auth_timeout = budget, timeout, auth_timeout
        self.key = b""  # set by set_key() (the replicator's connect())
        self._keyed = threading.Event()
        self._count = count or (lambda what: None)
        try:
            self._server = socket.create_server((host, 0))
        except OSError as e:
            raise CheckpointError(
                f"the replica receiver cannot listen on {host}, the address this rank gives "
                f"its peers ({e}); set CKPT_REPLICA_HOST to an address of this host that the "
                "other nodes reach, or pass MemoryTierOptions(replicas=0)") from e
        self.address = (host, self._server.getsockname()[1])
        # A test seam: clear() holds authenticated replicas before they are stored.
        self.hold = threading.Event()
        self.hold.set()
        self._slots = threading.BoundedSemaphore(connections)
        self._lock = threading.Condition()  # also signals a transfer's end (close waits)
        self._conns: set[socket.socket] = set()  # authenticated connections (close ends them)
        self._owners: dict[int, Any] = {}
        self._reserved: dict[int, int] = {}  # origin -> bytes of its transfer in flight
        # How long an origin's step waits for its previous one to end (_reserve), and how
        # many connections wait so (a test seam).
        self.reserve_wait, self.waiting = RESERVE_WAIT, 0
        self._closed = False
        self._refused = 0  # connections refused before they authenticated
        self._thread = threading.Thread(target=self._accept, name="ckpt-replica-recv",
                                        daemon=True)
        self._thread.start()

    def set_key(self, key: bytes) -> None:
        """The job's key. A connection that arrives before it waits for it, within its
        deadline: the job's ranks get the key at about the same time, and one may send its
        first step before this one has the key (no key by the deadline: refused)."""
        self.key = key
        self._keyed.set()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._server.accept()
            except OSError as e:
                if self._closed:
                    return
                # Out of descriptors, or a connection reset before it was accepted: not
                # the end of the receiver.
                log.warning("ckpt._memory.replication accepting a connection failed: %s", e)
                time.sleep(0.1)
                continue
            if not self._slots.acquire(blocking=False):
                conn.close()  # over the limit: costs the peer a connect, us no thread
                self._refuse(peer, "over the limit of connections handled at once")
                continue
            try:
                threading.Thread(target=self._receive, args=(conn, peer),
                                 name="ckpt-replica-store", daemon=True).start()
            except RuntimeError as e:  # no thread to be had: this connection is refused
                self._slots.release()
                conn.close()
                self._refuse(peer, f"no handler thread ({e})")

    def _receive(self, conn: socket.socket, peer: Any) -> None:
        try:
            with conn:
                deadline = time.monotonic() + self.auth_timeout
                try:
                    if not self._keyed.wait(max(0.0, deadline - time.monotonic())):
                        raise PermissionError("no key yet: refused")
                    nonces = wire.receiver_handshake(conn, self.key, self.job, deadline)
                except (OSError, PermissionError) as e:
                    self._refuse(peer, str(e))
                    return
                with self._lock:
                    self._conns.add(conn)
                try:
                    self._authenticated(conn, nonces)
                    conn.sendall(b"OK")
                except Exception as e:
                    self._count("failed")
                    # Ended by close() (the job is done with its replicas): no fault.
                    (log.info if self._closed else log.warning)(
                        "ckpt._memory.replication receiving from %s failed: %s", peer[0], e)
                finally:
                    with self._lock:
                        self._conns.discard(conn)
                        self._lock.notify_all()
        finally:
            self._slots.release()

    def _refuse(self, peer: Any, why: str) -> None:
        """Log a connection refused before it authenticated: not counted as a failed replica
        (anyone who can connect could inflate the count), and logged sparingly, so that a
        flood of connections does not flood the log: the first ten, then every thousandth."""
        with self._lock:
            self._refused += 1
            n = self._refused
        if n <= 10 or n % 1000 == 0:
            log.warning("ckpt._memory.replication refused a connection from %s (%d so far): "
                        "%s", peer[0], n, why)

    def _authenticated(self, conn: socket.socket, nonces: bytes) -> None:
        """Steps 4 and 5 of the wire, from a peer that holds the job's key."""
        header = wire.recv_header(conn, self.key, nonces, time.monotonic() + self.timeout)
        head = json.loads(header)
        origin, step = _int(head["origin"]), _int(head["step"])
        files = [(_plain(name), _int(size)) for name, size in head["files"]]
        doc_size, doc_sha = _int(head["doc"]), head["doc_sha256"]
        need = sum(size for _, size in files) + doc_size
        segment = os.path.join(self.shm_dir, replica_name(self.job, self.node, origin))
        self._reserve(segment, origin, step, need)
        try:
            self.hold.wait()
            self._store(conn, segment, origin, step, files, doc_size, doc_sha)
        finally:
            with self._lock:
                self._reserved.pop(origin, None)
                self._lock.notify_all()  # the origin's next step may be waiting (_reserve)

    def _reserve(self, segment: str, origin: int, step: int, need: int) -> None:
        """Book ``need`` bytes for ``origin``'s step, or raise (OSError) when one of its steps
        is still arriving after ``reserve_wait`` seconds, or it would pass its budget or the
        room left in ``shm_dir``. (The wait covers a transfer that failed on the sender's
        side while its end here is still being cleaned up: the sender's next step must not
        be refused for it. It is short, so a peer that keeps a transfer open only delays the
        origin's next step by that much before it is refused, as before.)"""
        with self._lock:
            if origin in self._reserved and not self._closed:
                self.waiting += 1
                try:
                    self._lock.wait_for(lambda: origin not in self._reserved or self._closed,
                                        self.reserve_wait)
                finally:
                    self.waiting -= 1
            if self._closed:
                raise OSError("closed")
            if origin in self._reserved:
                raise OSError(f"a step of rank {origin} is arriving already (waited "
                              f"{self.reserve_wait:g} s)")
            if self.budget is not None:
                held = tree_bytes(segment)
                if held + need > self.budget:
                    raise OSError(f"{segment} would exceed the memory budget ({self.budget}) "
                                  f"with step {step} ({need} bytes; it holds {held})")
            st = os.statvfs(self.shm_dir)
            free = st.f_bavail * st.f_frsize - sum(self._reserved.values())
            if need > free:
                raise OSError(f"{self.shm_dir} has no room for step {step} of rank {origin} "
                              f"({need} bytes, {max(0, free)} free)")
            if origin not in self._owners:
                self._owners[origin] = own_segment(segment)
            self._reserved[origin] = need

    def _store(self, conn: socket.socket, segment: str, origin: int, step: int,
               files: list[tuple[str, int]], doc_size: int, doc_sha: Any) -> None:
        staging = os.path.join(segment, f"{STAGING}{step_dir(step)}-{secrets.token_hex(6)}")
        os.mkdir(staging, 0o700)
        try:
            for name, size in files:
                with os.fdopen(os.open(os.path.join(staging, name), _CREATE, 0o600), "wb") as f:
                    _copy(conn, f, size, self.timeout)
            doc = wire.recv_exact(conn, doc_size, time.monotonic() + self.timeout)
            if hashlib.sha256(doc).hexdigest() != doc_sha:
                raise ValueError("rank.json is not the one the header names")
            parsed = json.loads(doc)
            if parsed.get("step") != step or parsed.get("rank") != origin:
                raise ValueError("rank.json names another step or rank")
            write_private(os.path.join(staging, RANK_DOC), doc)
            commit_dir(staging, os.path.join(segment, step_dir(step)))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        retire_rank_steps(segment, self.keep, step)  # the new line's, not those it left
        log.info("ckpt._memory.replication stored step=%d of rank=%d in %s", step, origin, segment)

    def drop_above(self, step: int) -> list[str]:
        """Remove the replicated steps above ``step`` (a line of training the job went back
        from) from this node's replica segments: those this receiver holds, and those no live
        process holds (left by an earlier attempt of the job: a restart would find them; each
        is held only while its steps are renamed aside). Returns the steps' paths."""
        with self._lock:
            mine = {os.path.dirname(owner.name) for owner in self._owners.values()}
        gone, asides = [], []
        for name in segment_names(self.shm_dir, f"{node_prefix(self.job, self.node)}replica-"):
            segment = os.path.join(self.shm_dir, name)
            owner = None
            if segment not in mine:
                try:
                    owner = own_segment(segment, wait=0.0)
                except (CheckpointError, OSError):  # another rank's receiver holds it
                    continue
            try:
                for s in rank_steps(segment):
                    if s > step:
                        path = os.path.join(segment, step_dir(s))
                        aside = os.path.join(segment, f"{STAGING}gone-{step_dir(s)}-"
                                                      f"{secrets.token_hex(6)}")
                        try:  # the step stops existing in one rename
                            os.rename(path, aside)
                        except FileNotFoundError:
                            continue
                        gone.append(path)
                        asides.append(aside)
            finally:
                if owner is not None:
                    owner.close()
        for aside in asides:
            shutil.rmtree(aside, ignore_errors=True)
        return gone

    def close(self, remove_upto: int | None = None, wait: float = 0.0) -> None:
        """Stop listening; let the steps arriving finish for up to ``wait`` seconds, then end
        their connections; release the replica segments, removing those whose newest step
        is <= ``remove_upto`` (persisted). A segment is never removed under a transfer into
        it (it would fail on its vanished staging directory)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()  # a step waiting for its origin's previous one: refused
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone may not)
        except OSError:
            pass
        self._server.close()
        self.hold.set()
        self._keyed.set()  # connections waiting for a key: refused now (none was set)
        with self._lock:
            self._lock.wait_for(lambda: not self._conns, wait)
            for conn in self._conns:  # a slow or stalled peer: its transfer ends now
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            # Each ends at its next read and removes its staging directory.
            self._lock.wait_for(lambda: not self._conns, 5.0)
            owners, self._owners = self._owners, {}
            busy = set(self._reserved)
        for origin, owner in owners.items():
            segment = os.path.dirname(owner.name)
            steps = rank_steps(segment)
            if remove_upto is not None and origin not in busy and (
                    not steps or steps[-1] <= remove_upto):
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


def _copy(sock: socket.socket, f: Any, size: int, timeout: float) -> None:
    """``size`` bytes from ``sock`` into ``f``, each block within ``timeout`` seconds."""
    buf = bytearray(min(size, _BLOCK) or 1)
    view, left = memoryview(buf), size
    while left:
        want = min(left, len(buf))
        deadline, got = time.monotonic() + timeout, 0
        while got < want:
            wire.arm(sock, deadline)
            k = sock.recv_into(view[got:want])
            if not k:
                raise ConnectionError(f"the peer closed the connection {left - got} bytes "
                                      "early")
            got += k
        f.write(view[:want])
        left -= want
