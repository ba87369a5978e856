"""Restoring a process group from the memory tier: the ranks agree on the newest step whose rank
steps (ckpt/memory_tier.py) are all held in memory by live nodes — own segments or peer
replicas — and each rank fetches the chunks its (possibly resharded) boxes need: from its own
node's segments directly, from other nodes over the gloo group.

Every function here is collective over ``pg`` (a gloo group) unless it says otherwise; errors
on one rank become an agreed failure on all, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, MutableMapping

import torch
import torch.distributed as dist

from storage_backends.base import PathReader
from storage_backends.posix import pread_blocks, pread_into

from .errors import CorruptCheckpointError
from .format import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, Manifest, step_dir
from .incremental import CHAIN_KEY
from .memory_tier import PREFIX, node_prefix, plain_name, rank_steps, read_rank_doc
from .reader import needed_tensors
from .sharding import overlapping, read_box, source_rank
from .state import flatten, is_stateful, item_tree

log = logging.getLogger("ckpt")

#: The largest peer message, unless one chunk is larger: a receiver digests and copies the
#: bytes of one message while the next ones are still arriving.
MESSAGE_BYTES = 8 << 20


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
        log.warning("ckpt.memory_restore cannot list %s: %s", shm_dir, e)
        return out
    for name in names:
        path = os.path.join(shm_dir, name)
        if not name.startswith(prefix) or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            steps = rank_steps(path)
        except OSError as e:  # e.g. a permission problem: this copy is unusable, not fatal
            log.warning("ckpt.memory_restore skipping %s: %s", path, e)
            continue
        for s in steps:
            try:
                doc = read_rank_doc(path, s)
            except CorruptCheckpointError as e:
                log.warning("ckpt.memory_restore skipping %s", e)
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
    segments (``local``: path -> file) or fetched from peers (``fetched``).

    Fetched bytes may still be on their way when the load begins: a read of them waits for
    the message that carries them (so the load digests and copies the first messages while
    the later ones arrive). ``close`` waits for every message this rank sends or receives.

    ``tier`` is "memory" when every byte this rank needs lies in its node's own segments,
    "peer" when any comes from a replica or another node.
    """

    def __init__(self, url: str, location: str, manifest: Manifest, raw: bytes) -> None:
        super().__init__(url, lambda path: self.local.get(path))
        self.location = location
        self.parsed_manifest = manifest  # validated (parsed from ``raw``)
        self._manifest = raw
        self.local: dict[str, str] = {}       # path -> file on this node
        self.sizes: dict[str, int] = {}       # path -> the size its rank step recorded
        # (path, start) -> (bytes, the message that brings them)
        self.fetched: dict[tuple[str, int], tuple[memoryview, _Arrival]] = {}
        self.exchange: list[_Arrival] = []    # every message sent or received
        self.tier = "memory"

    def _got(self, path: str, start: int, length: int) -> memoryview:
        data, arrival = self.fetched.get((path, start), (None, None))
        if data is None or len(data) < length:
            raise FileNotFoundError(f"{self.url}/{path}: bytes at {start} were not fetched")
        arrival.wait()
        return data[:length]

    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        if path == f"{self.location}/{MANIFEST_NAME}":
            return self._manifest[start:None if length is None else start + length]
        if path in self.local:
            return super().read(path, start, length)
        if length is None:
            length = len(self.fetched.get((path, start), (b"",))[0])
        return bytes(self._got(path, start, length))

    def read_into(self, path: str, start: int, out: memoryview) -> None:
        if path in self.local:
            return super().read_into(path, start, out)
        out = memoryview(out).cast("B")
        out[:] = self._got(path, start, len(out))

    def read_blocks(self, path: str, start: int, length: int,
                    buffer: memoryview) -> Iterator[memoryview]:
        if path in self.local:
            yield from super().read_blocks(path, start, length, buffer)
            return
        # The fetched bytes are in this process already: digest them where they lie (a
        # run of adjacent chunks spans several fetched pieces).
        end = start + length
        while start < end:
            data, arrival = self.fetched.get((path, start), (None, None))
            if not data:
                raise FileNotFoundError(f"{self.url}/{path}: bytes at {start} were not "
                                        "fetched")
            arrival.wait()
            data = data[:end - start]
            yield data
            start += len(data)

    def size(self, path: str) -> int:
        if path in self.local:
            return super().size(path)
        return self.sizes[path]

    def exists(self, path: str) -> bool:
        return path in self.local or path in self.sizes

    def close(self) -> None:
        """Wait for every message of the exchange (a peer may still be receiving what this
        rank sends), then release the buffers, mappings and descriptors."""
        exchange, self.exchange = getattr(self, "exchange", []), []
        error = None
        for arrival in exchange:
            try:
                arrival.wait()
            except Exception as e:  # a peer died: the others' messages still finish
                error = error or e
        self.fetched = {}
        super().close()
        if error is not None:
            raise error

    def __del__(self) -> None:
        ShmReader.close(self)  # descriptors only: waiting is close()'s (never at exit)


class _Arrival:
    """One message of the exchange (a gloo send or receive) and what must live until it is
    done (the tensor it reads or fills); ``wait`` returns once it is (thread-safe)."""

    def __init__(self, work: Any, keep: Any = None) -> None:
        self._work, self._keep = work, keep
        self._lock = threading.Lock()

    def wait(self) -> None:
        if self._work is None:
            return
        with self._lock:
            if self._work is not None:
                self._work.wait()
                self._work = self._keep = None


def open_candidate(c: Candidate, state: MutableMapping[str, Any], *, shm_dir: str, job: str,
                   node: str, rank: int, pg: Any) -> MemorySource:
    """Agree on who serves each origin rank's files, merge the manifest and start fetching
    the bytes this rank needs (they arrive while the load runs). Collective; raises
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
        doc = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step": c.step,
               "world_size": c.world, "created": first["created"], "tensors": tensors,
               "aliases": first["aliases"], "items": first["items"], "files": files,
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
    out = []
    for key in sorted(needed_tensors(None, "", manifest, wanted, allow_pickle=True)):
        entry = manifest.tensors[key]
        out += [(key, chunk) for chunk, _ in overlapping(entry, read_box(entry,
                                                                         tensors.get(key)))]
    return out


def _exchange(source: MemorySource | None, requests: dict[int, list[tuple[str, str, int, int]]],
              error: str | None, step: int, location: str, shm_dir: str, prefix: str,
              rank: int, pg: Any) -> None:
    """Start sending every rank the byte ranges it asked this rank for, and receiving what
    this rank asked for (into ``source.fetched``; ``source.exchange`` holds every message).
    ``error``: this rank could not plan its reads (all ranks then raise)."""
    world = dist.get_world_size(pg)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (requests, error), group=pg)
    failed = [e for _, e in gathered if e]
    if failed:
        raise CorruptCheckpointError(failed[0])
    asked = [r for r, _ in gathered]
    maps: dict[str, Any] = {}
    outgoing: dict[int, list[torch.Tensor | None]] = {}
    error = None
    for dst in range(world):
        mine = asked[dst].get(rank, []) if dst != rank else []  # own node's: read locally
        if not mine:
            continue
        parts: list[torch.Tensor | None] = []
        try:
            for segment, name, start, length in _runs(mine):
                if not segment.startswith(prefix) or not segment.startswith(PREFIX) \
                        or "/" in segment:
                    raise CorruptCheckpointError(f"asked for {segment}, not a segment of "
                                                 "this node")
                path = os.path.join(shm_dir, segment, location, plain_name(name))
                if path not in maps:
                    maps[path] = _map(path)
                if start + length > len(maps[path]):
                    raise CorruptCheckpointError(f"{path} ends before byte {start + length}")
                parts.append(_bytes_of(maps[path], start, length) if length else None)
        except (OSError, ValueError, CorruptCheckpointError) as e:
            error = f"rank {rank} cannot serve step {step} from memory: {e}"
            break
        outgoing[dst] = parts
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, error, group=pg)
    failed = [e for e in errors if e]
    if failed:
        raise CorruptCheckpointError(failed[0])
    # One message per run of adjacent byte ranges (at most MESSAGE_BYTES, unless one chunk
    # is larger), sent straight from the segment's pages; both sides cut the same request
    # list into the same runs, numbered by tag. Nobody waits here: a read of fetched bytes
    # waits for its message, and MemorySource.close for all of them.
    arrivals = source.exchange
    for src, reqs in requests.items():
        incoming = torch.empty(sum(r[3] for r in reqs), dtype=torch.uint8)
        view, at, pieces = memoryview(incoming.numpy()), 0, iter(reqs)
        for tag, (_, _, _, length) in enumerate(_runs(reqs)):
            arrival = _Arrival(None)
            if length:
                arrival = _Arrival(dist.irecv(incoming[at:at + length],
                                              src=dist.get_global_rank(pg, src), group=pg,
                                              tag=tag), incoming)
                arrivals.append(arrival)
            end = at + length
            while at < end:  # the requests this message carries
                _, name, start, n = next(pieces)
                source.fetched[(f"{location}/{name}", start)] = (view[at:at + n], arrival)
                at += n
        for _, name, start, n in pieces:  # empty requests after the last message
            source.fetched[(f"{location}/{name}", start)] = (view[at:at], _Arrival(None))
    for dst, parts in outgoing.items():
        arrivals += [_Arrival(dist.isend(part, dst=dist.get_global_rank(pg, dst), group=pg,
                                         tag=tag), (part, maps))
                     for tag, part in enumerate(parts) if part is not None]


def _runs(reqs: list[tuple[str, str, int, int]]) -> list[tuple[str, str, int, int]]:
    """Requests with adjacent byte ranges of one file merged, in order, up to MESSAGE_BYTES
    a run (a larger request is a run of its own)."""
    out: list[tuple[str, str, int, int]] = []
    for segment, name, start, length in reqs:
        if out and out[-1][:2] == (segment, name) and out[-1][2] + out[-1][3] == start \
                and out[-1][3] + length <= MESSAGE_BYTES:
            out[-1] = (segment, name, out[-1][2], out[-1][3] + length)
        else:
            out.append((segment, name, start, length))
    return out


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
