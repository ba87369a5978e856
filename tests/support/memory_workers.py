"""Rank bodies for test_memory_peer.py (top-level functions: spawn imports them by name).

Each rank plays one "node": its name (``ckpt.MemoryTierOptions(node=...)``) comes from
``nodes[rank]``, as CKPT_NODE or torchrun's GROUP_RANK would name it, and every test has its
own segment directory (``shm_dir=``) instead of /dev/shm.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import threading

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ckpt
from ckpt._memory.tier import private_path  # where a user's segments live under shm


def values(step: int) -> dict[str, torch.Tensor]:
    """The global tensors of ``step`` (the same on every rank and world size)."""
    g = torch.Generator().manual_seed(step)
    # "w": 1 MiB per shard at world 3, so a chunk spans several 512 KiB read blocks (a
    # one-pass load digests them where they land, at offsets inside fetched chunks)
    return {"w": torch.randn(12, 65536, generator=g), "lin": torch.randn(4, 8, generator=g),
            "grad": torch.randn(4, 8, generator=g)}


def build(world: int, step: int | None) -> dict:
    """Step ``step``'s state (None: a different, fresh one to restore into): a row-sharded
    DTensor, a replicated model, its Adam state after one step, and a per-rank counter."""
    mesh = init_device_mesh("cpu", (world,))
    v = values(step if step is not None else 10_000)
    model = torch.nn.Linear(8, 4, bias=False)
    with torch.no_grad():
        model.weight.copy_(v["lin"])
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model.weight.grad = v["grad"].clone()
    opt.step()
    return {"w": distribute_tensor(v["w"], mesh, [Shard(0)]), "model": model, "opt": opt}


def mismatches(state: dict, step: int, world: int) -> list[str]:
    """What differs from step ``step``'s state, element for element."""
    ref = build(world, step)
    bad = [] if torch.equal(state["w"].full_tensor(), ref["w"].full_tensor()) else ["w"]
    bad += [f"model.{k}" for k, t in ref["model"].state_dict().items()
            if not torch.equal(state["model"].state_dict()[k], t)]
    ours, theirs = state["opt"].state_dict()["state"], ref["opt"].state_dict()["state"]
    bad += [f"opt.{p}.{k}" for p in theirs for k, t in theirs[p].items()
            if not torch.equal(torch.as_tensor(ours[p][k]), torch.as_tensor(t))]
    return bad


def manager(root: str, shm: str, job: str, node: str, *, persist_every: int = 1,
            **kw) -> ckpt.CheckpointManager:
    tier = ckpt.MemoryTierOptions(shm_dir=shm, node=node, job=job, persist_every=persist_every)
    return ckpt.CheckpointManager(root, memory_tier=tier, async_save=False, **kw)


def save_steps(rank: int, world: int, root: str, shm: str, job: str, nodes: list[str],
               steps: list[int], persist_every: int, hold_flag: str | None = None) -> dict:
    """Save ``steps``; wait until every replica is stored before anyone closes.

    With ``hold_flag``, rank 1 holds its replica receiver through the first save: rank 0's
    save must return all the same (its replica can only be stored after rank 1 lets go, which
    it does once rank 0 wrote the flag file after its save returned)."""
    mgr = manager(root, shm, job, nodes[rank], persist_every=persist_every)
    out: dict = {}
    if hold_flag and rank == 1:
        mgr._publisher.replicator.hold.clear()  # the receiver stops before storing anything
    for i, step in enumerate(steps):
        mgr.save(step, build(world, step), force=True)  # synchronous: published here
        if hold_flag and i == 0:
            if rank == 0:
                out["replica_before_release"] = replica_steps(shm, nodes[1])
                open(hold_flag, "w").close()  # no collective: rank 1 may be anywhere
            else:
                pause = threading.Event()
                while not os.path.exists(hold_flag):
                    pause.wait(0.01)
                mgr._publisher.replicator.hold.set()
    out["replicated"] = mgr.wait_replicated(60)
    dist.barrier()
    metrics = mgr.metrics.snapshot()
    mgr.close()
    out.update(replications=metrics["replications_total"],
               failures=metrics["replication_failures_total"])
    return out


def replica_steps(shm: str, node: str) -> list[str]:
    """The replica steps held on ``node``."""
    return sorted(f"{n}/{s}" for n in os.listdir(private_path(shm)) if f"-{node}-replica-" in n
                  for s in os.listdir(os.path.join(private_path(shm), n)) if s.startswith("step-"))


def restore(rank: int, world: int, root: str, shm: str, job: str, nodes: list[str]) -> dict:
    """A restarted world restores; returns the step, where it came from and what differs."""
    state = build(world, None)
    mgr = manager(root, shm, job, nodes[rank])
    step = mgr.restore(state)
    info = mgr.last_restore
    bad = mismatches(state, step, world) if step is not None else ["nothing restored"]
    mgr.close()
    return {"step": step, "tier": info.tier if info else None,
            "bytes": info.bytes_from_storage if info else None, "mismatches": bad,
            "ranks": info.ranks if info else None}


def restore_after_node_loss(rank: int, world: int, root: str, shm: str, job: str,
                            nodes: list[str], root_aside: str) -> dict:
    """World 2 after node 3 was lost, restores in a row (rank 0 breaks things between them):
    from the peer replicas with the root's data moved aside; with a bit flipped in rank 0's
    own copy of step 3 (its replica on node 2 is good); with a bit flipped in the only
    copy left of the lost rank's step 3 (its replica); with that replica gone (so both copies
    of the lost rank's shards are gone) and the root's data back; and with a newer step in
    the root than in memory."""
    out = {"peer": restore(rank, world, root, shm, job, nodes)}
    if rank == 0:
        flip_chunk(os.path.join(private_path(shm), f"ckpt-{job}-{nodes[0]}-r0", "step-00000003"), "w")
    dist.barrier()
    out["own_flipped"] = restore(rank, world, root, shm, job, nodes)
    replica = os.path.join(private_path(shm), f"ckpt-{job}-{nodes[0]}-replica-r2")
    if rank == 0:
        flip_chunk(os.path.join(replica, "step-00000003"), "w")
    dist.barrier()
    out["flipped"] = restore(rank, world, root, shm, job, nodes)
    if rank == 0:
        shutil.rmtree(replica)
        for name in os.listdir(root_aside):
            os.rename(os.path.join(root_aside, name), os.path.join(root, "step-00000002", name))
    dist.barrier()
    out["both_gone"] = restore(rank, world, root, shm, job, nodes)
    with ckpt.CheckpointManager(root, async_save=False) as plain:  # the root alone
        plain.save(4, build(world, 4), force=True)
    out["root_newer"] = restore(rank, world, root, shm, job, nodes)
    return out


def flip_chunk(step_path: str, key: str) -> None:
    """Flip one bit in the middle of every chunk of ``key`` in a rank step."""
    with open(os.path.join(step_path, "rank.json")) as f:
        doc = json.load(f)
    for k, chunk in doc["table"]["chunks"]:
        if k == key:
            with open(os.path.join(step_path, chunk["file"]), "r+b") as f:
                f.seek(chunk["start"] + chunk["length"] // 2)
                byte = f.read(1)[0]
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte ^ 0x01]))


def rng_save_and_restore(rank: int, world: int, root: str, shm: str, job: str,
                         nodes: list[str]) -> dict:
    """Each rank seeds its RNGs differently, saves step 1 to memory only (the root never
    holds it) with a replica on the other node, and records what its generators give next.
    Then, with other draws in between, restores from its own memory; then rank 1's node
    loses its memory and both restore again, strict (rank 1's values from the replica on
    node 0, in 1 KiB pieces: verify pass and apply pass).
    Each rank step is then cut down to its own rank's RNG values (what a rank needs to
    carry). Returns, per restore, the tier and whether the next draws equal the recorded
    ones."""
    import random

    random.seed(100 + rank)
    torch.manual_seed(100 + rank)
    w = {"w": torch.full((4, 2), float(rank))}

    def state() -> dict:
        return {"w": w["w"].clone(), "rng": ckpt.RNGState()}

    mgr = manager(root, shm, job, nodes[rank], persist_every=1_000_000)
    mgr.save(1, state(), force=True)
    assert mgr.wait_replicated(60)
    expected = (torch.rand(4).tolist(), random.random())
    key = mgr._publisher.tier.key  # the job's: the rewritten documents are signed again
    dist.barrier()
    mgr.close()
    if rank == 0:  # every rank step (and replica) carries only its own rank's RNG values
        from ckpt._memory.auth import sign_doc
        for doc_path in glob.glob(os.path.join(private_path(shm), "*", "step-*", "rank.json")):
            with open(doc_path) as f:
                doc = json.load(f)
            doc["items"]["rng"]["per_rank"] = {str(doc["rank"]):
                                               doc["items"]["rng"]["per_rank"][str(doc["rank"])]}
            with open(doc_path, "w") as f:
                json.dump(sign_doc(key, doc), f)
    dist.barrier()
    out = {}
    for case in ("own", "peer"):
        if case == "peer" and rank == 0:  # node 1's own segment is gone (its RAM)
            shutil.rmtree(os.path.join(private_path(shm), f"ckpt-{job}-{nodes[1]}-r1"))
        if case == "peer":  # the RNG tensor (5 KB) crosses in several pieces
            from ckpt._memory import peer_client
            peer_client.PEER_BLOCK = 1024
        dist.barrier()
        torch.manual_seed(7)  # other draws: the restore must put each rank's back
        random.seed(7)
        mgr = manager(root, shm, job, nodes[rank], persist_every=1_000_000)
        # strict: verify, then apply (two passes over the peer's bytes; else one pass)
        step = mgr.restore(state(), strict=case == "peer")
        got = (torch.rand(4).tolist(), random.random())
        out[case] = {"step": step, "tier": mgr.last_restore.tier if mgr.last_restore else None,
                     "same": got == expected}
        mgr.close()
        dist.barrier()
    out["differs_from_rank0"] = expected
    return out


def serve_a_stuck_peer(rank: int, world: int, root: str, shm: str, job: str,
                       nodes: list[str], flag: str) -> dict:
    """Step 1 in memory only, with replicas; node 1's own segment is lost, so rank 1 must
    read its shard from its replica on node 0, served by rank 0. Both open the save; then
    rank 1 is stuck (alive, reading nothing, never done) until rank 0's ``close`` has
    returned, which it must do once its peer made no progress for ``STALL_S`` (short here),
    with a warning. Rank 1 then recovers and closes, which ends rank 0's serving thread."""
    import logging

    from ckpt._memory import candidates, local_holdings, open_candidate, peer_server

    mgr = manager(root, shm, job, nodes[rank], persist_every=1_000_000)
    mgr.save(1, build(world, 1), force=True)
    assert mgr.wait_replicated(60)
    key = mgr._publisher.tier.key
    dist.barrier()
    mgr.close()
    dist.barrier()  # rank 1's close is done with its segment before it is lost
    if rank == 0:
        shutil.rmtree(os.path.join(private_path(shm), f"ckpt-{job}-{nodes[1]}-r1"))
    dist.barrier()
    docs: dict = {}
    found = candidates(local_holdings(private_path(shm), job, nodes[rank], docs, key=key),
                       dist.group.WORLD, docs)
    source = open_candidate(found[0], build(world, None), shm_dir=private_path(shm), job=job,
                            node=nodes[rank], rank=rank, pg=dist.group.WORLD)
    out = {"tier": source.tier}
    pause = threading.Event()
    if rank == 1:
        while not os.path.exists(flag):  # stuck: no read, no "done"
            pause.wait(0.01)
        source.close()  # recovered: tells its holder it is done
        return out
    peer_server.STALL_S = 0.5
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("ckpt").addHandler(handler)
    server = source.server
    try:
        source.close()  # returns although rank 1 never said it was done
    finally:
        logging.getLogger("ckpt").removeHandler(handler)
    out.update(warnings=seen, serving_after_close=server.is_alive())
    open(flag, "w").close()
    server.join(60)  # rank 1's "done" ends it
    out["serving_at_end"] = server.is_alive()
    return out


def sharded_rows(world: int, seed: int) -> dict:
    """A row-sharded DTensor whose every shard spans several 4 KiB chunks."""
    full = torch.randn(3 * 512, 8, generator=torch.Generator().manual_seed(seed))
    return {"w": distribute_tensor(full, init_device_mesh("cpu", (world,)), [Shard(0)])}


def save_small_chunks_in_memory(rank: int, world: int, root: str, shm: str,
                                nodes: list[str]) -> bool:
    """Save step 1 to memory only in 4 KiB chunks (each rank's 16 KiB shard is four: a peer
    serving a lost rank sends several byte ranges) and wait for the replicas."""
    mgr = manager(root, shm, "chunks", nodes[rank],
                  options=ckpt.SaveOptions(chunk_bytes=4096),
                  persist_every=2)  # step 1 stays in memory only
    mgr.save(1, sharded_rows(world, 1), force=True)
    replicated = mgr.wait_replicated(60)
    dist.barrier()
    mgr.close()
    return replicated


def restore_from_peers(rank: int, world: int, root: str, shm: str, nodes: list[str]) -> dict:
    """Restore into a fresh state: the step, the tier it came from and whether it is exact."""
    state = sharded_rows(world, 2)
    with manager(root, shm, "chunks", nodes[rank]) as mgr:
        step = mgr.restore(state)
        tier = mgr.last_restore.tier if mgr.last_restore else None
    same = torch.equal(state["w"].full_tensor(), sharded_rows(world, 1)["w"].full_tensor())
    return {"step": step, "tier": tier, "same": same}
