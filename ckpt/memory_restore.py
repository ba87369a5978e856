"""Restoring a process group from the memory tier: the ranks agree on the newest step whose rank
steps (ckpt/memory_tier.py) are all held in memory by live nodes — own segments or peer
replicas — and each rank fetches the chunks its (possibly resharded) boxes need: from its own
node's segments directly, from other nodes over the gloo group.

Every function here is collective over ``pg`` (a gloo group) unless it says otherwise; errors
on one rank become an agreed failure on all, so no rank is left waiting in a collective.
"""

from __future__ import annotations

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

from .engine import RankTable, StepPayload, build_manifest
from .errors import CorruptCheckpointError
from .format import MANIFEST_NAME, Manifest, step_dir
from .memory_tier import PREFIX, node_prefix, plain_name, rank_steps, read_rank_doc
from .sharding import local_piece, overlapping
from .state import flatten, is_stateful

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
    (replicas and other nodes first), for when that attempt found a copy corrupt."""

    step: int
    token: str
    world: int
    holders: dict[int, list[tuple[int, Holding]]] = field(default_factory=dict)
    second: bool = False

    def has_second_copies(self) -> bool:
        return any(len(h) > 1 for h in self.holders.values())


def local_holdings(shm_dir: str, job: str, node: str) -> list[Holding]:
    """Every readable rank step in this node's segments (not collective)."""
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
    return out


def candidates(mine: list[Holding], pg: Any) -> list[Candidate]:
    """Saves that the live ranks' nodes hold completely, newest first (one per step: the
    latest save of that step number). Collective."""
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

    ``tier`` is "memory" when every byte this rank needs lies in its node's own segments,
    "peer" when any comes from a replica or another node.
    """

    def __init__(self, url: str, location: str, manifest: Manifest) -> None:
        super().__init__(url, lambda path: self.local.get(path))
        self.location = location
        self.parsed_manifest = manifest  # validated (built from the rank steps, parsed)
        self._manifest = manifest.to_json()
        self.local: dict[str, str] = {}       # path -> file on this node
        self.sizes: dict[str, int] = {}       # path -> the size its rank step recorded
        self.fetched: dict[tuple[str, int], memoryview] = {}  # (path, start) -> bytes
        self.tier = "memory"

    def _got(self, path: str, start: int, length: int) -> memoryview:
        data = self.fetched.get((path, start))
        if data is None or len(data) < length:
            raise FileNotFoundError(f"{self.url}/{path}: bytes at {start} were not fetched")
        return data[:length]

    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        if path == f"{self.location}/{MANIFEST_NAME}":
            return self._manifest[start:None if length is None else start + length]
        if path in self.local:
            return super().read(path, start, length)
        if length is None:
            length = len(self.fetched.get((path, start), b""))
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
            data = self.fetched.get((path, start))
            if not data:
                raise FileNotFoundError(f"{self.url}/{path}: bytes at {start} were not "
                                        "fetched")
            data = data[:end - start]
            yield data
            start += len(data)

    def size(self, path: str) -> int:
        if path in self.local:
            return super().size(path)
        return self.sizes[path]

    def exists(self, path: str) -> bool:
        return path in self.local or path in self.sizes


def open_candidate(c: Candidate, state: MutableMapping[str, Any], *, shm_dir: str, job: str,
                   node: str, rank: int, pg: Any) -> MemorySource:
    """Agree on who serves each origin rank's files, merge the manifest and fetch the bytes
    this rank needs. Collective; raises CorruptCheckpointError on every rank when any rank
    cannot read or serve its part (the caller falls through to the next tier)."""
    world = dist.get_world_size(pg)
    prefix = node_prefix(job, node)
    # Each origin's rank step document comes from its first holder (any copy: the digests
    # inside are checked against the data as it is loaded).
    docs, error = {}, None
    for origin, holders in sorted(c.holders.items()):
        holder_rank, h = holders[0]
        if holder_rank == rank:
            try:
                docs[origin] = read_rank_doc(os.path.join(shm_dir, h.segment), c.step)
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
    fetched = _exchange(requests, error, c.step, location, shm_dir, prefix, rank, pg)
    source.fetched = fetched
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
    ranks hold (a replicated tensor) is taken from the first of them in ``order``."""
    first = docs[0]
    try:
        tables = {o: RankTable.from_json(d["table"]) for o, d in docs.items()}
        for o, d in docs.items():
            if d["token"] != c.token or d["rank"] != o:
                raise ValueError(f"rank {o}'s document names another save")
        payload = StepPayload(
            step=c.step, name=location, pieces={},
            tensors={k: (d, tuple(s)) for k, (d, s) in first["tensors"].items()},
            items=first["items"], aliases=first["aliases"], metadata=first["metadata"],
            world_size=c.world)
        seen: set = set()
        merged = []
        for o in order:
            table = tables[o]
            chunks = [(k, ch) for k, ch in table.chunks if (k, ch.offsets) not in seen]
            seen.update((k, ch.offsets) for k, ch in chunks)
            merged.append(RankTable(table.files, chunks))
        # Parsed back from its JSON: the same validation as any manifest read from a root.
        manifest = Manifest.from_json(build_manifest(payload, merged).to_json(),
                                      where=f"step {c.step} in memory")
        files = {o: [plain_name(f) for f in t.files] for o, t in tables.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(f"step {c.step} in memory: a rank step is malformed "
                                     f"({e!r})") from e
    source = MemorySource(f"memory:{c.step}", location, manifest)
    source.sizes = {f"{location}/{name}": size for t in tables.values()
                    for name, size in t.files.items()}
    return source, files


def _needed_chunks(manifest: Manifest, state: MutableMapping[str, Any], rank: int) -> list:
    """(key, chunk) this rank's load reads: the chunks overlapping its live boxes, and every
    chunk of a tensor it holds no (same-shaped) live tensor for."""
    live = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) or is_stateful(v)}
    tensors = flatten(live, allow_pickle=True, rank=rank, keep_vars=True).tensors
    out = []
    for key, entry in manifest.tensors.items():
        target = tensors.get(key)
        box = ((0,) * len(entry.shape), entry.shape)
        if target is not None:
            _, offsets, local = local_piece(target)
            if tuple(target.shape) == entry.shape:
                box = (offsets, tuple(local.shape))
        out += [(key, chunk) for chunk, _ in overlapping(entry, box)]
    return out


def _exchange(requests: dict[int, list[tuple[str, str, int, int]]], error: str | None,
              step: int, location: str, shm_dir: str, prefix: str, rank: int, pg: Any) -> dict:
    """Send every rank the byte ranges it asked this rank for; receive what this rank asked
    for. Returns (path, start) -> bytes. ``error``: this rank could not plan its reads (all
    ranks then raise)."""
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
    # One message per run of adjacent byte ranges, sent straight from the segment's pages;
    # both sides cut the same request list into the same runs, numbered by tag.
    incoming = {src: torch.empty(sum(r[3] for r in reqs), dtype=torch.uint8)
                for src, reqs in requests.items()}
    works = []
    for src, reqs in requests.items():
        at = 0
        for tag, (_, _, _, length) in enumerate(_runs(reqs)):
            if length:
                works.append(dist.irecv(incoming[src][at:at + length],
                                        src=dist.get_global_rank(pg, src), group=pg, tag=tag))
            at += length
    for dst, parts in outgoing.items():
        works += [dist.isend(part, dst=dist.get_global_rank(pg, dst), group=pg, tag=tag)
                  for tag, part in enumerate(parts) if part is not None]
    for w in works:
        w.wait()
    del outgoing, maps  # the mappings go with the last tensor over them
    fetched: dict[tuple[str, int], memoryview] = {}
    for src, reqs in requests.items():
        view, at = memoryview(incoming[src].numpy()), 0
        for _, name, start, length in reqs:
            fetched[(f"{location}/{name}", start)] = view[at:at + length]
            at += length
    return fetched


def _runs(reqs: list[tuple[str, str, int, int]]) -> list[tuple[str, str, int, int]]:
    """Requests with adjacent byte ranges of one file merged, in order."""
    out: list[tuple[str, str, int, int]] = []
    for segment, name, start, length in reqs:
        if out and out[-1][:2] == (segment, name) and out[-1][2] + out[-1][3] == start:
            out[-1] = (segment, name, out[-1][2], out[-1][3] + length)
        else:
            out.append((segment, name, start, length))
    return out


def _map(path: str) -> Any:
    """A read-only shared mapping of a segment's file (never through a symbolic link); its
    pages are in RAM already (tmpfs), so mapping them costs page-table entries, no copy.
    Nothing truncates a committed step's files (writers publish new directories by rename)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if not size:
            return b""
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                         prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def _bytes_of(mapping: Any, start: int, length: int) -> torch.Tensor:
    """``length`` bytes of ``mapping`` from ``start`` as a tensor, not copied (only sent)."""
    with warnings.catch_warnings():  # read-only memory: the tensor is never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8, count=length, offset=start)
