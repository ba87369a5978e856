"""Cooperative restore: a chunk that several ranks need is read from storage once, by one of
them (its owner), and sent to the others over the process group.

Under DDP every rank restores the whole replicated state; under HSDP the ranks that hold
the same replica of a shard need the same chunks. Read by every rank, the bytes read from
the root (Lustre, S3) are the state times the replica count. Here:

1. Entry (collective, once per attempt): the ranks compare what they need (a digest of
   their chunk lists; the lists themselves only when they differ). A chunk needed by
   several ranks gets one owner among them: the chunks the same ranks need are cut, in
   file order, into one contiguous run of about equal bytes per rank, so that each owner
   reads its share front to back (:func:`assign_owners`; the same on every rank, no
   further exchange).
2. In batches of at most about :data:`BATCH_BYTES` (each a piece of every owner's run),
   each owner reads its chunks of the batch (digested as they land when the load reads in
   one pass; on an object store each run of adjacent chunks in one exact ranged read, past
   the read cache), the ranks exchange their outcomes (a small all_gather), and only then
   does each owner send the bytes to the ranks that need them (send/recv; chunks of
   :data:`DIRECT_BYTES` or more straight from the owner's destination into the
   receiver's, smaller ones packed per pair of ranks).
   Every receiver checks each chunk it received against the digest in its own manifest.
3. A chunk that fails on its owner fails the attempt on every rank with the owner's reason
   (the restore then falls back to an older step on every rank alike).
4. When the group cannot carry the chunks (:class:`GroupFailed`), each rank reads plainly
   only what the exchange left it without (:meth:`Shares.unsettled`): the chunks it read
   itself and those it received whole and checked are in their destinations already.

A load that verifies before it applies (two passes) first has every owner verify its
share, agrees, then runs the exchange as the apply pass: no live byte changes before every
chunk was verified by its owner.

Reads stay plain (every rank reads what it needs) where the group cannot help: no process
group or world 1, a backend that does not carry CPU tensors (NCCL alone: initialize with
``backend="cpu:gloo,cuda:nccl"``), no chunk needed by two ranks, or a collective, send or
receive of the exchange that fails (:class:`GroupFailed`: a failed send or receive is
reported at the next agreement, so that the ranks with nothing to send stop too; logged by
the caller, who then reads plainly). And by default
(:data:`MODE` "auto") where reading once buys nothing: every rank on one host and a root
read through the host's page cache (a file system), where the kernel reads each byte from
the disk once for all of them and the exchange would only add copies over loopback.

The memory tier uses the same exchange for the bytes a node's ranks would each fetch from
another node (``ckpt/_memory/sharing.py``): its plan, agreed before the load, is a
:class:`Sharing` (which of this rank's chunks it shares with which node-mates, and who
fetches each); the chunks it reads from its own node's memory stay its own reads.

Threat model: only the ranks of the job's process group reach this exchange (the same
trust as the commit vote and every other ``all_gather_object`` of ckpt). A rank that sends
wrong bytes (a bug, a flipped bit in its memory) is caught by the receiver's digest check,
unless digests are off (``verify="structure"``), where a peer is trusted as the storage is.
Message sizes come from the receiver's own plan, never from the sender, so a peer cannot
make a receiver allocate more than its batch.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from storage_backends import Storage, reads_are_requests

from ckpt._format.digest import digest
from ckpt._format.manifest import Manifest
from ckpt._format.names import step_dir
from ckpt._load.chunk_read import OpenFiles, mismatch, read_chunk_into, unreadable
from ckpt._load.read_plan import ChunkRead
from ckpt._load.read_run import Scratch, adjacent_runs, run_reads, verify_jobs
from ckpt._shared.buffers import byte_view
from ckpt._shared.distributed import Group
from ckpt._shared.sharding import sub_slices
from ckpt._step.integrity import chunk_path
from ckpt.errors import CorruptCheckpointError

log = logging.getLogger("ckpt")

#: When restores under a process group read replicated chunks together: "auto" (when the
#: ranks span several hosts or the root has no page cache: object stores), "always" or
#: "never" (benchmarks and tests set it to compare or to run on one host).
MODE = "auto"
#: Chunks of at least this many bytes travel in a message of their own, without a copy;
#: smaller ones are packed per pair of ranks (one message instead of thousands).
DIRECT_BYTES = 1 << 20
#: The chunk bytes read and sent per batch, over all ranks: bounds the packing buffers.
BATCH_BYTES = 256 << 20

ChunkId = tuple[str, int]  # (file path, start): one stored chunk
_WARNED: set[str] = set()


class GroupFailed(Exception):
    """A collective of the exchange failed: the caller reads plainly instead."""


@dataclass(frozen=True)
class Sharing:
    """Who reads which chunk, agreed before the load (the memory tier's plan): chunks
    are named ``(path, start, scope)``, a scope being a set of ranks that share them.

    ``scope``: this rank's shared chunks, (path, start) -> their scope; every other chunk
    it reads is its own (scope ``"rank N"``). ``needers`` and ``owner``: every shared
    chunk of every rank -> the ranks that need it, and the one that reads it for them.
    ``tag_base``: the first message tag of the exchange (agreed; clear of the tags others
    use on the same group)."""

    scope: dict[ChunkId, str]
    needers: dict[tuple[str, int, str], list[int]]
    owner: dict[tuple[str, int, str], int]
    tag_base: int = 0


def _carries_cpu_tensors(group: Group) -> bool:
    backend = str(dist.get_backend(group.pg)).lower()
    return "gloo" in backend or "mpi" in backend


class Cooperation:
    """One attempt's cooperation over ``group``: every rank calls :meth:`enter` once, or
    :meth:`abandon` when its attempt failed before it could."""

    def __init__(self, group: Any, sharing: Sharing | None = None) -> None:
        self.group = group  # a Group, or anything with its rank, world_size, pg, all_gather
        self.sharing = sharing
        self.entered = False

    @classmethod
    def of(cls, group: Group) -> Cooperation | None:
        """A cooperation over ``group``, or None where reads stay plain (the same answer on
        every rank)."""
        if MODE == "never" or not group.enabled:
            return None
        if not _carries_cpu_tensors(group):
            backend = str(dist.get_backend(group.pg))
            if backend not in _WARNED:
                _WARNED.add(backend)
                log.info("ckpt.restore: every rank reads the replicated chunks itself: the "
                         "process group's backend %r does not carry CPU tensors (initialize "
                         "with backend='cpu:gloo,cuda:nccl' to read them once per job)",
                         backend)
            return None
        return cls(group)

    def abandon(self, error: BaseException) -> None:
        """This rank's attempt failed before :meth:`enter`: say so to the others (they
        stop too, before reading). Nothing after :meth:`enter`."""
        if not self.entered:
            try:
                self._entry(None, f"{type(error).__name__}: {error}", False)
            except GroupFailed:  # the attempt fails anyway, with this rank's own error
                pass

    def _entry(self, signature: str | None, error: str | None, cached: bool) -> list[Any]:
        self.entered = True
        try:
            return self.group.all_gather((signature, error, socket.gethostname(), cached))
        except RuntimeError as e:
            raise GroupFailed(f"the first exchange failed: {e}") from e

    def enter(self, url: str, location: str, manifest: Manifest, reads: list[ChunkRead], *,
              cached: bool) -> Shares | None:
        """Agree on who reads which chunk (collective); None when reads stay plain (no chunk
        needed by two ranks; in "auto" mode, one host whose page cache serves the root:
        ``cached``). Raises CorruptCheckpointError when another rank's attempt failed."""
        mine: dict[Any, list[ChunkRead]] = {}
        for r in reads:
            cid: Any = (chunk_path(location, r.chunk), r.chunk.start)
            if self.sharing is not None:
                cid = (*cid, self.sharing.scope.get(cid, f"rank {self.group.rank}"))
            mine.setdefault(cid, []).append(r)
        table = sorted((cid, rs[0].chunk.numel * manifest.tensors[rs[0].key].torch_dtype.itemsize)
                       for cid, rs in mine.items())
        signature = hashlib.blake2b(repr(table).encode(), digest_size=16).hexdigest()
        everyone = self._entry(signature, None, cached)
        for rank, (_, error, _, _) in enumerate(everyone):
            if error:
                raise CorruptCheckpointError(
                    f"{url}/{location}: rank {rank} cannot load this step ({error}); rank "
                    f"{self.group.rank} read none of it", path=f"{url}/{location}")
        if self.sharing is None and MODE == "auto" and len({e[2] for e in everyone}) == 1 \
                and all(e[3] for e in everyone):
            return None  # one host, one page cache: the disk is read once anyway
        if self.sharing is None and all(e[0] == signature for e in everyone):
            if not table:
                return None  # no chunk to read at all (plain values alone)
            return Shares(self.group, table, None, mine)  # DDP: every rank needs every chunk
        try:
            tables = self.group.all_gather(table)
        except RuntimeError as e:
            raise GroupFailed(f"exchanging the chunk lists failed: {e}") from e
        needers: dict[Any, list[int]] = {}
        sizes: dict[Any, int] = {}
        for rank, part in enumerate(tables):
            for cid, size in part:
                needers.setdefault(cid, []).append(rank)
                sizes[cid] = size
        if self.sharing is not None:
            return self._preset(needers, sizes, mine, url, location)
        if all(len(ranks) < 2 for ranks in needers.values()):
            return None  # nothing replicated (FSDP): nothing to share
        return Shares(self.group, sorted(sizes.items()), needers, mine)

    def _preset(self, needers: dict[Any, list[int]], sizes: dict[Any, int],
                mine: dict[Any, list[ChunkRead]], url: str, location: str) -> Shares:
        """The agreed sharing's exchange, once every rank's reads are found to be what it
        planned (the same verdict on every rank: all computed from the gathered tables)."""
        sharing = self.sharing
        assert sharing is not None
        planned = {cid: ranks for cid, ranks in sharing.needers.items() if cid in needers}
        differ = [cid for cid, ranks in needers.items()
                  if sorted(ranks) != sorted(planned.get(cid, ranks[:1]))]
        if differ or len(planned) != len(sharing.needers):
            cid = differ[0] if differ else next(c for c in sharing.needers if c not in planned)
            raise CorruptCheckpointError(
                f"{url}/{location}: the ranks' reads differ from the plan they agreed on "
                f"({cid[0]} at {cid[1]}: needed by ranks {needers.get(cid, [])}, planned for "
                f"{sharing.needers.get(cid, [])})", path=f"{url}/{location}")
        return Shares(self.group, sorted(sizes.items()), needers, mine,
                      owner=sharing.owner, tag_base=sharing.tag_base)


class Shares:
    """Who reads which chunk, and the exchange that brings every rank its chunks.

    ``started`` and ``finished`` count the writes into the destinations, as the plain
    apply pass does, for an error that must say which live tensors changed. ``settled``:
    this rank's chunks whose bytes are in every destination and checked as the pass
    checks them (read by this rank, digested as they landed or verified by the verify
    pass; received, and their digests compared when ``check``)."""

    def __init__(self, group: Any, table: list[tuple[Any, int]],
                 needers: dict[Any, list[int]] | None, mine: dict[Any, list[ChunkRead]], *,
                 owner: dict[Any, int] | None = None, tag_base: int = 0) -> None:
        self.group, self.table, self.needers, self.mine = group, table, needers, mine
        self.me = group.rank
        self.owner = assign_owners(table, needers, group.world_size)
        self.owner.update(owner or {})  # agreed before the load: who fetches a shared chunk
        self.tag_base = tag_base
        self.started: set[str] = set()
        self.finished: dict[str, int] = {}
        self.settled: set[Any] = set()
        self._lock = threading.Lock()
        self._global = [dist.get_global_rank(group.pg, r) if group.pg is not None else r
                        for r in range(group.world_size)]

    def holders(self, cid: ChunkId) -> list[int] | range:
        return self.needers[cid] if self.needers is not None else range(self.group.world_size)

    def unsettled(self, reads: list[ChunkRead]) -> list[ChunkRead]:
        """``reads`` less those of the settled chunks: what a plain read after a failed
        exchange still has to do."""
        with self._lock:
            done = {id(r) for cid in self.settled for r in self.mine.get(cid, ())}
        return [r for r in reads if id(r) not in done]

    def owned_reads(self) -> list[ChunkRead]:
        """One read per chunk this rank owns (what it reads from storage)."""
        return [self.mine[cid][0] for cid, _ in self.table if self.owner[cid] == self.me]

    def verify(self, storage: Storage, location: str, scratch: Scratch,
               pool: cf.ThreadPoolExecutor | None,
               before: Callable[[], None] | None = None) -> None:
        """Two-pass loads: every owner verifies its share (after ``before``, the checks of
        the files it reads); raises on every rank when any chunk failed (nothing live
        changed)."""
        error = None
        try:
            if before is not None:
                before()
            run_reads(verify_jobs(storage, location, self.owned_reads(), scratch), pool)
        except Exception as e:
            error = e
        self._agree(error, None, storage.url, location)

    def exchange(self, storage: Storage, location: str, pool: cf.ThreadPoolExecutor | None,
                 *, landing: bool, check: bool,
                 before: Callable[[], None] | None = None) -> None:
        """Fill every destination: each owner reads its chunks (``landing``: digested as
        they land; ``before`` any rank reads, the checks of the files it reads, agreed:
        a read may land in live tensors, which a file another rank found bad must leave
        as they were), then sends them; each receiver checks what it got (``check``)."""
        if before is not None:
            error = None
            try:
                before()
            except Exception as e:
                error = e
            self._agree(error, None, storage.url, location)
        files = OpenFiles(storage)
        received_error: str | None = None
        broken: str | None = None  # the group failed to carry this rank's chunks: agreed next
        try:
            for batch in _batches(self.table, self.owner, self.group.world_size):
                error = None
                try:
                    data = self._read_own(storage, location, batch, files, pool, landing)
                except Exception as e:
                    error, data = e, {}
                self._agree(error, received_error, storage.url, location, broken)
                received_error, broken = self._send_and_receive(batch, data, check, storage)
            self._agree(None, received_error, storage.url, location, broken)
        finally:
            files.close()

    # -- one batch ---------------------------------------------------------------------------
    def _read_own(self, storage: Storage, location: str, batch: list[tuple[ChunkId, int]],
                  files: OpenFiles, pool: cf.ThreadPoolExecutor | None,
                  landing: bool) -> dict[ChunkId, memoryview]:
        data: dict[ChunkId, memoryview] = {}

        def read(cid: ChunkId, size: int) -> None:
            reads = self.mine[cid]
            first = next((r for r in reads if r.into is not None), None)
            self._start(reads)
            if first is not None:
                out = first.into
            else:
                out = byte_view(torch.empty(size, dtype=torch.uint8))
            r = first or reads[0]
            read_chunk_into(storage, location, r.key, r.chunk, out, r.dest.dtype, landing,
                            files)
            for other in reads:
                if other is not first:
                    _place(other, out)
            data[cid] = out
            with self._lock:
                self.settled.add(cid)

        def read_run(run: list[ChunkId]) -> None:
            """Adjacent raw chunks of one file in one exact ranged read: an object store
            read chunk by chunk fetches whole blocks (its read cache), which would carry
            the neighbouring chunks other ranks read."""
            first, last = self.mine[run[0]][0].chunk, self.mine[run[-1]][0].chunk
            buf = byte_view(torch.empty(last.start + last.length - first.start,
                                        dtype=torch.uint8))
            for cid in run:
                self._start(self.mine[cid])
            try:
                storage.read_range_into(run[0][0], first.start, buf)
            except (EOFError, FileNotFoundError, ValueError) as e:
                r = self.mine[run[0]][0]
                raise unreadable(storage, run[0][0], r.key, r.chunk, e) from e
            for cid in run:
                reads = self.mine[cid]
                chunk = reads[0].chunk
                part = buf[chunk.start - first.start:chunk.start - first.start + chunk.length]
                if landing and digest(part) != chunk.digest:
                    raise mismatch(storage, cid[0], reads[0].key, chunk)
                for r in reads:
                    _place(r, part)
                into = next((r.into for r in reads if r.into is not None), None)
                data[cid] = part if into is None else into  # (the run's buffer let go)
                with self._lock:
                    self.settled.add(cid)

        owned = [cid for cid, _ in batch if self.owner[cid] == self.me]
        jobs = []
        if reads_are_requests(storage) and hasattr(storage, "read_range_into"):
            raw = [cid for cid in owned if self.mine[cid][0].chunk.codec == "raw"]
            for run in adjacent_runs(raw, lambda cid: cid[0], lambda cid: self.mine[cid][0].chunk):
                jobs.append((run[0][0], run[0][1], lambda run=run: read_run(run)))
            owned = [cid for cid in owned if self.mine[cid][0].chunk.codec != "raw"]
        sizes = dict(batch)
        jobs += [(cid[0], cid[1], lambda cid=cid: read(cid, sizes[cid])) for cid in owned]
        run_reads(jobs, pool)
        return data

    def _send_and_receive(self, batch: list[tuple[ChunkId, int]],
                          data: dict[ChunkId, memoryview], check: bool,
                          storage: Storage) -> tuple[str | None, str | None]:
        """Post every send and receive of the batch, wait, then check and place what came;
        returns the first chunk that failed its check here (reported at the next
        agreement), or None; and why the sends or receives failed (the group cannot carry
        the chunks), or None."""
        tags: dict[tuple[int, int], int] = {}
        packs: dict[tuple[int, int], list[tuple[ChunkId, int]]] = {}
        sends: list[tuple[int, int, torch.Tensor]] = []
        # (from, tag, buffer, its chunks, the read whose destination is the buffer or None)
        recvs: list[tuple[int, int, torch.Tensor, list[tuple[ChunkId, int]],
                          ChunkRead | None]] = []

        def tag(pair: tuple[int, int]) -> int:
            tags[pair] = tags.get(pair, self.tag_base - 1) + 1
            return tags[pair]

        for cid, size in batch:
            owner = self.owner[cid]
            if size == 0 or (owner != self.me and cid not in self.mine):
                continue
            for n in self.holders(cid):
                if n == owner or (owner != self.me and n != self.me):
                    continue
                if size < DIRECT_BYTES:
                    packs.setdefault((owner, n), []).append((cid, size))
                elif owner == self.me:
                    sends.append((n, tag((owner, n)), _tensor(data[cid])))
                else:
                    first = next((r for r in self.mine[cid] if r.into is not None), None)
                    self._start(self.mine[cid])
                    buf = (_tensor(first.into) if first is not None
                           else torch.empty(size, dtype=torch.uint8))
                    recvs.append((owner, tag((owner, n)), buf, [(cid, size)], first))
        built: dict[tuple[ChunkId, ...], torch.Tensor] = {}  # DDP: one pack for all peers
        for (owner, n), cids in sorted(packs.items()):
            if owner == self.me:
                key = tuple(c for c, _ in cids)
                if key not in built:
                    built[key] = torch.cat([_tensor(data[c]) for c, _ in cids])
                sends.append((n, tag((owner, n)), built[key]))
            else:
                for cid, _ in cids:
                    self._start(self.mine[cid])
                recvs.append((owner, tag((owner, n)),
                              torch.empty(sum(s for _, s in cids), dtype=torch.uint8), cids,
                              None))
        try:
            works = [dist.irecv(buf, src=self._global[o], group=self.group.pg, tag=t)
                     for o, t, buf, _, _ in recvs]
            works += [dist.isend(buf, dst=self._global[n], group=self.group.pg, tag=t)
                      for n, t, buf in sends]
            for w in works:
                w.wait()
        except RuntimeError as e:  # agreed next: ranks with nothing to send must know too
            return None, f"sending the chunks failed: {e}"
        failed = None
        for owner, _, buf, cids, landed in recvs:
            at = 0
            view = byte_view(buf)
            for cid, size in cids:
                part = view[at:at + size]
                at += size
                reads = self.mine[cid]
                if check and failed is None and digest(part) != reads[0].chunk.digest:
                    failed = (f"{mismatch(storage, cid[0], reads[0].key, reads[0].chunk)} "
                              f"(as received from rank {owner}, which read it)")
                for r in reads:
                    if r is not landed:
                        _place(r, part)
                if not check or failed is None:
                    with self._lock:
                        self.settled.add(cid)
        for reads in (self.mine[cid] for cid, _ in batch if cid in self.mine):
            with self._lock:
                for r in reads:
                    self.finished[r.key] = self.finished.get(r.key, 0) + 1
        return failed, None

    def _start(self, reads: list[ChunkRead]) -> None:
        with self._lock:
            self.started.update(r.key for r in reads)

    def _agree(self, error: BaseException | None, received: str | None, url: str,
               location: str, broken: str | None = None) -> None:
        """Every rank's outcome so far; raises on every rank when any rank failed: this
        rank's own error, or the first failing rank's reason; GroupFailed on every rank when
        the group failed to carry some rank's chunks (``broken``: why, on that rank)."""
        mine = f"{error}" if error is not None else received
        try:
            everyone = self.group.all_gather((mine, broken))
        except RuntimeError as e:
            raise GroupFailed(f"agreeing on the reads failed: {e}") from e
        for rank, (_, why) in enumerate(everyone):
            if why:
                raise GroupFailed(f"rank {rank}: {why}")
        if error is not None:
            raise error
        for rank, (why, _) in enumerate(everyone):
            if why:
                raise CorruptCheckpointError(
                    f"rank {rank}, reading its share of the chunks for all ranks: {why}",
                    path=f"{url}/{location}")


def _tensor(view: memoryview) -> torch.Tensor:
    """The bytes of ``view`` as a uint8 tensor sharing its memory."""
    return torch.frombuffer(view, dtype=torch.uint8)


def _place(r: ChunkRead, data: memoryview) -> None:
    """Put a chunk's bytes ``data`` into ``r``'s destination."""
    if r.into is not None:
        r.into[:] = data
        return
    chunk = torch.frombuffer(data, dtype=torch.uint8).view(r.dest.dtype).view(r.chunk.shape)
    r.dest[sub_slices(r.dest_box, r.overlap)].copy_(
        chunk[sub_slices((r.chunk.offsets, r.chunk.shape), r.overlap)])


def owners_of(manifest: Manifest, world: int) -> dict[ChunkId, int]:
    """The rank that reads each chunk of ``manifest`` when each of ``world`` ranks restores
    all of it (DDP): what :class:`Shares` computes for such a restore."""
    location = step_dir(manifest.step)
    table = sorted({((chunk_path(location, c), c.start), c.numel * e.torch_dtype.itemsize)
                    for e in manifest.tensors.values() for c in e.chunks})
    return assign_owners(table, None, world)


def assign_owners(table: list[tuple[ChunkId, int]], needers: dict[ChunkId, list[int]] | None,
                  world: int) -> dict[ChunkId, int]:
    """The rank that reads each chunk. A chunk one rank alone needs is its own. The chunks
    that the same ranks need (every rank's, under DDP) are cut, in file order, into one
    contiguous run per rank (the first to the lowest), cut where the most loaded rank ends
    lowest; the groups with the largest chunks first, so that those of finer chunks even
    out what they left. Each rank then reads its share of a file front to back, as a
    disk's or a parallel file system's readahead serves best: a rank reading every Nth
    chunk would have the kernel read ahead into the chunks between, which others read.
    """
    owner: dict[ChunkId, int] = {}
    load = [0] * world
    groups: dict[tuple[int, ...], list[tuple[ChunkId, int]]] = {}
    if needers is None and table:  # (a tuple of every rank per chunk: seconds at 4,096)
        groups[tuple(range(world))] = sorted(table)
    else:
        for cid, size in sorted(table):  # file order
            ranks = tuple(sorted(needers[cid]))
            if len(ranks) == 1:
                owner[cid] = ranks[0]
                load[ranks[0]] += size
            else:
                groups.setdefault(ranks, []).append((cid, size))
    for ranks in sorted(groups, key=lambda g: (-max(size for _, size in groups[g]), g)):
        chunks = groups[ranks]
        for (cid, size), i in zip(chunks, _runs([size for _, size in chunks],
                                                [load[r] for r in ranks])):
            owner[cid] = ranks[i]
            load[ranks[i]] += size
    return owner


def _runs(sizes: list[int], loads: list[int]) -> list[int]:
    """Chunks of ``sizes`` (in file order) cut into one contiguous run per rank, ranks of
    ``loads`` bytes so far in order: each chunk's rank (an index into ``loads``), the cut
    that leaves the most loaded rank within 1/64 of a chunk of the lowest it can."""
    total, largest = sum(sizes), max(sizes, default=0)
    order = sorted(loads)
    level, below = float(total), 0  # the common level the least loaded would fill up to
    for k, have in enumerate(order):
        below += have
        level = (total + below) / (k + 1)
        if k + 1 == len(order) or level <= order[k + 1]:
            break
    low, high = level, level + largest + 1  # `high` always fits (filled up)
    while high - low > max(1.0, largest / 64):
        middle = (low + high) / 2
        if _fill(sizes, loads, middle) is None:
            low = middle
        else:
            high = middle
    cut = _fill(sizes, loads, high)
    assert cut is not None
    return cut


def _fill(sizes: list[int], loads: list[int], cap: float) -> list[int] | None:
    """Each chunk to the first rank still under ``cap`` with it, in order; None when the
    chunks do not fit."""
    cut, i, have = [], 0, loads[0]
    for size in sizes:
        while have + size > cap:
            i += 1
            if i == len(loads):
                return None
            have = loads[i]
        cut.append(i)
        have += size
    return cut


def _batches(table: list[tuple[ChunkId, int]], owner: dict[ChunkId, int],
             world: int) -> list[list[tuple[ChunkId, int]]]:
    """The exchange's batches, each of at most about :data:`BATCH_BYTES`: each owner's
    chunks, in file order, cut into pieces of an equal part of it (a larger chunk alone);
    batch k holds every owner's k-th piece, so that every owner reads in every batch (its
    chunks are contiguous: cut in plain file order, the first batches would all be rank
    0's)."""
    budget = BATCH_BYTES // max(1, world)
    batches: list[list[tuple[ChunkId, int]]] = [[]]
    piece: dict[int, int] = {}  # owner -> the batch its chunks go to now
    filled: dict[int, int] = {}  # owner -> its bytes in that batch
    for cid, size in sorted(table):  # each batch in file order too
        rank = owner[cid]
        k = piece.setdefault(rank, 0)
        if filled.get(rank, 0) and filled[rank] + size > budget:
            k = piece[rank] = k + 1
            filled[rank] = 0
            if k == len(batches):
                batches.append([])
        batches[k].append((cid, size))
        filled[rank] = filled.get(rank, 0) + size
    return batches
