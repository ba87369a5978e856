"""Restoring a process group from the memory tier: the ranks agree on the newest step whose rank
steps (ckpt/memory_tier.py) are all held in memory by live nodes — own segments or peer
replicas — and each rank fetches the chunks its (possibly resharded) boxes need: from its own
node's segments directly, from other nodes over the gloo group.

Every function here is collective over ``pg`` (a gloo group) unless it says otherwise; errors
on one rank become an agreed failure on all, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, MutableMapping

import torch
import torch.distributed as dist

from .engine import RankTable, StepPayload, build_manifest
from .errors import CorruptCheckpointError
from .format import MANIFEST_NAME, Manifest, step_dir
from .memory_tier import (PREFIX, node_prefix, open_plain, plain_name, rank_steps,
                          read_rank_doc)
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


class MemorySource:
    """Read-only storage (the subset ckpt's loader uses) over one agreed save: the merged
    manifest, and chunk bytes from this node's segments or fetched from peers.

    ``tier`` is "memory" when every byte this rank needs lies in its node's own segments,
    "peer" when any comes from a replica or another node.
    """

    def __init__(self, url: str, location: str, manifest: bytes) -> None:
        self.url = url
        self.location = location
        self._manifest = manifest
        self.local: dict[str, str] = {}       # path -> file on this node
        self.sizes: dict[str, int] = {}       # path -> the size its rank step recorded
        self.fetched: dict[tuple[str, int], memoryview] = {}  # (path, start) -> bytes
        self.tier = "memory"

    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        if path == f"{self.location}/{MANIFEST_NAME}":
            return self._manifest[start:None if length is None else start + length]
        if path in self.local:
            with self._open(path) as f:
                f.seek(start)
                return f.read(-1 if length is None else length)
        data = self.fetched.get((path, start))
        if data is None or (length is not None and len(data) < length):
            raise FileNotFoundError(f"{self.url}/{path}: bytes at {start} were not fetched")
        return bytes(data[:length])

    def read_into(self, path: str, start: int, out: memoryview) -> None:
        if path in self.local:
            with self._open(path) as f:
                f.seek(start)
                if f.readinto(out) != len(out):
                    raise EOFError(f"{self.local[path]} ends before byte {start + len(out)}")
            return
        data = self.fetched.get((path, start))
        if data is None or len(data) < len(out):
            raise FileNotFoundError(f"{self.url}/{path}: bytes at {start} were not fetched")
        out[:] = data[:len(out)]

    def _open(self, path: str) -> Any:
        try:
            return open_plain(self.local[path])
        except FileNotFoundError:
            raise
        except OSError as e:  # a symbolic link or worse: this copy is unusable, not fatal
            raise FileNotFoundError(f"{self.local[path]}: {e}") from e

    def size(self, path: str) -> int:
        if path in self.local:
            return os.lstat(self.local[path]).st_size
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
    manifest = Manifest.from_json(source._manifest, where=f"step {c.step} in memory")
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
        manifest = build_manifest(payload, merged)
        files = {o: [plain_name(f) for f in t.files] for o, t in tables.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(f"step {c.step} in memory: a rank step is malformed "
                                     f"({e!r})") from e
    source = MemorySource(f"memory:{c.step}", location, manifest.to_json())
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
    outgoing: dict[int, torch.Tensor] = {}
    error = None
    for dst in range(world):
        mine = asked[dst].get(rank, []) if dst != rank else []  # own node's: read locally
        if not mine:
            continue
        parts = []
        try:
            for segment, name, start, length in mine:
                if not segment.startswith(prefix) or not segment.startswith(PREFIX) \
                        or "/" in segment:
                    raise CorruptCheckpointError(f"asked for {segment}, not a segment of "
                                                 "this node")
                path = os.path.join(shm_dir, segment, location, plain_name(name))
                with open_plain(path) as f:
                    f.seek(start)
                    data = f.read(length)
                if len(data) != length:
                    raise CorruptCheckpointError(f"{path} ends before byte {start + length}")
                parts.append(data)
        except (OSError, ValueError, CorruptCheckpointError) as e:
            error = f"rank {rank} cannot serve step {step} from memory: {e}"
            break
        outgoing[dst] = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8) \
            if sum(map(len, parts)) else torch.empty(0, dtype=torch.uint8)
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, error, group=pg)
    failed = [e for e in errors if e]
    if failed:
        raise CorruptCheckpointError(failed[0])
    incoming = {src: torch.empty(sum(r[3] for r in reqs), dtype=torch.uint8)
                for src, reqs in requests.items()}
    works = [dist.irecv(buf, src=dist.get_global_rank(pg, src), group=pg)
             for src, buf in incoming.items() if buf.numel()]
    works += [dist.isend(buf, dst=dist.get_global_rank(pg, dst), group=pg)
              for dst, buf in outgoing.items() if buf.numel()]
    for w in works:
        w.wait()
    fetched: dict[tuple[str, int], memoryview] = {}
    for src, reqs in requests.items():
        view, at = memoryview(incoming[src].numpy()), 0
        for _, name, start, length in reqs:
            fetched[(f"{location}/{name}", start)] = view[at:at + length]
            at += length
    return fetched
