"""Rank bodies for test_sharded.py (top-level functions: spawn imports them by name)."""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ckpt
from tests.support.scale_workers import Blob
from ckpt._save.staging import Stager
from storage_backends import PosixStorage


def global_tensors() -> dict[str, torch.Tensor]:
    """The same global values on every rank and world size."""
    g = torch.Generator().manual_seed(1234)
    return {
        "row": torch.randn(7, 5, generator=g),                      # Shard(0), uneven
        "col": torch.randn(6, 9, generator=g).to(torch.bfloat16),    # Shard(1), uneven
        "rep": torch.randint(-10**12, 10**12, (4,), generator=g),     # Replicate, int64
        "sparse_rows": torch.randn(3, 10, generator=g),              # Shard(0): empty shards at world 4
        "grid": torch.randn(8, 6, generator=g),                      # 2-D mesh when world is 4
    }


def placements(world: int) -> dict[str, tuple]:
    return {"row": (Shard(0),), "col": (Shard(1),), "rep": (Replicate(),),
            "sparse_rows": (Shard(0),)}


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def build_state(world: int, *, zeros: bool, seed: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    g = global_tensors()
    state = {}
    for name, place in placements(world).items():
        src = torch.zeros_like(g[name]) if zeros else g[name]
        state[name] = distribute_tensor(src, mesh, list(place))
    if world == 4:
        mesh2 = init_device_mesh("cpu", (2, 2))
        src = torch.zeros_like(g["grid"]) if zeros else g["grid"]
        state["grid"] = distribute_tensor(src, mesh2, [Shard(0), Shard(1)])
    else:
        src = torch.zeros_like(g["grid"]) if zeros else g["grid"]
        state["grid"] = distribute_tensor(src, mesh, [Shard(1)])
    state["scalar"] = torch.tensor(0.0 if zeros else 2.5)
    state["model"] = make_model(seed)
    state["rng"] = ckpt.RNGState()
    state["epoch"] = 0 if zeros else 5
    return state


def save_world(rank: int, world: int, root: str, step: int, options: dict | None = None) -> dict:
    torch.manual_seed(100 + rank)  # per-rank RNG differs
    state = build_state(world, zeros=False, seed=0)
    with ckpt.CheckpointManager(root, async_save=True,
                                options=ckpt.SaveOptions(**(options or {}))) as mgr:
        result = mgr.save(step, state, force=True).wait()
    return {"rng_next": torch.rand(3).tolist(), "bytes": result.bytes_written}


def load_world(rank: int, world: int, root: str) -> dict:
    torch.manual_seed(999)
    state = build_state(world, zeros=True, seed=7)
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        step = mgr.restore(state)
    g = global_tensors()
    mismatches = [k for k in g if not torch.equal(state[k].full_tensor(), g[k])]
    ref = make_model(0)
    mismatches += [f"model.{k}" for k, v in ref.state_dict().items()
                   if not torch.equal(state["model"].state_dict()[k], v)]
    if state["scalar"].item() != 2.5 or state["epoch"] != 5:
        mismatches.append("scalar/epoch")
    return {"step": step, "mismatches": mismatches, "rng_next": torch.rand(3).tolist()}


def save_replicated(rank: int, world: int, root: str) -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    with ckpt.CheckpointManager(root, async_save=False, options=ckpt.SaveOptions(
            chunk_bytes=1 << 16)) as mgr:
        mgr.save(1, {"model": model}, force=True)
    return sum(p.numel() * p.element_size() for p in model.parameters())


class _KillOnWrite(PosixStorage):
    """A rank that dies (SIGKILL) in the middle of writing its first data file."""

    def write(self, path, buffers):
        if "/data-" in path and "step-00000002" in path:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().write(path, buffers)


def save_then_lose_a_rank(rank: int, world: int, root: str, victim: int) -> str:
    model = make_model(0)
    storage = _KillOnWrite(root) if rank == victim else PosixStorage(root)
    mgr = ckpt.CheckpointManager(storage, async_save=True,
                                 options=ckpt.SaveOptions(commit_timeout=5.0))
    mgr.save(1, {"model": model}, force=True).wait()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    dist.barrier()
    handle = mgr.save(2, {"model": model}, force=True)  # the victim dies in here
    try:
        handle.wait()
    except ckpt.CheckpointError as e:
        return f"raised: {e}"
    finally:
        try:
            mgr.close()
        except ckpt.CheckpointError:
            pass
    return "committed"


def fsdp_save_load(rank: int, world: int, root: str, mode: str) -> dict:
    """FSDP2 model + optimizer through get_state_dict/set_state_dict wrappers."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Linear(12, 5))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if mode == "save":
        for _ in range(3):
            torch.manual_seed(5)
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    state = {"train": ckpt.ModelOptimizer(model, opt)}
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        if mode == "save":
            mgr.save(3, state, force=True)
        else:
            mgr.restore(state)
    torch.manual_seed(5)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {k: v.tolist() for k, v in full.items()}


def restore_outcome(rank: int, world: int, root: str) -> dict:
    """Restore the newest step into a zeroed state: the step, or the error and what it
    says was changed."""
    state = build_state(world, zeros=True, seed=7)
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        try:
            step = mgr.restore(state)
        except ckpt.CheckpointError as e:
            return {"error": type(e).__name__, "message": str(e),
                    "changed": sorted(getattr(e, "changed", ()))}
    g = global_tensors()
    mismatches = [k for k in g if not torch.equal(state[k].full_tensor(), g[k])]
    return {"step": step, "mismatches": mismatches}


def save_keys_in_rank_order_recording_staged(rank: int, world: int, root: str) -> dict:
    """A format-1 save whose ranks disagree on their per-rank items is tried first. Then
    save a replicated tensor and two per-rank items, rank 1 listing the state's keys in
    the opposite order, recording the tensors each rank stages to host; then restore."""
    torch.manual_seed(100 + rank)
    blob = Blob(rank, 16)
    saved = blob.value
    items = [("w", torch.arange(4096.0)), ("rng", ckpt.RNGState()),
             ("blob", ckpt.PerRank(blob))]
    state = dict(items if rank == 0 else reversed(items))
    staged: list[str] = []
    original = Stager.stage

    def recording(self, tensors, *args, **kwargs):
        staged.extend(tensors)
        return original(self, tensors, *args, **kwargs)

    mismatch = None
    with ckpt.CheckpointManager(root, async_save=False,
                                options=ckpt.SaveOptions(rank_tables=False)) as mgr:
        try:  # format 1, rank 1 without its per-rank Blob: refused on every rank, by name
            mgr.save(5, state if rank == 0 else {k: state[k] for k in ("w", "rng")},
                     force=True)
        except ckpt.CheckpointError as e:
            mismatch = str(e)
    Stager.stage = recording
    try:
        with ckpt.CheckpointManager(root, async_save=False) as mgr:
            mgr.save(1, state, force=True)
    finally:
        Stager.stage = original
    want = torch.rand(3)
    torch.manual_seed(999)
    blob.value = ""
    state["w"] = torch.zeros(4096)
    with ckpt.CheckpointManager(root) as mgr:
        step = mgr.restore(state)
    return {"mismatch": mismatch, "step": step, "staged": sorted(staged),
            "rng_exact": bool(torch.rand(3).equal(want)), "blob_exact": blob.value == saved,
            "w_exact": bool(state["w"].equal(torch.arange(4096.0)))}


def load_where_one_rank_refuses_pickle(rank: int, world: int, root: str) -> str:
    """Save one step holding a pickled value; rank 1 then loads without ``allow_pickle``
    (its own refusal is fatal), rank 0 with it. What each rank's ``load()`` raised."""
    with ckpt.CheckpointManager(root, async_save=False,
                                options=ckpt.SaveOptions(allow_pickle=True)) as mgr:
        mgr.save(1, {"w": torch.arange(8.0), "odd": {1, 2}}, force=True)
    with ckpt.CheckpointManager(root, read_only=True,
                                options=ckpt.SaveOptions(allow_pickle=rank == 0)) as mgr:
        try:
            mgr.load()
        except ckpt.CheckpointError as e:
            return f"{type(e).__name__}: {e}"
    return "loaded"


def save_an_item_only_rank_1_holds(rank: int, world: int, root: str) -> dict:
    """Rank 1 saves an item (a plain value and a tensor) rank 0 does not have: refused on
    every rank, by name, in both formats, nothing committed; the same keys everywhere save."""
    state = {"w": torch.ones(8)}
    if rank == 1:
        state.update(extra={"lr": 0.5}, t1=torch.arange(3.0))
    refused = []
    for tables in (False, True):
        with ckpt.CheckpointManager(root, async_save=False,
                                    options=ckpt.SaveOptions(rank_tables=tables)) as mgr:
            try:
                mgr.save(1, state, force=True)
                refused.append(None)
            except ckpt.CheckpointError as e:
                refused.append(str(e))
            steps = mgr.steps()
    return {"refused": refused, "steps": steps}
