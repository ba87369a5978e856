"""A job that went back to an older step (an explicit restore, a rollback, a newer step that
failed its checks) trains a new line from there: the memory tier keeps the new line's saves
and replicas, and the steps of the line it left (numbered higher) no longer win a restore.
Two real gloo ranks, each one node with a peer replica on the other."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ckpt

from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def _manager(root: str, shm: str, rank: int) -> ckpt.CheckpointManager:
    tier = ckpt.MemoryTierOptions(shm_dir=shm, node=f"node{rank}", job="line",
                                  persist_every=1000)
    return ckpt.CheckpointManager(root, memory_tier=tier, async_save=False)


def _state(value: float) -> dict:
    return {"w": torch.full((64,), value)}


def go_back_and_save(rank: int, world: int, root: str, shm: str) -> dict:
    """Steps 0 (root and memory), 10 and 12 (memory only); then a new attempt restores step 0
    and saves step 2 of a new line; then another restores the newest step."""
    with _manager(root, shm, rank) as mgr:
        for step in (0, 10, 12):
            mgr.save(step, _state(step), force=True)
        assert mgr.wait_replicated(60)
        dist.barrier()
    out = {}
    with _manager(root, shm, rank) as mgr:
        state = _state(-1)
        out["went_back_to"] = mgr.restore(state, step=0)
        state["w"] += 2
        mgr.save(2, state, force=True)
        out["replicated"] = mgr.wait_replicated(60)
        dist.barrier()
        out["in_memory"] = mgr._publisher.tier.steps()
        metrics = mgr.metrics.snapshot()
        out["replica_failures"] = metrics["replication_failures_total"]
    state = _state(-1)
    with _manager(root, shm, rank) as mgr:
        out["restored"] = mgr.restore(state)
        out["tier"] = str(mgr.last_restore.tier)
        out["value"] = state["w"][0].item()
    return out


def test_a_new_line_of_steps_replaces_the_one_it_went_back_from(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    for out in run_ranks(2, go_back_and_save, str(tmp_path / "root"), str(shm), timeout=120):
        assert out["went_back_to"] == 0
        # Step 2 stays in memory (it was retired at once as older than 10 and 12) and its
        # replica reached the peer.
        assert out["in_memory"] == [2] and out["replicated"] and out["replica_failures"] == 0
        assert (out["restored"], out["tier"], out["value"]) == (2, "memory", 2.0)


def test_a_single_process_keeps_the_new_line_too(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    tier = ckpt.MemoryTierOptions(shm_dir=str(shm), job="line1", persist_every=1000)
    root = str(tmp_path / "root")
    with ckpt.CheckpointManager(root, memory_tier=tier, async_save=False) as mgr:
        for step in (0, 10, 12):
            mgr.save(step, _state(step), force=True)
    with ckpt.CheckpointManager(root, memory_tier=tier, async_save=False) as mgr:
        state = _state(-1)
        assert mgr.restore(state, step=0) == 0
        mgr.save(2, _state(2), force=True)
        assert mgr._publisher.tier.steps() == [2]
    state = _state(-1)
    with ckpt.CheckpointManager(root, memory_tier=tier, async_save=False) as mgr:
        assert mgr.restore(state) == 2 and mgr.last_restore.tier == "memory"
    assert state["w"][0].item() == 2.0
