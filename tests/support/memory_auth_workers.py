"""Process bodies for tests/memory/test_memory_auth.py. The ranks (run by ``run_ranks``): two
jobs of one user that share a memory job id and node names, so that the second publishes into
the first one's segments; each signs with its own root's memory key. ``hold_a_segment``: a
job that keeps a memory-only step until it is SIGKILLed."""

from __future__ import annotations

import torch

import ckpt


def weights(step: int, rank: int) -> torch.Tensor:
    return torch.full((64,), float(step * 10 + rank))


def save(rank: int, world: int, root: str, shm: str, nodes: list[str], steps: list[int],
         persist_every: int) -> list[int]:
    """Save ``steps`` (each rank its own tensor); the newest may stay in memory only."""
    tier = ckpt.MemoryTierOptions(shm_dir=shm, node=nodes[rank], job="shared",
                                  persist_every=persist_every, keep=4)
    with ckpt.CheckpointManager(root, memory_tier=tier, async_save=False) as mgr:
        for step in steps:
            mgr.save(step, {"w": weights(step, rank)}, force=True)
        return mgr.steps()


def restore(rank: int, world: int, root: str, shm: str, nodes: list[str]) -> dict:
    tier = ckpt.MemoryTierOptions(shm_dir=shm, node=nodes[rank], job="shared",
                                  persist_every=1000)
    state = {"w": torch.zeros(64)}
    with ckpt.CheckpointManager(root, memory_tier=tier, async_save=False) as mgr:
        step = mgr.restore(state)
        return {"step": step, "tier": str(mgr.last_restore.tier),
                "exact": bool(torch.equal(state["w"], weights(step, rank)))}


def hold_a_segment(root: str, shm: str, pipe) -> None:
    """A job that keeps step 1 in memory only, sends its segment's path down ``pipe`` and
    waits to be killed (a process of its own, forked from the fork server)."""
    import time

    tier = ckpt.MemoryTierOptions(shm_dir=shm, node="n0", job="old", persist_every=100)
    mgr = ckpt.CheckpointManager(root, memory_tier=tier, async_save=False)
    mgr.save(1, {"w": torch.full((8,), 7.0)})  # in memory only
    pipe.send(mgr._publisher.tier.path)
    time.sleep(600)
