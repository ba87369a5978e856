"""Rank bodies of a memory-tier restore whose peer messages arrive late.

Each rank plays one node of the memory tier (its name from ``nodes[rank]``), with its own
segment directory, as in tests/support/memory_workers.py. The holder's data messages leave only once
the reader waits for one, so a read that does not wait finds no byte of the step.
"""

from __future__ import annotations

import os
import shutil
import threading
from typing import Any

import torch
import torch.distributed as dist

import ckpt
from ckpt._memory import peer_client, peer_server
from ckpt._memory.tier import private_path

SIDE = 128  # "w" is SIDE x SIDE floats (64 KiB: four chunks)


def weights(step: int) -> torch.Tensor:
    return torch.randn(SIDE, SIDE, generator=torch.Generator().manual_seed(step))


def manager(root: str, shm: str, job: str, node: str) -> ckpt.CheckpointManager:
    tier = ckpt.MemoryTierOptions(shm_dir=shm, node=node, job=job, persist_every=1_000_000)
    return ckpt.CheckpointManager(root, memory_tier=tier, async_save=False,
                                  options=ckpt.SaveOptions(chunk_bytes=16 << 10))


def save_in_memory_then_lose_node0(rank: int, world: int, root: str, shm: str, job: str,
                                   nodes: list[str]) -> None:
    """Save steps 1 and 2 to memory only (replicated to the other node), then node 0 loses
    its memory: its own segment and the replica it held."""
    mgr = manager(root, shm, job, nodes[rank])
    for step in (1, 2):
        mgr.save(step, {"w": weights(step)}, force=True)
    assert mgr.wait_replicated(60)
    dist.barrier()
    mgr.close()
    dist.barrier()
    if rank == 0:
        segments = private_path(shm)  # this user's segments under shm
        for name in os.listdir(segments):
            if name.startswith(f"ckpt-{job}-{nodes[0]}-"):
                shutil.rmtree(os.path.join(segments, name))
    dist.barrier()


class _Flag:
    """The file the reading rank creates once it waits for a peer's message."""

    path = ""


def _until(path: str) -> None:
    pause = threading.Event()
    for _ in range(3000):  # (a bound against a hang, not a timing window)
        if os.path.exists(path):
            return
        pause.wait(0.01)
    raise TimeoutError(f"{path} never appeared")


class _Dist:
    """torch.distributed as the memory tier's peer protocol sees it, with a holder's data messages
    sent only once the reader waits for one (until then no byte of them has arrived),
    and a reader's waits for them recorded in _Flag.path."""

    def __init__(self, holder: bool) -> None:
        self._holder = holder

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def isend(self, tensor: torch.Tensor, *args: Any, tag: int = 0, **kwargs: Any) -> Any:
        if self._holder and tag != peer_server.REQUEST_TAG:
            _until(_Flag.path)
        return dist.isend(tensor, *args, tag=tag, **kwargs)

    def irecv(self, *args: Any, **kwargs: Any) -> Any:
        work = dist.irecv(*args, **kwargs)

        class Waited:
            def wait(self) -> Any:
                if not os.path.exists(_Flag.path):
                    open(_Flag.path, "w").close()
                return work.wait()

        return Waited()


def restore_with_late_peer_messages(rank: int, world: int, root: str, shm: str, job: str,
                                    nodes: list[str], flags: str) -> dict:
    """Node 0 lost its memory: rank 0 gets steps 1 and 2 from the replica rank 1 holds,
    whose messages leave only once rank 0 waits for them. Restores the newest step (read in
    one pass), then step 1 (verified first): the step, its tier and whether "w" is exact,
    or the error."""
    peer_client.dist = peer_server.dist = _Dist(holder=rank == 1)
    out = {}
    for case, step in (("newest", None), ("step 1", 1)):
        _Flag.path = os.path.join(flags, case)
        live = {"w": torch.zeros(SIDE, SIDE)}
        mgr = manager(root, shm, job, nodes[rank])
        try:
            got = mgr.restore(live, step=step)
        except ckpt.CheckpointError as e:
            out[case] = {"error": f"{type(e).__name__}: {e}"}
        else:
            out[case] = {"step": got, "tier": mgr.last_restore.tier,
                         "exact": torch.equal(live["w"], weights(got))}
        mgr.close()
        dist.barrier()
    return out
