"""Who reads which replicated chunk in a cooperative restore, and in which batch: each rank
reads one contiguous run of a file (what readahead serves), about as many bytes as every
other rank, and every rank reads in every batch of the exchange."""

from __future__ import annotations

import pytest

from ckpt._load import cooperative
from ckpt._load.cooperative import _batches, assign_owners

MiB = 1 << 20


def runs_of(table, owner, rank):
    """The contiguous runs (in file order) of the chunks ``rank`` owns, per file."""
    runs: dict[str, int] = {}
    last = None
    for cid, _ in sorted(table):
        if owner[cid] == rank and (last is None or last[0] != cid[0] or owner[last] != rank):
            runs[cid[0]] = runs.get(cid[0], 0) + 1
        last = cid
    return runs


def test_every_rank_reads_one_contiguous_quarter_of_a_replicated_file():
    table = [(("step/data-0", i * MiB), MiB) for i in range(256)]
    owner = assign_owners(table, None, 4)
    for rank in range(4):
        mine = sorted(cid[1] // MiB for cid, r in owner.items() if r == rank)
        assert mine == list(range(64 * rank, 64 * rank + 64)), (rank, mine[:5])


def test_uneven_chunks_over_two_files_leave_no_rank_over_its_share_by_a_chunk():
    sizes = [8 * MiB, 3 * MiB, 1 * MiB, 5 * MiB, 7 * MiB, 2 * MiB] * 9
    table, at = [], {"step/a": 0, "step/b": 0}
    for i, size in enumerate(sizes):
        path = "step/a" if i < 30 else "step/b"
        table.append(((path, at[path]), size))
        at[path] += size
    world = 3
    owner = assign_owners(table, None, world)
    total = sum(sizes)
    for rank in range(world):
        mine = sum(size for cid, size in table if owner[cid] == rank)
        assert 0 < mine <= total / world + max(sizes), (rank, mine, total / world)
        assert all(n == 1 for n in runs_of(table, owner, rank).values()), rank


def test_chunks_a_subset_of_ranks_needs_are_split_among_those_ranks_alone():
    """HSDP-like: shard A's chunks are needed by ranks 0 and 2, shard B's by 1 and 3, and
    each rank's own chunks by it alone."""
    table, needers = [], {}
    for i in range(40):
        for path, ranks in (("step/a", [0, 2]), ("step/b", [1, 3])):
            cid = (path, i * MiB)
            table.append((cid, MiB))
            needers[cid] = ranks
    for rank in range(4):
        cid = (f"step/own-{rank}", 0)
        table.append((cid, 4 * MiB))
        needers[cid] = [rank]
    owner = assign_owners(table, needers, 4)
    for cid, ranks in needers.items():
        assert owner[cid] in ranks, cid
    for rank in range(4):
        assert owner[(f"step/own-{rank}", 0)] == rank
        shared = [cid for cid in needers if len(needers[cid]) > 1 and owner[cid] == rank]
        assert len(shared) == 20, (rank, len(shared))
        assert all(n == 1 for p, n in runs_of(table, owner, rank).items()), rank


@pytest.mark.parametrize("world", [2, 4])
def test_every_owner_reads_in_every_batch_of_the_exchange(monkeypatch, world):
    monkeypatch.setattr(cooperative, "BATCH_BYTES", 64 * MiB)
    table = [(("step/data-0", i * MiB), MiB) for i in range(512)]
    owner = assign_owners(table, None, world)
    batches = _batches(table, owner, world)
    assert sorted(c for b in batches for c in b) == sorted(table)  # each chunk once
    for batch in batches:
        assert {owner[cid] for cid, _ in batch} == set(range(world)), batch[:3]
        assert sum(size for _, size in batch) <= 64 * MiB
    for rank in range(world):  # each owner's chunks, batch after batch, in file order
        order = [cid for b in batches for cid, _ in b if owner[cid] == rank]
        assert order == sorted(order)


def test_a_chunk_larger_than_a_batch_travels_in_a_batch_of_its_own_share(monkeypatch):
    monkeypatch.setattr(cooperative, "BATCH_BYTES", 4 * MiB)
    table = [(("step/data-0", 0), 16 * MiB), (("step/data-0", 16 * MiB), 16 * MiB),
             (("step/data-0", 32 * MiB), MiB)]
    owner = assign_owners(table, None, 2)
    batches = _batches(table, owner, 2)
    assert sorted(c for b in batches for c in b) == sorted(table)
    assert all(sum(1 for cid, _ in b if owner[cid] == r) <= 1 for b in batches for r in (0, 1))
