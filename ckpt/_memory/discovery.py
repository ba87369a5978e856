"""What the memory tier holds: the rank steps in this node's segments (own and peer
replicas), and the saves that the live ranks' nodes hold completely, agreed over the group.

Only this user's private directory is listed, only the exact names of this job's and node's
segments, only segments that pass the ownership checks (``ckpt/_memory/private.py``), and
only rank steps whose ``rank.json`` is signed with the job's memory key
(``ckpt/_memory/auth.py``); anything else is skipped with a warning that names it."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ckpt.errors import CorruptCheckpointError
from ckpt._memory.private import UnsafeSegmentError, check_dir, segment_names
from ckpt._memory.tier import node_prefix, rank_steps, read_rank_doc

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
                   docs: dict[tuple[str, int], dict] | None = None, *,
                   key: bytes | None) -> list[Holding]:
    """Every readable rank step signed with ``key`` in this node's segments (``shm_dir``:
    this user's private directory; not collective); ``docs``, when given, receives each
    one's rank document by (segment, step)."""
    prefix = node_prefix(job, node)
    out = []
    for name in segment_names(shm_dir, prefix):  # every rank must reach the collective next
        path = os.path.join(shm_dir, name)
        try:
            check_dir(path, private=True)
            steps = rank_steps(path)
        except UnsafeSegmentError as e:
            log.warning("ckpt._memory.discovery skipping %s", e)
            continue
        except OSError as e:  # e.g. removed meanwhile: this copy is unusable, not fatal
            log.warning("ckpt._memory.discovery skipping %s: %s", path, e)
            continue
        for s in steps:
            try:
                doc = read_rank_doc(path, s, key)
            except CorruptCheckpointError as e:
                log.warning("ckpt._memory.discovery skipping %s", e)
                continue
            out.append(Holding(name, s, doc["rank"], doc["world_size"], doc["token"],
                               float(doc["created"]), name[len(prefix):].startswith("replica-")))
            if docs is not None:
                docs[(name, s)] = doc
    return out


def candidates(mine: list[Holding], pg: Any,
               docs: dict[tuple[str, int], dict] | None = None,
               partial: dict[int, str] | None = None) -> list[Candidate]:
    """Saves that the live ranks' nodes hold completely, newest first (one per step: the
    latest save of that step number); ``docs``: what ``local_holdings`` read. Collective.

    A step some live node holds a share of, but no live node all of, cannot be restored
    from memory: each is logged (the same on every rank) and, when ``partial`` is given,
    put there as step -> why, for the restore's account of what it passed over."""
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
    for step, why in sorted(_partial(saves, created, best).items(), reverse=True):
        log.warning("ckpt._memory.discovery %s", why)
        if partial is not None:
            partial[step] = why
    return [best[s] for s in sorted(best, reverse=True)]


def _partial(saves: dict[tuple[int, str], Candidate], created: dict[tuple[int, str], float],
             complete: dict[int, Candidate]) -> dict[int, str]:
    """step -> why it is not restorable from memory, for each step of which the live nodes
    hold some ranks' shares but no save whole (the latest save of the step number)."""
    out: dict[int, str] = {}
    for key, c in sorted(saves.items(), key=lambda kv: created[kv[0]]):
        if c.step in complete:
            continue
        lost = sorted(set(range(c.world)) - set(c.holders))
        shown = ", ".join(map(str, lost[:8])) + (f" and {len(lost) - 8} more"
                                                 if len(lost) > 8 else "")
        out[c.step] = (f"step {c.step} is in memory only in part: no live node holds the "
                       f"share of rank{'s' if len(lost) > 1 else ''} {shown} of its "
                       f"{c.world} (its node was lost and its replica never arrived, or "
                       "was lost too); not restorable from memory")
    return out
