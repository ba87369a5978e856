"""Where a restore reads a step from: the root, this node's own memory, or the peer replicas;
the order they are tried in; and the root's reads counted."""

from __future__ import annotations

import dataclasses
import enum
import threading
from typing import Any, Iterator, MutableMapping, Protocol

from storage_backends import Storage

from ckpt._manager.publisher import MemoryPublisher
from ckpt._shared.distributed import Group


class Tier(str, enum.Enum):
    """Where restored bytes came from; compares equal to its value (``Tier.MEMORY ==
    "memory"``)."""

    STORAGE = "storage"  # the persistent root
    MEMORY = "memory"  # every byte from this node's own shared-memory segments
    PEER = "peer"  # some bytes from a replica or another node's memory

    def __str__(self) -> str:
        return self.value


class RestoreTier(Protocol):
    """One place a restore may read a step from."""

    #: What ``last_restore.tier`` reports when every byte came from here.
    tier: Tier
    #: Tried before the tiers of lower rank at the same step.
    rank: int
    #: Whether the storage ``open`` returns must be closed after the attempt.
    owns_storage: bool

    def open(self, step: int, state: MutableMapping[str, Any], *, probe: bool = False) -> Any:
        """The storage to read ``step`` from (may be collective; may raise
        CorruptCheckpointError on every rank, which skips this tier for the step).
        ``probe``: the load reads the recorded probe too (the forward gate)."""


class RootTier:
    """The persistent root, its reads counted (``bytes_read``)."""

    tier, rank, owns_storage = Tier.STORAGE, 0, False

    def __init__(self, storage: Storage) -> None:
        self.reads = CountedReads(storage)

    def open(self, step: int, state: MutableMapping[str, Any], *,
             probe: bool = False) -> CountedReads:
        return self.reads


class NodeMemoryTier:
    """This node's memory tier: a single process's segment, or a process group's agreed save
    (gathered from this node's segments and the peers; collective)."""

    tier, rank, owns_storage = Tier.MEMORY, 2, True
    second = False  # read each rank's bytes from the copies tried first

    def __init__(self, memory: MemoryPublisher, group: Group,
                 plans: dict[int, Any]) -> None:
        self.memory, self.group, self.plans = memory, group, plans

    def open(self, step: int, state: MutableMapping[str, Any], *, probe: bool = False) -> Any:
        from ckpt._memory.plan import open_candidate
        from ckpt._memory.shm_reader import ShmReader

        mem = self.memory.tier
        if not mem.ranked:
            return ShmReader.of_root(mem.path, mem.key)
        plan = dataclasses.replace(self.plans[step], second=self.second)
        return open_candidate(plan, state, shm_dir=mem.shm_dir, job=mem.job, node=mem.node,
                              rank=self.group.rank, pg=self.memory.pg, probe=probe)


class PeerReplicaTier(NodeMemoryTier):
    """The same agreed save read from the other copies (replicas and other nodes), for when
    the first copies read were found corrupt: tried before the root's."""

    tier, rank = Tier.PEER, 1
    second = True


def restore_order(root: Storage, memory: MemoryPublisher | None, group: Group,
                  candidates: list[int], step: int | None,
                  preferred: frozenset[int] = frozenset(),
                  partial: dict[int, str] | None = None
                  ) -> tuple[RootTier, list[tuple[int, RestoreTier]]]:
    """The root's tier and the (step, tier) pairs to try, newest first (the ``preferred``
    steps, the verified ones, before all others); at the same step memory first, then the
    replicas, then the root. Collective under a process group's memory tier (the ranks
    agree on the saves their nodes hold); the steps the live nodes hold only in part (some
    rank's share on none of them) go into ``partial`` as step -> why."""
    root_tier = RootTier(root)
    order: list[tuple[int, RestoreTier]] = [(s, root_tier) for s in candidates]
    if memory is not None and memory.ranked:
        from ckpt._memory.discovery import candidates as in_memory, local_holdings

        mem = memory.tier
        docs: dict = {}  # the rank documents read while listing, not read again
        mine = local_holdings(mem.shm_dir, mem.job, mem.node, docs, key=mem.key)
        found: dict[int, str] = {}
        plans = {c.step: c for c in in_memory(mine, memory.pg, docs, found)
                 if step in (None, c.step)}
        if partial is not None:
            partial.update((s, why) for s, why in found.items() if step in (None, s))
        own, replicas = NodeMemoryTier(memory, group, plans), PeerReplicaTier(memory, group,
                                                                               plans)
        order += [(s, own) for s in plans]
        order += [(s, replicas) for s, c in plans.items() if c.has_second_copies()]
    elif memory is not None:
        own = NodeMemoryTier(memory, group, {})
        order += [(s, own) for s in memory.tier.steps() if step in (None, s)]
    return root_tier, sorted(order, key=lambda o: (o[0] in preferred, o[0], o[1].rank),
                             reverse=True)


class CountedReads:
    """A storage whose reads are counted (``bytes_read``); everything else is passed on.

    A storage that counts what its responses carried (``bytes_fetched``: an object store,
    whose read cache fetches whole blocks around small reads) is counted by that instead:
    the bytes that crossed the network, not the bytes the load asked for."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._lock = threading.Lock()
        self._asked = 0
        self._fetched_before = getattr(storage, "bytes_fetched", None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)

    @property
    def bytes_read(self) -> int:
        if self._fetched_before is not None:
            return self._storage.bytes_fetched - self._fetched_before
        return self._asked

    def _count(self, n: int) -> None:
        with self._lock:
            self._asked += n

    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        data = self._storage.read(path, start, length)
        self._count(len(data))
        return data

    def read_into(self, path: str, start: int, out: memoryview) -> None:
        self._storage.read_into(path, start, out)
        self._count(memoryview(out).nbytes)

    def read_range_into(self, path: str, start: int, out: memoryview) -> None:
        getattr(self._storage, "read_range_into", self._storage.read_into)(path, start, out)
        self._count(memoryview(out).nbytes)

    def open_reader(self, path: str) -> Any:
        return _CountedReader(self._storage.open_reader(path), self._count)

    def read_blocks(self, path: str, start: int, length: int,
                    buffer: memoryview) -> Iterator[memoryview]:
        blocks = self._storage.read_blocks(path, start, length, buffer)
        try:
            for part in blocks:
                self._count(len(part))
                yield part
        finally:
            blocks.close()


class _CountedReader:
    """A counted ``Storage.open_reader`` handle."""

    def __init__(self, reader: Any, count: Any) -> None:
        self._reader, self._count = reader, count

    def read_into(self, start: int, out: memoryview) -> None:
        self._reader.read_into(start, out)
        self._count(memoryview(out).nbytes)

    def close(self) -> None:
        self._reader.close()
