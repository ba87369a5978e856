"""Rank bodies for tests/load/test_forward_gate.py's multi-rank test (spawned by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import ckpt
from ckpt._format.names import step_dir


class Noise(torch.nn.Module):
    """A per-rank item (saved once per rank): a rank-1-only chunk to corrupt."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.register_buffer("values", torch.full((64,), float(rank)))


def restore_past_bad_steps(rank: int, world: int, root: str) -> tuple[int, list[int], bool]:
    """Steps 1-3 of a replicated model with a probe; step 2's weights are NaN, step 3's
    rank-1 item is corrupt on disk. Every rank restores step 1 with verify="forward"."""
    torch.manual_seed(0)  # the same replicated model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    state = {"model": model, "noise": ckpt.PerRank(Noise(rank))}
    probe = ckpt.Probe(inputs=torch.randn(4, 8, generator=torch.Generator().manual_seed(1)))
    with ckpt.CheckpointManager(root, async_save=False,
                                options=ckpt.SaveOptions(probe=probe)) as mgr:
        mgr.save(1, state)
        step1 = [p.clone() for p in model.parameters()]
        with torch.no_grad():
            model[0].weight[0, 0] = float("nan")
        mgr.save(2, state)
        with torch.no_grad():
            model[0].weight.copy_(step1[0] + 1.0)
        mgr.save(3, state)
        if rank == 0:  # flip a byte of rank 1's own chunk in step 3: only rank 1 reads it
            manifest = mgr.manifest(3)
            key = next(k for k in manifest.tensors if k.startswith("noise@1"))
            chunk = manifest.tensors[key].chunks[0]
            path = f"{root}/{step_dir(3)}/{chunk.file}"
            with open(path, "r+b") as f:
                f.seek(chunk.start + 5)
                byte = f.read(1)
                f.seek(chunk.start + 5)
                f.write(bytes([byte[0] ^ 0xFF]))
        dist.barrier()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        restored = mgr.restore(state, verify="forward")
        same = all(torch.equal(p, q) for p, q in zip(model.parameters(), step1))
        return restored, [s for s, _ in mgr.skipped], same


class Tanh(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)


class Sigmoid(torch.nn.Module):
    """Another activation: the same parameters compute something else."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)


def fsdp_model(act: type, seed: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), act(), torch.nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def local_shards(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.to_local().clone() for p in model.parameters()]


def fsdp_forward_gate(rank: int, world: int, root: str) -> tuple[int, bool, str, bool]:
    """An FSDP2 model (its forward all-gathers) in a ckpt.ModelOptimizer, saved with a probe
    at steps 1 and 2 (NaN weights before 2): restore(verify="forward") gives step 1 on every
    rank; the model rebuilt with another activation fails every step (step 2 still on its NaN
    weights) and keeps its shards."""
    model = fsdp_model(Tanh, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"train": ckpt.ModelOptimizer(model, opt)}
    probe = ckpt.Probe(model_key="train",
                       inputs=torch.randn(4, 8, generator=torch.Generator().manual_seed(1)))
    with ckpt.CheckpointManager(root, async_save=False,
                                options=ckpt.SaveOptions(probe=probe)) as mgr:
        mgr.save(1, state)
        step1 = local_shards(model)
        with torch.no_grad():
            model[0].weight.to_local().fill_(float("nan"))  # every rank's shard diverged
        mgr.save(2, state)
        restored = mgr.restore(state, verify="forward")
        same = all(torch.equal(a, b) for a, b in zip(local_shards(model), step1))
    changed = fsdp_model(Sigmoid, seed=1)  # other weights than any step's
    before = local_shards(changed)
    state = {"train": ckpt.ModelOptimizer(changed, torch.optim.SGD(changed.parameters(), lr=0.1))}
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        try:
            mgr.restore(state, verify="forward")
            message = "restored"
        except ckpt.ForwardCheckError as e:
            message = str(e)
    kept = all(torch.equal(a, b) for a, b in zip(local_shards(changed), before))
    return restored, same, message, kept
