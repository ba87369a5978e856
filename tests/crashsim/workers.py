"""Rank bodies for the sharded scenario (top-level: spawn imports them by name)."""

from __future__ import annotations

import torch.distributed as dist

import ckpt

from .record import recording, snapshot_tree
from .scenarios import OPTIONS, values


def sharded_save(rank: int, world: int, root: str) -> dict:
    """Save step 1 on every rank, then record each rank's share of saving step 2."""
    with ckpt.CheckpointManager(root, async_save=False, options=OPTIONS, metrics=False,
                                schedule=ckpt.Schedule(handle_sigterm=False)) as mgr:
        mgr.save(1, values(1), force=True)
        dist.barrier()
        base = snapshot_tree(root) if rank == 0 else None
        dist.barrier()
        with recording(root, tag=rank) as trace:
            mgr.save(2, values(2), force=True)
        dist.barrier()
    return {"base": base, "trace": trace}
