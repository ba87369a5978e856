"""Rank bodies for tests/memory/test_peer_shared_restore.py: world 4 on two "nodes" of two
ranks (names given to the memory tier, one segment directory), a DDP state saved to memory
only with replicas; the second node is lost and replaced, and its ranks restore what they
need from the replicas the first node holds. The bytes the holders send are counted where
they leave (every range a holder serves goes through ``peer_server._bytes_of``).

The ranks share one host, where by default node-mates each fetch their own (the "network"
is a copy in memory); the bodies share the fetching, as ranks on several hosts do."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time

import torch
import torch.distributed as dist

import ckpt
from ckpt._memory import peer_server
from ckpt._memory.tier import private_path

JOB = "shared"
SAVED = ["nodeA", "nodeA", "nodeB", "nodeB"]
REPLACED = ["nodeA", "nodeA", "nodeC", "nodeC"]  # node B lost; node C is its replacement


def replicated(step: int, mib: int = 4) -> dict[str, torch.Tensor]:
    """A DDP model's state (the same on every rank): two large tensors (``mib`` MiB in all,
    several peer pieces each) and a few small ones."""
    g = torch.Generator().manual_seed(step)
    rows = mib * (1 << 20) // 2 // (1024 * 4)
    out = {f"big{i}": torch.rand(rows, 1024, generator=g) for i in range(2)}
    out.update({f"small{i}": torch.rand(33 + i, 17, generator=g) for i in range(6)})
    return out


def zeroed(state: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def exact(state: dict, step: int, mib: int) -> bool:
    ref = replicated(step, mib)
    return state.keys() == ref.keys() and all(torch.equal(state[k], ref[k]) for k in ref)


def count_served() -> list[int]:
    """From now on, add the length of every range this process serves to a peer."""
    served = [0]
    real = peer_server._bytes_of
    lock = threading.Lock()

    def counted(mapping, start, length):
        with lock:
            served[0] += length
        return real(mapping, start, length)

    peer_server._bytes_of = counted
    return served


def manager(root: str, shm: str, node: str) -> ckpt.CheckpointManager:
    tier = ckpt.MemoryTierOptions(shm_dir=shm, node=node, job=JOB, persist_every=1_000_000)
    return ckpt.CheckpointManager(root, memory_tier=tier, async_save=False)


def save_then_lose_node_b(rank: int, root: str, shm: str, mib: int, step: int = 1) -> None:
    """``step`` in memory only, replicated (node A's ranks hold node B's replicas); then
    node B's memory is gone."""
    mgr = manager(root, shm, SAVED[rank])
    mgr.save(step, {"model": replicated(step, mib)}, force=True)
    assert mgr.wait_replicated(60)
    dist.barrier()
    mgr.close()
    dist.barrier()
    if rank == 0:
        base = private_path(shm)
        for name in os.listdir(base):
            if name.startswith(f"ckpt-{JOB}-nodeB-"):
                shutil.rmtree(os.path.join(base, name))
    dist.barrier()


def restore_once(rank: int, root: str, shm: str, mib: int, served: list[int],
                 step: int = 1, strict: bool = False) -> dict:
    """One restore of the replaced world; what this rank's holders served for it."""
    dist.barrier()
    before = served[0]
    state = {"model": zeroed(replicated(step, mib))}
    mgr = manager(root, shm, REPLACED[rank])
    t0, c0 = time.perf_counter(), time.process_time()
    restored = mgr.restore(state, strict=strict)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    info = mgr.last_restore
    mgr.close()
    return {"step": restored, "tier": str(info.tier),
            "exact": exact(state["model"], restored, mib),
            "served": served[0] - before, "seconds": seconds, "cpu": cpu,
            "from_storage": info.bytes_from_storage,
            "skipped": [(s, str(t), why) for s, t, why in info.skipped],
            "state": sum(t.numel() * t.element_size() for t in replicated(step, mib).values())}


class _NoSends:
    """torch.distributed as the chunk exchange sees it, its sends failing as a closed gloo
    connection's do (the peer protocol's own sends still work)."""

    def __getattr__(self, name: str):
        return getattr(dist, name)

    @staticmethod
    def isend(*args, **kwargs):
        raise RuntimeError("[gloo] Connection closed by peer (injected)")


def replaced_node_restores(rank: int, world: int, root: str, shm: str, mib: int = 4) -> dict:
    """Step 1 in the root, step 2 in memory only (a memory tier's segments stay after its
    manager closes only while their newest step is not in the root); node B lost; node C's
    ranks restore six times: by default (one host: each fetches its own), then sharing as
    across hosts: in one pass, strict (two passes), with the exchange unable to send, with
    rank 2 damaging what it sends its node-mate, and with rank 0 (a holder) damaging what
    it serves."""
    from ckpt._load import cooperative

    with ckpt.CheckpointManager(root, async_save=False) as plain:  # the next source
        plain.save(1, {"model": replicated(1, mib)}, force=True)
    save_then_lose_node_b(rank, root, shm, mib, step=2)
    served = count_served()
    out = {"one_host": restore_once(rank, root, shm, mib, served, 2)}  # the default
    cooperative.MODE = "always"  # as on several hosts
    out.update({"one_pass": restore_once(rank, root, shm, mib, served, 2),
                "strict": restore_once(rank, root, shm, mib, served, 2, strict=True)})

    lines = log_lines()
    real_dist = cooperative.dist
    cooperative.dist = _NoSends()
    try:
        out["cannot_send"] = restore_once(rank, root, shm, mib, served, 2)
    finally:
        cooperative.dist = real_dist
    out["cannot_send"]["logged"] = [line for line in lines if "reads what it needs" in line]

    real_read = cooperative.read_chunk_into
    if rank == 2:  # reads its share (digests pass), then damages what it sends
        def read_then_damage(storage, location, key, chunk, view, *args, **kwargs):
            real_read(storage, location, key, chunk, view, *args, **kwargs)
            if location == "step-00000002" and len(view):  # (step 1: the root's)
                view[0] ^= 0x01
        cooperative.read_chunk_into = read_then_damage
    try:
        out["bad_mate"] = restore_once(rank, root, shm, mib, served, 2)
    finally:
        cooperative.read_chunk_into = real_read

    real_bytes = peer_server._bytes_of
    if rank == 0:  # a holder serving damaged data (the headers left intact)
        def damaged(mapping, start, length):
            data = real_bytes(mapping, start, length)
            if length < 64 << 10:
                return data
            data = data.clone()
            data[length // 2] ^= 0x01
            return data
        peer_server._bytes_of = damaged
    try:
        out["bad_holder"] = restore_once(rank, root, shm, mib, served, 2)
    finally:
        peer_server._bytes_of = real_bytes
    return out


def plain_then_shared(rank: int, world: int, root: str, shm: str, mib: int,
                      reps: int) -> list[dict]:
    """For the benchmark: after a warm-up, ``reps`` restores with the sharing off (every
    rank fetches from the peers) and on, interleaved (which goes first alternates)."""
    from ckpt._load import cooperative

    save_then_lose_node_b(rank, root, shm, mib)
    served = count_served()
    restore_once(rank, root, shm, mib, served)  # warm-up (a process's first restore)
    runs = []
    for rep in range(reps):
        for mode in ("never", "always")[::1 if rep % 2 else -1]:
            cooperative.MODE = mode
            dist.barrier()
            runs.append({"mode": mode, **restore_once(rank, root, shm, mib, served)})
    cooperative.MODE = "auto"
    return runs


def log_lines() -> list[str]:
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("ckpt").addHandler(handler)
    return lines
