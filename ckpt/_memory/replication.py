"""Peer replication of the memory tier: after a rank step is published in this rank's
segment, a background thread sends it to the same local rank on the next ``replicas`` nodes of
a ring by node, which store it as ``ckpt-<job>-<their node>-replica-r<origin>``.

TCP, one connection per step and peer, on which both sides first prove that they hold the
job's key (``ckpt/_memory/replica_wire.py``); the receiver (``ckpt/_memory/replica_receiver.py``)
listens on the address the job advertises and gives nothing to a connection before that. A dead
or slow peer costs a timeout on the sender thread and a counted failure, never a training
step, and leaves no collective half done. The job's own gloo group would need no server, but
a gloo send or recv on a background thread cannot be cancelled or given a deadline of its own,
and a failed one can poison the group the restore needs (docs/elastic.md, "What crosses the
network"). The receiver publishes a replica by renaming its staging directory, so a replica is
whole or absent; the digests in ``rank.json`` are checked when it is loaded.

Every generation the segment keeps is sent, oldest first: a restore that finds the newest
step bad falls back to the one before it, and after losing a node that step exists only in
the replicas. So the steps waiting to be sent are the newest ``keep`` (an older one is
superseded: neither the segment nor the receiver would keep it), and a step saved below a
waiting one (the job went back to an older line of training) supersedes those above it.
Sending only the newest step waiting would be fresher by one save when saves outpace the
network, but then a burst of saves leaves the receiver with other generations than the
segment (steps 0 and 4 replicated while the segment keeps 2 and 4): step 2, the fallback,
would be in memory on no live node.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Iterator

from ckpt._memory import replica_wire as wire
from ckpt._memory.replica_receiver import ReplicaReceiver
from ckpt._memory.tier import RANK_DOC

log = logging.getLogger("ckpt")


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
    """This rank's replication: a sender thread for its own steps, a receiver for peers'.

    Args:
        shm_dir, job, node: where replica segments go and how they are named.
        keep: replica generations kept per origin rank; also the most steps of this rank
            waiting to be sent.
        budget: the most bytes one origin's replica segment may hold (None: what fits in
            ``shm_dir``).
        timeout: seconds a connect, the header, or each block of a step may take.
        count: called with "replicated", "failed" or "superseded" (metrics).
        host: the address to listen on and advertise (default :func:`advertised_host`).
        auth_timeout, connections: see :class:`ReplicaReceiver`.
    """

    def __init__(self, *, shm_dir: str, job: str, node: str, keep: int,
                 budget: int | None = None, timeout: float = 60.0,
                 count: Callable[[str], None] | None = None, host: str | None = None,
                 auth_timeout: float = 10.0, connections: int = 8) -> None:
        self.job, self.timeout, self.keep = job, timeout, keep
        self._count = count or (lambda what: None)
        self._key = b""
        self.targets: list[tuple[str, int]] = []
        self.receiver = ReplicaReceiver(
            host=host or advertised_host(), shm_dir=shm_dir, job=job, node=node, keep=keep,
            budget=budget, timeout=timeout, auth_timeout=auth_timeout,
            connections=connections, count=self._count)
        self.address = self.receiver.address
        self.hold = self.receiver.hold  # a test seam: clear() holds received replicas
        self._lock = threading.Condition()
        # The steps waiting to be sent, oldest first: (step, step dir, origin).
        self._pending: collections.deque[tuple[int, str, int]] = collections.deque()
        self._busy = False
        self._sending: str | None = None  # the step directory being sent
        self._closed = False
        self._thread = threading.Thread(target=self._send_loop, name="ckpt-replica-send",
                                        daemon=True)
        self._thread.start()

    def connect(self, targets: list[tuple[str, int]], secret: str) -> None:
        """Where this rank's steps go, and the job's key (hex) that both sides prove."""
        self.targets, self._key = targets, wire.key_of(secret)
        self.receiver.set_key(self._key)

    # -- sending --------------------------------------------------------------------------
    def submit(self, step: int, step_path: str, origin: int) -> None:
        """Queue ``step`` (its directory in this rank's segment) for the peers; returns at
        once. Waiting steps numbered ``step`` or above (a line of training the job left), and
        those beyond the newest ``keep``, are superseded."""
        if not self.targets:
            return
        with self._lock:
            dropped = [job for job in self._pending if job[0] >= step]
            kept = [job for job in self._pending if job[0] < step]
            while len(kept) >= self.keep:
                dropped.append(kept.pop(0))
            for job in dropped:
                self._count("superseded")
                log.info("ckpt._memory.replication step=%d superseded by step=%d", job[0],
                         step)
            self._pending = collections.deque([*kept, (step, step_path, origin)])
            self._lock.notify_all()

    def reading(self, step_path: str) -> bool:
        """Whether ``step_path`` (a step directory of this rank's segment) is being sent: its
        files must stay as they are until it is done. (A step still waiting is opened by
        path when its turn comes: retired before that, it is gone, not read.)"""
        with self._lock:
            return self._sending == step_path

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or being sent; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending and not self._busy, timeout)

    def went_back(self, step: int, wait: float = 10.0) -> None:
        """The job went back to ``step``: the steps above it waiting to be sent are
        superseded, and the one being sent is waited for (up to ``wait`` seconds: a dead
        peer is not worth more), so that no step of the line the job left arrives at a peer
        after this returns."""
        with self._lock:
            for job in [job for job in self._pending if job[0] > step]:
                self._pending.remove(job)
                self._count("superseded")
                log.info("ckpt._memory.replication step=%d superseded: the job went back to "
                         "step %d", job[0], step)
        if not self.drain(wait):
            log.warning("ckpt._memory.replication went back to step %d while a step was still "
                        "being sent after %.0f s; a peer may keep it until the next save",
                        step, wait)

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return
                job = self._pending.popleft()
                self._busy, self._sending = True, job[1]
            try:
                # Every file is opened before a byte is sent: a step the segment retires
                # meanwhile (renamed aside, then deleted) is still read whole from them.
                with _open_step(job[1]) as step_files:
                    for target in self.targets:
                        try:
                            self._send(target, job[0], job[2], *step_files)
                            self._count("replicated")
                        except Exception as e:  # a dead or slow peer must never fail a save
                            self._count("failed")
                            log.warning("ckpt._memory.replication step=%d to %s:%d failed: %s",
                                        job[0], target[0], target[1], e)
            except FileNotFoundError:  # the segment let it go before its turn: none keeps it
                self._count("superseded")
                log.info("ckpt._memory.replication step=%d was retired before it was sent",
                         job[0])
            except OSError as e:
                self._count("failed")
                log.warning("ckpt._memory.replication step=%d cannot be read: %s", job[0], e)
            with self._lock:
                self._busy, self._sending = False, None
                self._lock.notify_all()

    def _send(self, target: tuple[str, int], step: int, origin: int, doc: bytes,
              files: list[tuple[str, int, Any]]) -> None:
        header = json.dumps({"origin": origin, "step": step,
                             "files": [(name, size) for name, size, _ in files],
                             "doc": len(doc),
                             "doc_sha256": hashlib.sha256(doc).hexdigest()}).encode()
        with socket.create_connection(target, timeout=self.timeout) as sock:
            nonces = wire.sender_handshake(sock, self._key, self.job,
                                           time.monotonic() + self.timeout)
            sock.settimeout(self.timeout)
            sock.sendall(wire.header_frame(self._key, nonces, header))
            for name, size, f in files:
                if sock.sendfile(f, 0, size) != size:
                    raise OSError(f"{name} changed while it was sent")
            sock.sendall(doc)
            reply = wire.recv_exact(sock, 2, time.monotonic() + self.timeout)
        if reply != b"OK":
            raise OSError(f"the peer refused step {step}")

    # -- lifetime -----------------------------------------------------------------------------
    def close(self, drain: float = 0.0, remove_upto: int | None = None) -> None:
        """Stop (after up to ``drain`` seconds for the step being sent); release the replica
        segments, removing those whose newest step is <= ``remove_upto`` (persisted)."""
        if drain:
            self.drain(drain)
        with self._lock:
            self._closed = True
            self._pending.clear()
            self._lock.notify_all()
        self.receiver.close(remove_upto, wait=drain)


@contextlib.contextmanager
def _open_step(path: str) -> Iterator[tuple[bytes, list[tuple[str, int, Any]]]]:
    """A step directory's ``rank.json`` and its data files, opened: (the document, [(name,
    size, file)]). FileNotFoundError: the step is no longer there."""
    with contextlib.ExitStack() as stack:
        with open(os.path.join(path, RANK_DOC), "rb") as f:
            doc = f.read()
        files = []
        for name in sorted(n for n in os.listdir(path) if n != RANK_DOC):
            f = stack.enter_context(open(os.path.join(path, name), "rb"))
            files.append((name, os.fstat(f.fileno()).st_size, f))
        yield doc, files
