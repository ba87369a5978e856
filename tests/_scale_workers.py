"""Rank body for test_scale.py: a real sharded save of the tensors the simulator describes."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

import ckpt


def save_specs(rank: int, world: int, root: str, specs: list, options: dict) -> None:
    meshes = {}
    state = {}
    for spec in specs:
        mesh_shape = spec.mesh or (world,)
        if mesh_shape not in meshes:
            meshes[mesh_shape] = init_device_mesh("cpu", mesh_shape)
        dtype = getattr(torch, spec.dtype)
        full = torch.arange(torch.Size(spec.shape).numel(), dtype=torch.float32)
        full = full.reshape(spec.shape).to(dtype)
        state[spec.key] = distribute_tensor(full, meshes[mesh_shape], list(spec.placements))
    with ckpt.CheckpointManager(root, async_save=False,
                                options=ckpt.SaveOptions(**options)) as mgr:
        mgr.save(1, state, force=True)
