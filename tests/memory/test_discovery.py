"""What discovery reports of the saves the live nodes hold: the steps held whole are the
candidates; a step held only in part (some rank's share on no live node) is named, with why,
so a restore that passes it over can say so."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
import torch.distributed as dist

import ckpt
from ckpt._memory.discovery import Holding, candidates
from ckpt._memory.tier import private_path

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


NODES = ["nodeA", "nodeB"]


def _model(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.rand(64, 32, generator=g), "b": torch.rand(32, generator=g)}


def _manager(root: str, shm: str, rank: int) -> ckpt.CheckpointManager:
    tier = ckpt.MemoryTierOptions(shm_dir=shm, node=NODES[rank], job="partial",
                                  persist_every=1000)
    return ckpt.CheckpointManager(root, memory_tier=tier, async_save=False)


def restore_past_a_partial_step(rank: int, world: int, root: str, shm: str) -> dict:
    """Steps 0 (root and memory), 2 and 4 (memory only, replicated); node B loses its
    memory, and node A its replica of rank 1's step 4 (as if it never arrived): step 4 is
    held only in part, step 2 whole. A fresh manager restores."""
    with _manager(root, shm, rank) as mgr:
        for step in (0, 2, 4):
            mgr.save(step, {"model": _model(step)}, force=True)
        assert mgr.wait_replicated(60)
        dist.barrier()
    dist.barrier()
    segments = private_path(shm)
    if rank == 1:
        for name in (f"ckpt-partial-{NODES[1]}-r1", f"ckpt-partial-{NODES[1]}-replica-r0"):
            shutil.rmtree(os.path.join(segments, name))
    else:
        shutil.rmtree(os.path.join(segments, f"ckpt-partial-{NODES[0]}-replica-r1",
                                   "step-00000004"))
    dist.barrier()
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("ckpt").addHandler(handler)
    logging.getLogger("ckpt").setLevel(logging.INFO)
    state = {"model": {k: torch.zeros_like(v) for k, v in _model(0).items()}}
    try:
        with _manager(root, shm, rank) as mgr:
            step = mgr.restore(state)
            info = mgr.last_restore
    finally:
        logging.getLogger("ckpt").removeHandler(handler)
    return {"step": step, "tier": str(info.tier),
            "exact": all(torch.equal(state["model"][k], v) for k, v in _model(2).items()),
            "skipped": [(s, str(t), why) for s, t, why in info.skipped],
            "said": [line for line in lines if line.startswith("ckpt.restore step=")]}


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_restore_says_it_passed_over_a_step_held_in_part(tmp_path):
    """The newest step's share of rank 1 is on no live node: both ranks restore step 2 (rank
    1 from rank 0's replica), and both say, in last_restore.skipped and the log line, that
    step 4 was passed over and why."""
    (tmp_path / "shm").mkdir()
    runs = run_ranks(2, restore_past_a_partial_step, str(tmp_path / "root"),
                     str(tmp_path / "shm"), timeout=120)
    assert [(r["step"], r["tier"], r["exact"]) for r in runs] == [(2, "memory", True),
                                                                  (2, "peer", True)]
    for r in runs:
        [(step, tier, why)] = r["skipped"]
        assert (step, tier) == (4, "memory")
        assert why.startswith("step 4 is in memory only in part: no live node holds the "
                              "share of rank 1 of its 2 "), why
        [line] = r["said"]
        assert "skipped=step 4 (memory): step 4 is in memory only in part" in line, line
