"""The reader's side of the memory tier's peer protocol (the messages are described in
``ckpt/_memory/peer_server.py``): bytes a rank's load needs that another node holds,
received when the load reads them, straight into where the load wants them, so a restore
needs no buffer for them (new memory is dear: docs/design.md, "Memory tier across nodes").

A pass's first read from a holder asks it for a *round*: the holder posts a send of every
byte range this rank planned to read from it, cut into pieces of ``piece`` bytes (the block a
one-pass load reads and digests at once), and gloo moves each piece as soon as the reader
posts its receive, with no Python in between: into the live tensor (``read_into``), or, for a
verify pass (``read_blocks``), into two reused buffers per thread, one arriving while the
other is digested. A read of anything but whole pieces asks for the rest alone.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import threading
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ckpt._memory.peer_server import APPLY, DONE, READ, REQUEST_TAG, ROUND, VERIFY, round_keys

#: The loader's block (and a round's piece) when a rank reads from peers: fewer, larger
#: messages, each a wait for a peer (measured faster).
PEER_BLOCK = 4 << 20
_TAGS = itertools.count(1)  # data tags of this process (REQUEST_TAG is 0)
_TAG_LOCK = threading.Lock()


def _fresh_tags(n: int) -> int:
    """The first of ``n`` consecutive data tags never used in this process (never reused: a
    message of an attempt that failed half-way is never taken for one of a later attempt)."""
    with _TAG_LOCK:
        base = next(_TAGS)
        for _ in range(n - 1):
            next(_TAGS)
    return base


class PeerClient:
    """This rank's reads of the bytes it planned to take from peers.

    Args:
        pg: the memory group's gloo group.
        requests: holder -> [(segment, file, start, length)], the planned ranges in the
            order the holder numbers them.
        location: the step's directory (storage paths are ``<location>/<file>``).
        url: names the save in errors.
        rounds: holder -> how many of its planned ranges (the first ones) a round sends
            (default: all); the others are those a node-mate fetches for this rank
            (``ckpt/_memory/sharing.py``), asked for alone only if that sharing fails.
    """

    def __init__(self, pg: Any, requests: dict[int, list[tuple[str, str, int, int]]],
                 location: str, url: str, rounds: dict[int, int] | None = None) -> None:
        self.url = url
        self._in_round = {h: (rounds or {}).get(h, len(r)) for h, r in requests.items()}
        self.piece = PEER_BLOCK
        self.holders: set[int] = set(requests)  # the peers this rank reads from
        # (path, start) -> (holder, index of the range, length)
        self.remote: dict[tuple[str, int], tuple[int, int, int]] = {}
        for holder, reqs in requests.items():
            for index, (_, name, start, length) in enumerate(reqs):
                self.remote[(f"{location}/{name}", start)] = (holder, index, length)
        self._pg = pg
        self._index: dict[str, tuple[tuple, tuple]] = {}  # path -> (starts, remote's)
        self._lengths: dict[int, list[int]] = {}  # holder -> length of each planned range
        self._index_remote()
        self._pieces = threading.local()
        self._rounds: dict[tuple[int, int], dict] = {}  # (holder, kind) -> key -> (tag, n)
        self._unread: dict[tuple[int, int], int] = {}  # (holder, tag) -> bytes, sent, not read
        self._round_lock = threading.Lock()

    def _index_remote(self) -> None:
        """Index ``remote`` by file and holder."""
        by_path: dict[str, list] = {}
        for (path, start), (holder, index, n) in self.remote.items():
            by_path.setdefault(path, []).append((start, (holder, index, n)))
            lengths = self._lengths.setdefault(holder, [])
            lengths += [0] * (index + 1 - len(lengths))
            lengths[index] = n
        self._index = {path: (tuple(s for s, _ in sorted(v)), tuple(f for _, f in sorted(v)))
                       for path, v in by_path.items()}

    def planned_length(self, path: str, start: int) -> int:
        """The length of the planned range at ``start`` of ``path`` (0: none starts there)."""
        return self.remote.get((path, start), (0, 0, 0))[2]

    # -- reading ----------------------------------------------------------------------------
    def read_into(self, path: str, start: int, out: memoryview) -> None:
        """Bytes [start, start + len(out)) of ``path`` into ``out``."""
        out = memoryview(out).cast("B")
        if not len(out):
            return
        with warnings.catch_warnings():  # writable: the destination's own bytes
            warnings.simplefilter("ignore", UserWarning)
            dest = torch.frombuffer(out, dtype=torch.uint8)
        received, at = [], 0
        for holder, index, offset, n in self._spans(path, start, len(out)):
            received += self._receive(holder, APPLY, index, offset, dest[at:at + n])
            at += n
        for r in received:
            r.wait()

    def read_blocks(self, path: str, start: int, length: int) -> Iterator[memoryview]:
        """Bytes [start, start + length) of ``path`` in pieces, each valid until the next."""
        # A run of adjacent chunks in pieces, received into this thread's two buffers in
        # turn: the next piece arrives while the reader digests this one (a buffer is
        # received into again only once the reader has moved past it).
        pieces = [(holder, index, offset + o, min(self.piece, n - o))
                  for holder, index, offset, n in self._spans(path, start, length)
                  for o in range(0, n, self.piece)]
        bufs = getattr(self._pieces, "bufs", None)
        if bufs is None:
            bufs = self._pieces.bufs = [torch.empty(self.piece, dtype=torch.uint8)
                                        for _ in range(2)]
        pending: collections.deque = collections.deque()
        try:
            for k, (holder, index, offset, n) in enumerate(pieces):
                out = bufs[k % 2][:n]
                pending.append((self._receive(holder, VERIFY, index, offset, out), out))
                if len(pending) == 2:
                    yield _arrived(*pending.popleft())
            while pending:
                yield _arrived(*pending.popleft())
        finally:  # the reader stopped early (a digest failed): nothing left in flight
            for received, _ in pending:
                for r in received:
                    r.wait()

    def _spans(self, path: str, start: int, length: int) -> list[tuple[int, int, int, int]]:
        """(holder, planned range index, offset in it, bytes) covering a peer's bytes."""
        starts, found = self._index.get(path, ((), ()))
        out, pos, end = [], start, start + length
        while pos < end:
            i = bisect.bisect_right(starts, pos) - 1
            if i < 0 or pos >= starts[i] + found[i][2]:
                raise FileNotFoundError(f"{self.url}/{path}: bytes at {pos} were not planned")
            holder, index, n = found[i]
            take = min(starts[i] + n, end) - pos
            out.append((holder, index, pos - starts[i], take))
            pos += take
        return out

    def _round(self, holder: int, kind: int) -> dict[tuple[int, int], tuple[int, int]]:
        """(range index, offset) -> (tag, bytes) of the messages of a round from ``holder``
        (``VERIFY`` or ``APPLY``); asks the holder for the round on first use."""
        with self._round_lock:
            found = self._rounds.get((holder, kind))
            if found is None:
                count = self._in_round[holder]
                keys = round_keys(self._lengths[holder][:count], self.piece)
                base = _fresh_tags(max(1, len(keys)))
                found = {(i, o): (base + k, n) for k, (i, o, n) in enumerate(keys)}
                self._unread.update({(holder, tag): n for tag, n in found.values()})
                self._rounds[(holder, kind)] = found
                if not count:  # nothing for a round (0 would ask for every range)
                    return found
                ask = torch.tensor([ROUND, kind, base, self.piece, count], dtype=torch.int64)
                dist.isend(ask, dst=dist.get_global_rank(self._pg, holder), group=self._pg,
                           tag=REQUEST_TAG).wait()
            return found

    def _receive(self, holder: int, kind: int, index: int, offset: int,
                 out: torch.Tensor) -> list:
        """Start receiving bytes [offset, offset + len(out)) of planned range ``index`` from
        ``holder`` into ``out``, cut where the round's messages are cut: each whole message
        not received yet is received into its place, any other part is asked for alone.
        Returns the receives."""
        src, received, at, n = dist.get_global_rank(self._pg, holder), [], 0, out.numel()
        messages = self._round(holder, kind)
        while at < n:
            o = offset + at
            take = min((o // self.piece + 1) * self.piece, offset + n) - o
            tag, size = messages.get((index, o), (None, -1))
            with self._round_lock:
                if size != take or self._unread.pop((holder, tag), None) is None:
                    tag = None
            part = out[at:at + take]
            received.append(self._ask(holder, index, o, part) if tag is None else
                            dist.irecv(part, src=src, group=self._pg, tag=tag))
            at += take
        return received

    def _ask(self, holder: int, index: int, offset: int, out: torch.Tensor) -> Any:
        """Request bytes [offset, offset + len(out)) of planned range ``index`` from
        ``holder`` alone; returns the receive that fills ``out``."""
        tag = _fresh_tags(1)
        dst = dist.get_global_rank(self._pg, holder)
        received = dist.irecv(out, src=dst, group=self._pg, tag=tag)
        ask = torch.tensor([READ, index, offset, out.numel(), tag], dtype=torch.int64)
        dist.isend(ask, dst=dst, group=self._pg, tag=REQUEST_TAG).wait()
        return received

    # -- closing ----------------------------------------------------------------------------
    def close(self) -> list[BaseException]:
        """Receive (and drop) what a round sent that the load did not read, then tell the
        holders this rank read from that it is done. Returns the errors met (a holder
        died); a second call does nothing."""
        pg, self._pg = self._pg, None
        if pg is None:
            return []
        unread, self._unread = self._unread, {}
        scratch = torch.empty(max(unread.values(), default=0), dtype=torch.uint8)
        try:
            for r in [dist.irecv(scratch[:n], src=dist.get_global_rank(pg, holder),
                                 group=pg, tag=tag) for (holder, tag), n in unread.items()]:
                r.wait()
            for holder in sorted(self.holders):
                dist.isend(torch.tensor([DONE, 0, 0, 0, 0], dtype=torch.int64),
                           dst=dist.get_global_rank(pg, holder), group=pg,
                           tag=REQUEST_TAG).wait()
        except Exception as e:  # a holder died
            return [e]
        return []


def _arrived(received: list, out: torch.Tensor) -> memoryview:
    for r in received:
        r.wait()
    return memoryview(out.numpy())
