"""Rank body for test_scale.py: a real sharded save of the tensors the simulator describes."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

import ckpt


def mesh_of(spec, world: int, meshes: dict):
    """The CPU device mesh ``spec`` is placed on (one per mesh shape, made once)."""
    shape = spec.mesh or (world,)
    if shape not in meshes:
        meshes[shape] = init_device_mesh("cpu", shape)
    return meshes[shape]


def save_specs(rank: int, world: int, root: str, specs: list, options: dict,
               rng: bool = False) -> None:
    meshes = {}
    state = {"rng": ckpt.RNGState()} if rng else {}
    for spec in specs:
        mesh = mesh_of(spec, world, meshes)
        dtype = getattr(torch, spec.dtype)
        full = torch.arange(torch.Size(spec.shape).numel(), dtype=torch.float32)
        full = full.reshape(spec.shape).to(dtype)
        state[spec.key] = distribute_tensor(full, mesh, list(spec.placements))
    with ckpt.CheckpointManager(root, async_save=False,
                                options=ckpt.SaveOptions(**options)) as mgr:
        mgr.save(1, state, force=True)


def save_then_restore_counting(rank: int, world: int, root: str, specs: list,
                               options: dict) -> list[str]:
    """Save ``specs`` and an RNGState (seeded per rank), then restore them into zeroed
    DTensors of the same layout and a fresh RNGState, recording every file of the step
    this rank's restore sized or read (PosixStorage's calls)."""
    from storage_backends.posix import PosixStorage

    torch.manual_seed(100 + rank)
    save_specs(rank, world, root, specs, options, rng=True)
    want_draw = torch.rand(3)
    touched: list[str] = []
    for method in ("size", "read", "read_into", "read_blocks", "open_reader", "exists"):
        original = getattr(PosixStorage, method)

        def counting(self, path, *args, _original=original, **kwargs):
            touched.append(path)
            return _original(self, path, *args, **kwargs)
        setattr(PosixStorage, method, counting)
    meshes, want = {}, {}
    state: dict = {"rng": ckpt.RNGState()}
    for spec in specs:
        mesh = mesh_of(spec, world, meshes)
        dtype = getattr(torch, spec.dtype)
        full = torch.arange(torch.Size(spec.shape).numel(), dtype=torch.float32)
        want[spec.key] = full.reshape(spec.shape).to(dtype)
        state[spec.key] = distribute_tensor(torch.zeros(spec.shape, dtype=dtype),
                                            mesh, list(spec.placements))
    torch.manual_seed(999)
    with ckpt.CheckpointManager(root) as mgr:
        assert mgr.restore(state) == 1
    assert torch.rand(3).equal(want_draw), "this rank's own RNG state was not restored"
    for key in want:
        assert state[key].full_tensor().equal(want[key]), key
    return sorted({p.rsplit("/", 1)[-1] for p in touched if p.startswith("step-")})


class Blob:
    """A per-rank value of about ``size`` bytes of JSON, marked with its rank."""

    def __init__(self, rank: int, size: int) -> None:
        self.value = f"<blob of rank {rank}>" + "x" * size

    def state_dict(self) -> dict:
        return {"blob": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["blob"]


def save_recording_the_exchange(rank: int, world: int, root: str, blob_bytes: int) -> dict:
    """Save a tensor, an RNGState (seeded per rank) and a per-rank Blob, recording what every
    ``all_gather_object``/``broadcast_object_list`` of the save delivers to this rank
    (pickled); a save whose ranks disagree on their per-rank items is tried first. Then
    restore a fresh RNGState and Blob from the root. Returns what it saw."""
    import pickle
    import random

    import torch.distributed as dist

    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    blob = Blob(rank, blob_bytes)
    saved_blob = blob.value
    state = {"w": torch.arange(64.0), "rng": ckpt.RNGState(), "blob": ckpt.PerRank(blob)}
    received: list[bytes] = []
    originals = {n: getattr(dist, n) for n in ("all_gather_object", "broadcast_object_list")}

    def recording(name):
        def call(object_list, *args, **kwargs):
            out = originals[name](object_list, *args, **kwargs)
            received.append(pickle.dumps(object_list))
            return out
        return call
    mismatch = None
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        try:  # rank 1 without its per-rank Blob: refused on every rank
            mgr.save(1, state if rank == 0 else {k: state[k] for k in ("w", "rng")},
                     force=True)
        except ckpt.CheckpointError as e:
            mismatch = str(e)
        for n in originals:
            setattr(dist, n, recording(n))
        try:
            mgr.save(2, state, force=True)
        finally:
            for n, f in originals.items():
                setattr(dist, n, f)
    want = (torch.rand(3), random.random())
    torch.manual_seed(999)
    random.seed(999)
    blob.value = ""
    with ckpt.CheckpointManager(root) as mgr:
        step = mgr.restore(state)
    got = (torch.rand(3), random.random())
    return {"mismatch": mismatch, "step": step, "received": [len(r) for r in received],
            "blobs_seen": [r for r in range(world)
                           if any(f"<blob of rank {r}>".encode() in b for b in received)],
            "rng_exact": bool(got[0].equal(want[0])) and got[1] == want[1],
            "blob_exact": blob.value == saved_blob}
