"""The holder's side of the memory tier's peer protocol: a rank sends the bytes of its node's
segments that other ranks planned to read from it, over the memory group's gloo group.

Both sides know the plan before a byte moves (``ckpt/_memory/plan.py`` agrees on it): for
each reader and holder, the ordered list of *planned ranges* (segment file, start, length)
the reader will take from the holder. Ranges are named by their index in that list.

Messages, all point to point over ``pg`` (ranks below are ranks in ``pg``):

* **Request** (reader -> holder, tag ``REQUEST_TAG`` = 0): five int64 (40 bytes),
  ``[op, a, b, c, tag]``:

  - ``[ROUND, kind, first_tag, piece, count]``: send the first ``count`` planned ranges
    (0: all of them), in order, cut into messages of ``piece`` bytes (``PEER_BLOCK``, 4 MiB,
    in ckpt's reader; the last of a range may be shorter): message ``k`` of
    ``round_keys(lengths[:count], piece)`` goes with tag ``first_tag + k``. ``kind``
    (``VERIFY`` or ``APPLY``) names the load's pass; a reader asks each holder for at most
    one round of each kind. The ranges after ``count`` are those a node-mate of the reader
    fetches for both of them (``ckpt/_memory/sharing.py``): read with ``READ`` only if that
    sharing fails.
  - ``[READ, index, offset, length, tag]``: bytes ``[offset, offset + length)`` of planned
    range ``index``, as one message with tag ``tag``. A request outside the plan is
    answered with ``length`` zero bytes (at most ``ANSWER_MAX``; they fail their digests)
    and logged.
  - ``[DONE, 0, 0, 0, 0]``: the reader asks for nothing more.

  A request comes from a rank of the job (only they are in ``pg``), but it is checked all
  the same: a ROUND of an unknown kind, a second one of a kind, a piece, tag, range count or
  message count out of bounds, a READ with a tag out of bounds, or an unknown op, is logged and not
  answered; the thread goes on serving the other requests.

* **Data** (holder -> reader, tags from 1): uint8 tensors, received straight into the
  load's destination. The reader draws every tag from a counter of its process, never
  reusing one, so a message of an attempt abandoned half-way is never taken for a later one's.

In order: on the first read of a pass from a holder the reader sends ``ROUND`` and receives
each message as the load reaches its bytes; a read that is not whole messages sends ``READ``
for the rest. On closing, the reader receives (and drops) the round's messages it did not
read, then sends ``DONE`` to each holder. The holder answers requests from any peer on a
thread (:class:`PeerServer`) until every peer it serves has sent ``DONE``, then waits for its
sends; closing it gives up on peers that made no progress for ``STALL_S`` seconds.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from ckpt.errors import CorruptCheckpointError
from ckpt._memory.tier import PREFIX, plain_name

log = logging.getLogger("ckpt")

#: Seconds without progress after which a rank stops serving the peers still reading from it.
STALL_S = 120.0
#: The tag of requests; data messages use tags from 1.
REQUEST_TAG = 0
#: A request's ``op``.
DONE, READ, ROUND = 0, 1, 2
#: A round's ``kind``: the load's verify pass or its apply pass.
VERIFY, APPLY = 0, 1

#: Bounds on what a request may ask (a request past them is logged and not answered): the
#: largest tag, the most messages in one round, the largest piece, the most zero bytes sent
#: for a READ outside the plan.
TAG_MAX = (1 << 31) - 1
ROUND_MAX = 1 << 18
PIECE_MAX = 1 << 30
ANSWER_MAX = 4 << 20

#: A planned range this rank serves: (the mapped segment file, start, length).
Range = tuple[Any, int, int]


def round_keys(lengths: list[int], piece: int) -> list[tuple[int, int, int]]:
    """The messages of a round, in order: (range index, offset, bytes), each planned range
    cut into pieces; the holder and the reader cut them alike."""
    return [(i, o, min(piece, n - o)) for i, n in enumerate(lengths) for o in range(0, n, piece)]


def _bad_round(kind: int, first_tag: int, piece: int, lengths: list[int], sent: bool,
               ranges: int = 0) -> str:
    """Why a ROUND request cannot be served ('' when it can): an unknown kind, a repeated round
    of a kind, a piece, tags or a count of ranges (``ranges``; 0: all) out of bounds, or more
    than ``ROUND_MAX`` messages. ``lengths``: the planned ranges the round would send."""
    if kind not in (VERIFY, APPLY):
        return f"kind {kind}"
    if sent:
        return f"a repeated round of kind {kind}"
    if not 0 <= ranges <= len(lengths):
        return f"the first {ranges} of {len(lengths)} ranges"
    if not 1 <= piece <= PIECE_MAX:
        return f"pieces of {piece} bytes"
    count = sum(-(-n // piece) for n in lengths[:ranges or len(lengths)])
    if count > ROUND_MAX:
        return f"{count} messages"
    if not 1 <= first_tag <= TAG_MAX - count:
        return f"tags from {first_tag}"
    return ""


def map_ranges(asked: dict[int, list[tuple[str, str, int, int]]], shm_dir: str, prefix: str,
               location: str) -> dict[int, list[Range]]:
    """What this rank serves, mapped: peer -> its planned ranges here, from ``asked`` (peer ->
    [(segment, file, start, length)]). Raises (OSError, ValueError, CorruptCheckpointError)
    when a range is not in a segment of this node (``prefix``) or past its file's end."""
    maps: dict[str, Any] = {}
    parts: dict[int, list[Range]] = {}
    for peer, ranges in asked.items():
        for segment, name, start, length in ranges:
            if not segment.startswith(prefix) or not segment.startswith(PREFIX) \
                    or "/" in segment:
                raise CorruptCheckpointError(f"asked for {segment}, not a segment of "
                                             "this node")
            path = os.path.join(shm_dir, segment, location, plain_name(name))
            if path not in maps:
                maps[path] = _map(path)
            if start + length > len(maps[path]):
                raise CorruptCheckpointError(f"{path} ends before byte {start + length}")
            parts.setdefault(peer, []).append((maps[path], start, length))
    return parts


class PeerServer:
    """Serves ``parts`` (peer -> its planned ranges on this rank) from a thread, started by
    :meth:`start`, until every one of those peers has sent ``DONE``.

    ``url`` names the save in messages. :meth:`close` waits for the thread (or gives up on
    stuck peers) and returns the errors it met (a peer died)."""

    def __init__(self, pg: Any, parts: dict[int, list[Range]], url: str) -> None:
        self.url = url
        self._pg = pg
        self._parts = parts
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name="ckpt-memory-serve")
        self._errors: list[BaseException] = []
        self._sends: list = []  # what the thread posted (close watches them complete)
        self._requests = 0  # how many requests the thread has received
        self._waiting: set[int] = set()  # the peers the thread still waits for

    def start(self) -> PeerServer:
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _serve(self) -> None:
        pg, parts, sends = self._pg, self._parts, self._sends
        try:
            left = self._waiting = set(parts)
            rounds: set[tuple[int, int]] = set()  # (peer, kind) of the rounds sent
            ask = torch.empty(5, dtype=torch.int64)
            while left:
                src = dist.recv(ask, src=None, group=pg, tag=REQUEST_TAG)
                self._requests += 1
                peer = dist.get_group_rank(pg, src)
                op, a, b, c, tag = ask.tolist()
                mine = parts.get(peer, [])
                if op == DONE:
                    left.discard(peer)
                    continue
                if op == ROUND:  # (kind, first tag, piece, ranges): the round's every message
                    lengths = [n for _, _, n in mine]
                    problem = _bad_round(a, b, c, lengths, (peer, a) in rounds, tag)
                    lengths = lengths[:tag or len(lengths)]
                    if problem:
                        log.error("ckpt._memory.peer_server rank %d asked for a round it may "
                                  "not have (%s); not answered", peer, problem)
                        continue
                    rounds.add((peer, a))
                    sends += [dist.isend(_bytes_of(mine[i][0], mine[i][1] + o, n), dst=src,
                                         group=pg, tag=b + k)
                              for k, (i, o, n) in enumerate(round_keys(lengths, c))]
                    continue
                if op != READ or not 1 <= tag <= TAG_MAX:  # nowhere to send an answer
                    log.error("ckpt._memory.peer_server rank %d sent a request that is none of "
                              "ckpt's (op %d, tag %d); not answered", peer, op, tag)
                    continue
                index, offset, length = a, b, c  # READ: one range
                if 0 <= index < len(mine) and 0 <= offset and 0 < length \
                        and offset + length <= mine[index][2]:
                    data = _bytes_of(mine[index][0], mine[index][1] + offset, length)
                else:  # not from ckpt's own reads: bytes that fail their digests (at most
                    # ANSWER_MAX of them; gloo lets a shorter message fill a larger receive)
                    log.error("ckpt._memory.peer_server rank %d asked for bytes it was not "
                              "promised (range %d, %d+%d)", peer, index, offset, length)
                    data = torch.zeros(min(max(0, length), ANSWER_MAX), dtype=torch.uint8)
                sends.append(dist.isend(data, dst=src, group=pg, tag=tag))
            for w in sends:
                w.wait()
        except BaseException as e:  # a peer died: close() returns it
            self._errors.append(e)

    def close(self) -> list[BaseException]:
        """Wait until the peers this rank serves are done; give up, with a warning, once
        they have neither asked for nor taken any bytes for ``STALL_S`` seconds (a peer
        alive but stuck would otherwise hold this rank here forever). Returns the errors
        the serving thread met."""
        def progress() -> int:
            return self._requests + sum(w.is_completed() for w in list(self._sends))

        seen, since = progress(), time.monotonic()
        while True:
            self._thread.join(timeout=min(1.0, STALL_S))
            if not self._thread.is_alive():
                break
            now = progress()
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since >= STALL_S:
                log.warning("ckpt._memory.peer_server serving %s: ranks %s have neither asked "
                            "for nor received bytes for %.0f s; giving up on them (their "
                            "restore cannot finish; a stuck or overloaded peer?)", self.url,
                            sorted(self._waiting), STALL_S)
                break
        return list(self._errors)


def _map(path: str) -> Any:
    """A read-only shared mapping of a segment's file (never through a symbolic link); its
    pages are in RAM already (tmpfs), so mapping them costs page-table entries, no copy, and
    they are entered as the send reads them (measured faster than MAP_POPULATE here).
    Nothing truncates a committed step's files (writers publish new directories by rename)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if not size:
            return b""
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def _bytes_of(mapping: Any, start: int, length: int) -> torch.Tensor:
    """``length`` bytes of ``mapping`` from ``start`` as a tensor, not copied (only sent)."""
    with warnings.catch_warnings():  # read-only memory: the tensor is never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8, count=length, offset=start)
