"""What discovery reports of the saves the live nodes hold: the steps held whole are the
candidates; a step held only in part (some rank's share on no live node) is named, with why,
so a restore that passes it over can say so."""

from __future__ import annotations

import torch.distributed as dist

from ckpt._memory.discovery import Holding, candidates

from tests.support.ranks import run_ranks


def _holding(step: int, origin: int, world: int = 2) -> Holding:
    return Holding(f"ckpt-j-n-r{origin}", step, origin, world, f"token{step}", float(step),
                   False)


def find(rank: int, world: int, held: list[tuple[int, int]]) -> tuple[list[int], dict]:
    partial: dict[int, str] = {}
    found = candidates([_holding(s, o) for s, o in held], dist.group.WORLD, {}, partial)
    return [c.step for c in found], partial


def test_a_step_held_in_part_is_named_with_the_ranks_whose_share_is_lost():
    # Step 4 is held whole; of step 2 only rank 0's share (rank 1's node was lost, and its
    # replica never arrived); step 0 whole again.
    [(steps, partial)] = run_ranks(1, find, [(4, 0), (4, 1), (2, 0), (0, 0), (0, 1)])
    assert steps == [4, 0]
    assert list(partial) == [2]
    assert partial[2].startswith("step 2 is in memory only in part: no live node holds the "
                                 "share of rank 1 of its 2 ")
