"""Bytes a node's ranks would each fetch from another node, fetched once per node.

When a node is replaced, its ranks restore from replicas that other nodes hold; under DDP
(or an HSDP replica dimension) they need the same chunks, and each would pull its own copy
over the network. Here, once the ranks have gathered what each plans to read from which
holder (``ckpt/_memory/plan.py``), every rank computes the same answer:

* a chunk that several ranks of one node fetch from other nodes is *shared* among them, and
  one of them (its owner: the loader's cooperative rule, largest chunks first to the
  needer with the fewest bytes so far) fetches it; the others receive it from the owner
  during the load, over the memory group (``ckpt/_load/cooperative.py``: outcomes agreed
  before bytes are sent, every receiver checks each chunk's digest);
* each rank's planned ranges per holder are ordered: what it fetches itself (its own and
  its owned chunks, then the data files' headers, which every rank reads), then the shared
  chunks its node-mates fetch. A round (``ckpt/_memory/peer_server.py``) sends only the
  first part; the rest stays planned, so that if the exchange fails (the group cannot carry
  the chunks) every rank can still fetch them itself, one request each.

Reads from the node's own memory are never shared (each rank reads its node's pages). By
default ``plan.py`` shares only when the ranks span several hosts (on one host the network
is a copy in memory: sharing saves nothing there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ckpt._load.cooperative import Cooperation, Sharing, assign_owners

#: What a rank reads from one holder: [(segment, file, start, length)], numbered in order.
Requests = dict[int, list[tuple[str, str, int, int]]]

#: Shared chunks travel with tags from here on (the peer protocol's are counted from 1), a
#: window of TAG_WINDOW per restore attempt, so that a message of an attempt that failed
#: half-way is never taken for one of a later attempt.
TAG_BASE = 1 << 30
TAG_WINDOW = 1 << 20
_attempt = [0]  # the last attempt number agreed in this process


def next_attempt() -> int:
    """A number past every attempt this process took part in (gathered: the ranks take the
    largest, :func:`agree_attempt`)."""
    return _attempt[0] + 1


def agree_attempt(numbers: list[int]) -> int:
    """The attempt number every rank uses: the largest gathered."""
    _attempt[0] = max(numbers)
    return _attempt[0]


@dataclass
class Shared:
    """One rank's part of the agreed plan: ``requests`` (holder -> its ranges, in the order
    above), ``rounds`` (holder -> how many of them a round sends), ``cooperation`` (the
    loader's exchange of the shared chunks; None on every rank when nothing is shared)."""

    requests: Requests
    rounds: dict[int, int]
    cooperation: Cooperation | None


def share(chunks: list[Requests], headers: list[Requests], nodes: list[str], location: str,
          rank: int, pg: Any, attempt: int, enabled: bool) -> tuple[Shared, list[Requests]]:
    """Every rank's planned ranges (``chunks``: its chunks' ranges, ``headers``: its data
    files' headers, per holder) and ``nodes`` (each rank's node) -> this rank's part of the
    plan, and what every rank asks of each holder (rank -> holder -> ranges, in order).
    The same on every rank. ``enabled`` False: nothing is shared."""
    world = len(chunks)
    needers: dict[tuple[str, int, str], list[int]] = {}
    sizes: dict[tuple[str, int, str], int] = {}
    if enabled:
        for r, part in enumerate(chunks):
            for ranges in part.values():
                for _, name, start, length in ranges:
                    cid = (f"{location}/{name}", start, nodes[r])
                    needers.setdefault(cid, []).append(r)
                    sizes[cid] = length
    shared = {cid: ranks for cid, ranks in needers.items() if len(ranks) > 1}
    owner = assign_owners(sorted((cid, sizes[cid]) for cid in shared), shared, world)
    asked: list[Requests] = []
    rounds: dict[int, int] = {}
    for r, part in enumerate(chunks):
        ordered: Requests = {}
        for holder in sorted(set(part) | set(headers[r])):
            own, theirs = [], []
            for rng in part.get(holder, []):
                cid = (f"{location}/{rng[1]}", rng[2], nodes[r])
                (own if owner.get(cid, r) == r else theirs).append(rng)
            first = own + headers[r].get(holder, [])
            ordered[holder] = first + theirs
            if r == rank:
                rounds[holder] = len(first)
        asked.append(ordered)
    cooperation = None
    if shared:
        scope = {cid[:2]: cid[2] for cid, ranks in shared.items() if rank in ranks}
        tag_base = TAG_BASE + (attempt % 1023) * TAG_WINDOW
        cooperation = Cooperation(MemoryGroup(pg, rank, world),
                                  Sharing(scope, shared, owner, tag_base))
    return Shared(asked[rank], rounds, cooperation), asked


class MemoryGroup:
    """The memory tier's gloo group as the loader's exchange uses it."""

    enabled = True

    def __init__(self, pg: Any, rank: int, world_size: int) -> None:
        self.pg, self.rank, self.world_size = pg, rank, world_size

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out
