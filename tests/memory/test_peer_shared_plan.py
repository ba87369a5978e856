"""The plan of who fetches a chunk that several ranks of a node need from other nodes
(``ckpt/_memory/sharing.py``), computed from the ranks' gathered requests: the same answer
on every rank, one fetcher per chunk and node, and the ranges a node-mate fetches kept in
the plan after the rest (a round sends only the rest); and the loader's exchange following
it. No processes: the plan is a pure function of what the ranks gathered, and the gathers
of the exchange are answered as the other ranks would."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from ckpt._load.cooperative import Cooperation, Sharing
from ckpt._memory.sharing import share
from ckpt.errors import CorruptCheckpointError

LOC = "step-00000002"
A, C = "ckpt-j-nodeA-", "ckpt-j-nodeC-"
NODES = [A, A, C, C]  # ranks 0, 1 on node A; 2, 3 on node C (replacing a lost node)
BIG = [("ckpt-j-nodeA-r0", "data-0", 64 + i * (4 << 20), 4 << 20) for i in range(4)]
HEAD = [("ckpt-j-nodeA-r0", "data-0", 0, 8), ("ckpt-j-nodeA-r0", "data-0", 8, 56)]
OWN3 = ("ckpt-j-nodeA-replica-r3", "data-3", 64, 1024)  # rank 3's own per-rank chunk


def gathered():
    """Ranks 0 and 1 read their node's memory (nothing from peers); ranks 2 and 3 fetch
    the same four chunks from rank 0; rank 3 also one chunk of its own from rank 1."""
    chunks = [{}, {}, {0: list(BIG)}, {0: list(BIG), 1: [OWN3]}]
    headers = [{}, {}, {0: list(HEAD)}, {0: list(HEAD), 1: [OWN3[:2] + (0, 8)]}]
    return chunks, headers


def plan(rank: int, enabled: bool = True):
    chunks, headers = gathered()
    return share(chunks, headers, NODES, LOC, rank, None, 7, enabled)


def test_each_chunk_node_mates_share_is_fetched_by_one_of_them():
    """Ranks 2 and 3 split the four shared chunks (two each: the fewest bytes so far), and
    every rank computes the same split."""
    mine2, asked = plan(2)
    for rank in range(4):
        assert plan(rank)[1] == asked  # the same answer everywhere
    sharing = mine2.cooperation.sharing
    owners = [sharing.owner[(f"{LOC}/data-0", start, C)] for _, _, start, _ in BIG]
    assert sorted(owners) == [2, 2, 3, 3]
    assert all(ranks == [2, 3] for ranks in sharing.needers.values())
    # Rank 3's own chunk and every node A read are no one else's business.
    assert set(sharing.needers) == {(f"{LOC}/data-0", start, C) for _, _, start, _ in BIG}


def test_a_round_sends_what_the_rank_fetches_itself_and_the_rest_stays_planned():
    for rank in (2, 3):
        mine, _ = plan(rank)
        owner = mine.cooperation.sharing.owner
        ranges = mine.requests[0]
        count = mine.rounds[0]
        fetched, left = ranges[:count], ranges[count:]
        assert all(owner[(f"{LOC}/data-0", s, C)] == rank for _, _, s, _ in fetched[:2])
        assert fetched[2:] == HEAD  # every rank reads the headers itself
        assert all(owner[(f"{LOC}/data-0", s, C)] != rank for _, _, s, _ in left)
        assert sorted(fetched[:2] + left) == sorted(BIG)  # nothing dropped from the plan
    mine3, _ = plan(3)
    assert mine3.requests[1] == [OWN3, OWN3[:2] + (0, 8)] and mine3.rounds[1] == 2


def test_ranks_of_different_nodes_never_share():
    """A chunk ranks of node A and node C both fetch stays each one's own."""
    chunks, headers = gathered()
    chunks[1] = {2: [("ckpt-j-nodeC-x", "data-9", 64, 100)]}
    chunks[2][2] = [("ckpt-j-nodeC-x", "data-9", 64, 100)]  # (as if held elsewhere)
    mine, _ = share(chunks, headers, [A, A, "ckpt-j-nodeB-", C], LOC, 2, None, 7, True)
    assert mine.cooperation is None  # ranks 2 and 3 on different nodes: nothing shared


def test_turned_off_every_rank_fetches_everything_in_one_round():
    for rank in range(4):
        mine, _ = plan(rank, enabled=False)
        assert mine.cooperation is None
        for holder, ranges in mine.requests.items():
            assert mine.rounds[holder] == len(ranges)
    assert plan(2, enabled=False)[0].requests[0] == BIG + HEAD  # as planned, in order


class _Ranks:
    """The gathers of one rank's Cooperation.enter, answered with what the other ranks
    would send: the entry (no errors), then each rank's chunk table."""

    def __init__(self, rank: int, tables: list[list]) -> None:
        self.rank, self.world_size, self.pg, self.enabled = rank, len(tables), None, True
        self.tables, self.calls = tables, 0

    def all_gather(self, obj):
        self.calls += 1
        if self.calls == 1:
            return [obj] * self.world_size
        return [obj if r == self.rank else t for r, t in enumerate(self.tables)]


def _enter(rank3_table):
    """Rank 2 enters the exchange of two chunks it shares with rank 3 (owners 2 and 3)."""
    path = f"{LOC}/data-0"
    ids = [(path, 64, C), (path, 80, C)]
    sharing = Sharing({(path, 64): C, (path, 80): C}, {i: [2, 3] for i in ids},
                      dict(zip(ids, [2, 3])), tag_base=1 << 30)
    reads = [NS(key="w", chunk=NS(file="data-0", step=None, start=s, numel=4))
             for s in (64, 80)]
    manifest = NS(tensors={"w": NS(torch_dtype=torch.float32)})
    group = _Ranks(2, [[], [], None, rank3_table])
    return Cooperation(group, sharing).enter("memory:2", LOC, manifest, reads, cached=True)


def test_the_loader_follows_the_agreed_owners_and_refuses_reads_that_differ():
    """The loader's exchange takes the owners the plan agreed on; if a rank's reads are not
    what the plan said (a chunk missing), every rank refuses the step alike (computed from
    the same gathered tables), before any byte moves."""
    path = f"{LOC}/data-0"
    shares = _enter([((path, 64, C), 16), ((path, 80, C), 16)])
    assert shares.owner[(path, 64, C)] == 2 and shares.owner[(path, 80, C)] == 3
    assert shares.tag_base == 1 << 30
    with pytest.raises(CorruptCheckpointError, match="differ from the plan"):
        _enter([((path, 64, C), 16)])  # rank 3 does not read the chunk at 80
