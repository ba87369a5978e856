"""Restoring a process group from the memory tier: the ranks agree on the newest step whose rank
steps (ckpt/_memory/tier.py) are all held in memory by live nodes — own segments or peer
replicas — and each rank fetches the chunks its (possibly resharded) boxes need: from its own
node's segments directly, from other nodes over the gloo group.

Every function here is collective over ``pg`` (a gloo group) unless it says otherwise; errors
on one rank become an agreed failure on all, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import json
import logging
import mmap
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, MutableMapping

import torch
import torch.distributed as dist

from storage_backends.base import PathReader
from storage_backends.posix import pread_blocks, pread_into

from ckpt.errors import CorruptCheckpointError
from ckpt._format.manifest import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, Manifest, step_dir
from ckpt._step.incremental import CHAIN_KEY
from ckpt._memory.tier import PREFIX, node_prefix, plain_name, rank_steps, read_rank_doc
from ckpt._load.reader import needed_tensors
from ckpt._shared.sharding import dtensor_type, overlapping, read_box, source_rank
from ckpt._shared.state import flatten, is_stateful, item_tree

log = logging.getLogger("ckpt")


@dataclass(frozen=True)
class Holding:
    """A rank step held in one segment on this node (JSON-able for the exchange)."""

    segment: str
    step: int
    origin: int
    world: int
    token: str
    created: float
    replica: bool


@dataclass
class Candidate:
    """One save (step, token) that live nodes hold completely: origin -> [(rank, holding)].

    ``second``: read each origin's data from the copy the first attempt did not prefer
    (replicas and other nodes first), for when that attempt found a copy corrupt.
    ``docs``: segment -> this step's rank document, as this rank read it while listing
    (not read twice)."""

    step: int
    token: str
    world: int
    holders: dict[int, list[tuple[int, Holding]]] = field(default_factory=dict)
    second: bool = False
    docs: dict[str, dict] = field(default_factory=dict, repr=False)

    def has_second_copies(self) -> bool:
        return any(len(h) > 1 for h in self.holders.values())


def local_holdings(shm_dir: str, job: str, node: str,
                   docs: dict[tuple[str, int], dict] | None = None) -> list[Holding]:
    """Every readable rank step in this node's segments (not collective); ``docs``, when
    given, receives each one's rank document by (segment, step)."""
    prefix = node_prefix(job, node)
    out = []
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError as e:  # every rank must reach the collective that follows
        log.warning("ckpt._memory.restore cannot list %s: %s", shm_dir, e)
        return out
    for name in names:
        path = os.path.join(shm_dir, name)
        if not name.startswith(prefix) or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            steps = rank_steps(path)
        except OSError as e:  # e.g. a permission problem: this copy is unusable, not fatal
            log.warning("ckpt._memory.restore skipping %s: %s", path, e)
            continue
        for s in steps:
            try:
                doc = read_rank_doc(path, s)
            except CorruptCheckpointError as e:
                log.warning("ckpt._memory.restore skipping %s", e)
                continue
            out.append(Holding(name, s, doc["rank"], doc["world_size"], doc["token"],
                               float(doc["created"]), "-replica-" in name[len(prefix) - 1:]))
            if docs is not None:
                docs[(name, s)] = doc
    return out


def candidates(mine: list[Holding], pg: Any,
               docs: dict[tuple[str, int], dict] | None = None) -> list[Candidate]:
    """Saves that the live ranks' nodes hold completely, newest first (one per step: the
    latest save of that step number); ``docs``: what ``local_holdings`` read. Collective."""
    gathered: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(gathered, [h.__dict__ for h in mine], group=pg)
    saves: dict[tuple[int, str], Candidate] = {}
    created: dict[tuple[int, str], float] = {}
    for rank, holdings in enumerate(gathered):
        for d in holdings:
            h = Holding(**d)
            c = saves.setdefault((h.step, h.token), Candidate(h.step, h.token, h.world))
            if h.world != c.world:
                continue
            c.holders.setdefault(h.origin, []).append((rank, h))
            created[(h.step, h.token)] = max(created.get((h.step, h.token), 0.0), h.created)
    best: dict[int, Candidate] = {}
    for key, c in sorted(saves.items(), key=lambda kv: created[kv[0]]):
        if set(c.holders) == set(range(c.world)):
            best[c.step] = c  # a later save of the same step number wins
    for c in best.values():
        c.docs = {seg: d for (seg, s), d in (docs or {}).items()
                  if s == c.step and d["token"] == c.token}
    return [best[s] for s in sorted(best, reverse=True)]


class ShmReader:
    """Read-only storage (the subset ckpt's loader uses) over files in this node's shared
    memory, for the memory tier's restores.

    Each file is opened once per restore (never through a symbolic link) and read with
    ``pread`` on that descriptor: no path walk or ``stat`` per chunk. The loader's verify pass
    streams each run of chunks through one small block per thread (``stream_block``, digested
    while still in the CPU cache), its apply pass reads straight into the live tensors; the
    measurements behind this (and against memory maps) are in docs/elastic.md, "Memory tier".
    ``close`` releases the descriptors.

    ``where(path)`` names the file behind a storage path, or None (not on this node).
    """

    stream_block = 512 << 10

    def __init__(self, url: str, where: Callable[[str], str | None]) -> None:
        self.url = url
        self._where = where
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def of_root(cls, root: str) -> ShmReader:
        """Over a segment that is an ordinary ckpt root (a single process's)."""
        def where(path: str) -> str:
            parts = path.split("/")
            for part in parts:
                plain_name(part)  # no "..", no absolute path, no hidden staging
            for i in range(1, len(parts)):  # directories on the way: never a link
                d = os.path.join(root, *parts[:i])
                if os.path.islink(d):
                    raise FileNotFoundError(f"{d} is a symbolic link")
            return os.path.join(root, *parts)
        return cls(root, where)

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is not None:
            return fd
        try:
            where = self._where(path)
        except ValueError as e:
            raise FileNotFoundError(f"{os.path.join(self.url, path)}: {e}") from e
        if where is None:
            raise FileNotFoundError(f"{os.path.join(self.url, path)} is not on this node")
        try:
            fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise
        except OSError as e:  # a symbolic link or worse: this copy is unusable, not fatal
            raise FileNotFoundError(f"{where}: {e}") from e
        with self._lock:
            if path in self._fds:  # another thread opened it meanwhile
                os.close(fd)
                return self._fds[path]
            self._fds[path] = fd
        return fd

    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        fd = self._fd(path)
        if length is None:
            length = max(0, os.fstat(fd).st_size - start)
        buf = bytearray(length)
        self.read_into(path, start, memoryview(buf))
        return bytes(buf)

    def read_into(self, path: str, start: int, out: memoryview) -> None:
        pread_into(self._fd(path), start, out, os.path.join(self.url, path))

    def read_blocks(self, path: str, start: int, length: int,
                    buffer: memoryview) -> Iterator[memoryview]:
        yield from pread_blocks(self._fd(path), start, length, buffer,
                                os.path.join(self.url, path))

    def open_reader(self, path: str) -> PathReader:
        """Reads of one file (the loader's apply pass); the descriptor is kept anyway."""
        return PathReader(self, path)

    def size(self, path: str) -> int:
        return os.fstat(self._fd(path)).st_size

    def exists(self, path: str) -> bool:
        try:
            self._fd(path)
        except FileNotFoundError:
            return False
        return True

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __del__(self) -> None:
        self.close()


class MemorySource(ShmReader):
    """The storage of one agreed save: the merged manifest, chunk bytes from this node's
    segments (``local``: path -> file) or read from the peer that holds them (``remote``).

    A peer's bytes are received when the load reads them, straight into where the load
    wants them, so a restore needs no buffer for them (new memory is dear here:
    docs/elastic.md). A pass's first read from a holder asks it for a *round*: the holder
    posts a send of every byte range this rank planned to read from it, cut into pieces of
    ``piece`` bytes (the block a one-pass load reads and digests at once), and gloo moves
    each piece as soon as the reader posts its receive, with no Python in between: into the
    live tensor (``read_into``), or, for a verify pass (``read_blocks``), into two reused
    buffers per thread, one arriving while the other is digested. A read of anything but
    whole pieces asks for the rest alone. Each rank answers its peers from a thread
    (``_serve``) until every peer it serves has closed its source; ``close`` first receives
    (and drops) what a round sent that the load did not read.

    ``tier`` is "memory" when every byte this rank needs lies in its node's own segments,
    "peer" when any comes from a replica or another node.
    """

    piece = ShmReader.stream_block  # a round's message: what a one-pass load reads at once

    def __init__(self, url: str, location: str, manifest: Manifest, raw: bytes) -> None:
        super().__init__(url, lambda path: self.local.get(path))
        self.location = location
        self.parsed_manifest = manifest  # validated (parsed from ``raw``)
        self._manifest = raw
        self.local: dict[str, str] = {}       # path -> file on this node
        self.sizes: dict[str, int] = {}       # path -> the size its rank step recorded
        # (path, start) -> (holder, index of the request, length): what a peer serves
        self.remote: dict[tuple[str, int], tuple[int, int, int]] = {}
        self.tier = "memory"
        self._pg: Any = None
        self._holders: set[int] = set()  # the peers this rank reads from
        self._index: dict[str, tuple[tuple, tuple]] = {}  # path -> (starts, remote's)
        self._pieces = threading.local()
        self._lengths: dict[int, list[int]] = {}  # holder -> length of each planned range
        self._rounds: dict[tuple[int, int], dict] = {}  # (holder, kind) -> key -> (tag, n)
        self._unread: dict[tuple[int, int], int] = {}  # (holder, tag) -> bytes, sent, not read
        self._round_lock = threading.Lock()
        self._server: threading.Thread | None = None
        self._served: list[BaseException] = []
        self._sends: list = []  # what _serve posted (close watches them complete)
        self._requests = 0  # how many requests _serve has received
        self._waiting: set[int] = set()  # the peers _serve still waits for

    # -- reading a peer's bytes -----------------------------------------------------------
    def _round(self, holder: int, kind: int) -> dict[tuple[int, int], tuple[int, int]]:
        """(range index, offset) -> (tag, bytes) of the messages of a round from ``holder``
        (``_VERIFY`` or ``_APPLY``); asks the holder for the round on first use."""
        with self._round_lock:
            found = self._rounds.get((holder, kind))
            if found is None:
                keys = _round_keys(self._lengths[holder], self.piece)
                with _TAG_LOCK:
                    base = next(_TAGS)
                    for _ in keys[1:]:
                        next(_TAGS)
                found = {(i, o): (base + k, n) for k, (i, o, n) in enumerate(keys)}
                self._unread.update({(holder, tag): n for tag, n in found.values()})
                self._rounds[(holder, kind)] = found
                ask = torch.tensor([_ROUND, kind, base, self.piece, 0], dtype=torch.int64)
                dist.isend(ask, dst=dist.get_global_rank(self._pg, holder), group=self._pg,
                           tag=_REQUEST).wait()
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
        with _TAG_LOCK:  # never reused in this process: a message of an attempt that
            tag = next(_TAGS)  # failed half-way can never be taken for one of a later one
        dst = dist.get_global_rank(self._pg, holder)
        received = dist.irecv(out, src=dst, group=self._pg, tag=tag)
        ask = torch.tensor([_READ, index, offset, out.numel(), tag], dtype=torch.int64)
        dist.isend(ask, dst=dst, group=self._pg, tag=_REQUEST).wait()
        return received

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

    def index_remote(self) -> None:
        """Index ``remote`` by file and holder (once it is complete)."""
        by_path: dict[str, list] = {}
        for (path, start), (holder, index, n) in self.remote.items():
            by_path.setdefault(path, []).append((start, (holder, index, n)))
            lengths = self._lengths.setdefault(holder, [])
            lengths += [0] * (index + 1 - len(lengths))
            lengths[index] = n
        self._index = {path: (tuple(s for s, _ in sorted(v)), tuple(f for _, f in sorted(v)))
                       for path, v in by_path.items()}

    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        if path == f"{self.location}/{MANIFEST_NAME}":
            return self._manifest[start:None if length is None else start + length]
        if path in self.local:
            return super().read(path, start, length)
        if length is None:  # to the end of the planned range that starts there
            length = self.remote.get((path, start), (0, 0, 0))[2]
        buf = bytearray(length)
        self.read_into(path, start, memoryview(buf))
        return bytes(buf)

    def read_into(self, path: str, start: int, out: memoryview) -> None:
        if path in self.local:
            return super().read_into(path, start, out)
        out = memoryview(out).cast("B")
        if not len(out):
            return
        with warnings.catch_warnings():  # writable: the destination's own bytes
            warnings.simplefilter("ignore", UserWarning)
            dest = torch.frombuffer(out, dtype=torch.uint8)
        received, at = [], 0
        for holder, index, offset, n in self._spans(path, start, len(out)):
            received += self._receive(holder, _APPLY, index, offset, dest[at:at + n])
            at += n
        for r in received:
            r.wait()

    def read_blocks(self, path: str, start: int, length: int,
                    buffer: memoryview) -> Iterator[memoryview]:
        if path in self.local:
            yield from super().read_blocks(path, start, length, buffer)
            return
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
                pending.append((self._receive(holder, _VERIFY, index, offset, out), out))
                if len(pending) == 2:
                    yield _arrived(*pending.popleft())
            while pending:
                yield _arrived(*pending.popleft())
        finally:  # the reader stopped early (a digest failed): nothing left in flight
            for received, _ in pending:
                for r in received:
                    r.wait()

    def size(self, path: str) -> int:
        if path in self.local:
            return super().size(path)
        return self.sizes[path]

    def exists(self, path: str) -> bool:
        return path in self.local or path in self.sizes

    # -- serving peers -------------------------------------------------------------------
    def _serve(self, pg: Any, parts: dict[int, list[tuple[Any, int, int]]]) -> None:
        """Answer the peers' requests (``parts``: peer -> what it planned to read from this
        rank, each (mapping, start, length)) until every one of them has said it is done."""
        sends = self._sends
        try:
            left = self._waiting = set(parts)
            ask = torch.empty(5, dtype=torch.int64)
            while left:
                src = dist.recv(ask, src=None, group=pg, tag=_REQUEST)
                self._requests += 1
                peer = dist.get_group_rank(pg, src)
                op, a, b, c, tag = ask.tolist()
                mine = parts.get(peer, [])
                if op == _DONE:
                    left.discard(peer)
                    continue
                if op == _ROUND:  # (kind, first tag, piece): every message of the round
                    keys = _round_keys([n for _, _, n in mine], c)
                    sends += [dist.isend(_bytes_of(mine[i][0], mine[i][1] + o, n), dst=src,
                                         group=pg, tag=b + k)
                              for k, (i, o, n) in enumerate(keys)]
                    continue
                index, offset, length = a, b, c  # _READ: one range
                if 0 <= index < len(mine) and 0 <= offset and 0 < length \
                        and offset + length <= mine[index][2]:
                    data = _bytes_of(mine[index][0], mine[index][1] + offset, length)
                else:  # not from ckpt's own reads: bytes that fail their digests
                    log.error("ckpt._memory.restore rank %d asked for bytes it was not "
                              "promised (range %d, %d+%d)", peer, index, offset, length)
                    data = torch.zeros(max(0, length), dtype=torch.uint8)
                sends.append(dist.isend(data, dst=src, group=pg, tag=tag))
            for w in sends:
                w.wait()
        except BaseException as e:  # a peer died: close() raises it
            self._served.append(e)

    def close(self) -> None:
        """Receive (and drop) what a round sent that the load did not read, tell the
        holders this rank read from that it is done, wait until the peers it serves are
        done too, then release the mappings and descriptors."""
        pg, self._pg = getattr(self, "_pg", None), None
        errors = []
        if pg is not None:
            unread, self._unread = self._unread, {}
            scratch = torch.empty(max(unread.values(), default=0), dtype=torch.uint8)
            try:
                for r in [dist.irecv(scratch[:n], src=dist.get_global_rank(pg, holder),
                                     group=pg, tag=tag) for (holder, tag), n in unread.items()]:
                    r.wait()
                for holder in sorted(self._holders):
                    dist.isend(torch.tensor([_DONE, 0, 0, 0, 0], dtype=torch.int64),
                               dst=dist.get_global_rank(pg, holder), group=pg,
                               tag=_REQUEST).wait()
            except Exception as e:  # a holder died
                errors.append(e)
        server, self._server = getattr(self, "_server", None), None
        if server is not None:
            self._join(server)
        errors += getattr(self, "_served", [])
        super().close()
        if errors:
            raise errors[0]

    def _join(self, server: threading.Thread) -> None:
        """Wait until the peers this rank serves are done; give up, with a warning, once
        they have neither asked for nor taken any bytes for ``STALL_S`` seconds (a peer
        alive but stuck would otherwise hold this rank here forever)."""
        def progress() -> int:
            return self._requests + sum(w.is_completed() for w in list(self._sends))

        seen, since = progress(), time.monotonic()
        while True:
            server.join(timeout=min(1.0, STALL_S))
            if not server.is_alive():
                return
            now = progress()
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since >= STALL_S:
                log.warning("ckpt._memory.restore serving %s: ranks %s have neither asked for "
                            "nor received bytes for %.0f s; giving up on them (their restore "
                            "cannot finish; a stuck or overloaded peer?)", self.url,
                            sorted(self._waiting), STALL_S)
                return

    def __del__(self) -> None:
        ShmReader.close(self)  # descriptors only: the peers' protocol is close()'s


def _arrived(received: list, out: torch.Tensor) -> memoryview:
    for r in received:
        r.wait()
    return memoryview(out.numpy())


def _round_keys(lengths: list[int], piece: int) -> list[tuple[int, int, int]]:
    """The messages of a round, in order: (range index, offset, bytes), each planned range
    cut into pieces; the holder and the reader cut them alike."""
    return [(i, o, min(piece, n - o)) for i, n in enumerate(lengths) for o in range(0, n, piece)]


#: The loader's block (and a round's piece) when a rank reads from peers.
PEER_BLOCK = 4 << 20
#: Seconds without progress after which a rank stops serving the peers still reading from it.
STALL_S = 120.0
_REQUEST = 0  # the tag of requests; data messages use tags from 1
_TAGS = itertools.count(1)
_TAG_LOCK = threading.Lock()
_DONE, _READ, _ROUND = 0, 1, 2  # requests: [op, ...] (see _serve)
_VERIFY, _APPLY = 0, 1  # rounds


def open_candidate(c: Candidate, state: MutableMapping[str, Any], *, shm_dir: str, job: str,
                   node: str, rank: int, pg: Any) -> MemorySource:
    """Agree on who serves each origin rank's files, merge the manifest and start serving
    the peers (a rank reads the bytes it needs from them as its load asks). Collective; raises
    CorruptCheckpointError on every rank when any rank cannot read or serve its part (the
    caller falls through to the next tier)."""
    world = dist.get_world_size(pg)
    prefix = node_prefix(job, node)
    # Each origin's rank step document comes from its first holder (any copy: the digests
    # inside are checked against the data as it is loaded).
    docs, error = {}, None
    for origin, holders in sorted(c.holders.items()):
        holder_rank, h = holders[0]
        if holder_rank == rank:
            try:
                docs[origin] = c.docs.get(h.segment) or read_rank_doc(
                    os.path.join(shm_dir, h.segment), c.step)
            except CorruptCheckpointError as e:
                error = str(e)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (docs, error), group=pg)
    errors = [e for _, e in everyone if e]
    if errors:
        raise CorruptCheckpointError(f"step {c.step} in memory: {errors[0]}")
    docs = {int(o): d for part, _ in everyone for o, d in part.items()}
    location = step_dir(c.step)
    source, requests, error = None, {}, None
    try:  # per rank: every failure must reach the exchange's agreement, not skip it
        source, requests = _plan(c, docs, state, location, shm_dir, prefix, rank)
    except Exception as e:
        error = f"rank {rank} cannot use step {c.step} in memory: {e!r}"
    _exchange(source, requests, error, c.step, location, shm_dir, prefix, rank, pg)
    return source


def _plan(c: Candidate, docs: dict[int, dict], state: MutableMapping[str, Any], location: str,
          shm_dir: str, prefix: str, rank: int) -> tuple[MemorySource, dict]:
    """This rank's merged manifest and where each chunk it needs comes from: a file on this
    node, or a request to a holder elsewhere (holder -> [(segment, file, start, length)])."""

    world = len(docs)

    def preference(rh: tuple[int, Holding]) -> tuple:
        """Own node's segments, then replicas on it, then other nodes' (spread over them);
        the second attempt reverses the order."""
        r, h = rh
        key = (not h.segment.startswith(prefix), h.replica, (r - rank) % world)
        return tuple(-k for k in key) if c.second else key

    chosen = {o: min(hs, key=preference) for o, hs in c.holders.items()}
    order = sorted(docs, key=lambda o: (preference(chosen[o]), o))
    source, files_of = _merge(c, docs, location, order)
    origin_of = {name: origin for origin, names in files_of.items() for name in names}
    manifest = source.parsed_manifest
    requests: dict[int, list[tuple[str, str, int, int]]] = {}  # holder -> (seg, file, start, len)
    for key, chunk in _needed_chunks(manifest, state, rank):
        origin = origin_of[chunk.file]
        path = f"{location}/{chunk.file}"
        holder, h = chosen[origin]
        if h.replica or not h.segment.startswith(prefix):
            source.tier = "peer"
        if h.segment.startswith(prefix):  # on this node: read it here
            source.local[path] = os.path.join(shm_dir, h.segment, location, chunk.file)
        else:
            requests.setdefault(holder, []).append((h.segment, chunk.file, chunk.start,
                                                    chunk.length))
    return source, requests


def _merge(c: Candidate, docs: dict[int, dict], location: str,
           order: list[int]) -> tuple[MemorySource, dict]:
    """The manifest of the whole save, from every origin rank's table; a box that several
    ranks hold (a replicated tensor) is taken from the first of them in ``order``. Merged
    as JSON and parsed once: the same validation as any manifest read from a root."""
    first = docs[0]
    try:
        for o, d in docs.items():
            if d["token"] != c.token or d["rank"] != o:
                raise ValueError(f"rank {o}'s document names another save")
        tensors = {k: {"dtype": dtype, "shape": shape, "chunks": []}
                   for k, (dtype, shape) in first["tensors"].items()}
        files: dict[str, int] = {}
        seen: set = set()
        for o in order:
            table = docs[o]["table"]
            files.update(table["files"])
            for key, chunk in table["chunks"]:
                box = (key, tuple(chunk["offsets"]))
                if box not in seen:
                    seen.add(box)
                    tensors[key]["chunks"].append(chunk)
        for t in tensors.values():
            t["chunks"].sort(key=lambda chunk: chunk["offsets"])
        # Each rank's values of per-rank items (RNG states) from its own document: a rank
        # step needs to carry no other rank's.
        items = {name: {**item, "per_rank": {str(o): d["items"][name]["per_rank"][str(o)]
                                             for o, d in docs.items()}}
                 if isinstance(item.get("per_rank"), dict) else item
                 for name, item in first["items"].items()}
        doc = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step": c.step,
               "world_size": c.world, "created": first["created"], "tensors": tensors,
               "aliases": first["aliases"], "items": items, "files": files,
               "metadata": {**first["metadata"], CHAIN_KEY: 0}}
        raw = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
        manifest = Manifest.from_json(raw, where=f"step {c.step} in memory")
        files_of = {o: [plain_name(f) for f in d["table"]["files"]] for o, d in docs.items()}
        sizes = {f"{location}/{name}": size for d in docs.values()
                 for name, size in d["table"]["files"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(f"step {c.step} in memory: a rank step is malformed "
                                     f"({e!r})") from e
    source = MemorySource(f"memory:{c.step}", location, manifest, raw)
    source.sizes = sizes
    return source, files_of


def _needed_chunks(manifest: Manifest, state: MutableMapping[str, Any], rank: int) -> list:
    """(key, chunk) this rank's load reads, planned as the loader plans it: the stored
    tensors its items refer to (``needed_tensors``, of the saved rank whose per-rank values
    it gets), in the box ``read_box`` gives for its live tensor, the chunks ``overlapping``
    finds there."""
    src = source_rank(rank, manifest.world_size)
    live = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) or is_stateful(v)}
    tensors = flatten(live, allow_pickle=True, rank=src, keep_vars=True).tensors
    wanted = {name: item_tree(manifest.items[name], src) for name in state
              if name in manifest.items}
    dtensor, boxes = dtensor_type(), {}
    out = []
    for key in sorted(needed_tensors(None, "", manifest, wanted, allow_pickle=True)):
        entry, target = manifest.tensors[key], tensors.get(key)
        if dtensor is not None and isinstance(target, dtensor):
            # DTensors of one shape, mesh and placements share this rank's box: computed once
            spec = (tuple(target.shape), target.device_mesh, tuple(target.placements))
            box = boxes.get(spec) or boxes.setdefault(spec, read_box(entry, target))
        else:
            box = read_box(entry, target)
        out += [(key, chunk) for chunk, _ in overlapping(entry, box)]
    return out


def _exchange(source: MemorySource | None, requests: dict[int, list[tuple[str, str, int, int]]],
              error: str | None, step: int, location: str, shm_dir: str, prefix: str,
              rank: int, pg: Any) -> None:
    """Agree on what each rank reads from which peer (``requests``: holder -> [(segment,
    file, start, length)]), check that this rank can serve what it is asked for, and start
    serving (``MemorySource._serve``); every rank raises when one cannot plan or serve.
    ``error``: this rank could not plan its reads."""
    world = dist.get_world_size(pg)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (requests, error), group=pg)
    failed = [e for _, e in gathered if e]
    if failed:
        raise CorruptCheckpointError(failed[0])
    asked = [r for r, _ in gathered]
    maps: dict[str, Any] = {}
    parts: dict[int, list[tuple[Any, int, int]]] = {}
    error = None
    for dst in range(world):
        mine = asked[dst].get(rank, []) if dst != rank else []  # own node's: read locally
        try:
            for segment, name, start, length in mine:
                if not segment.startswith(prefix) or not segment.startswith(PREFIX) \
                        or "/" in segment:
                    raise CorruptCheckpointError(f"asked for {segment}, not a segment of "
                                                 "this node")
                path = os.path.join(shm_dir, segment, location, plain_name(name))
                if path not in maps:
                    maps[path] = _map(path)
                if start + length > len(maps[path]):
                    raise CorruptCheckpointError(f"{path} ends before byte {start + length}")
                parts.setdefault(dst, []).append((maps[path], start, length))
        except (OSError, ValueError, CorruptCheckpointError) as e:
            error = f"rank {rank} cannot serve step {step} from memory: {e}"
            break
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, error, group=pg)
    failed = [e for e in errors if e]
    if failed:
        raise CorruptCheckpointError(failed[0])
    source._pg = pg
    if requests:  # fewer, larger messages: each is a wait for a peer (measured faster)
        source.stream_block = source.piece = PEER_BLOCK
    for holder, reqs in requests.items():
        source._holders.add(holder)
        for index, (_, name, start, length) in enumerate(reqs):
            source.remote[(f"{location}/{name}", start)] = (holder, index, length)
    source.index_remote()
    if parts:
        source._server = threading.Thread(target=source._serve, args=(pg, parts), daemon=True,
                                          name="ckpt-memory-serve")
        source._server.start()


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
