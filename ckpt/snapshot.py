"""The blocking half of a save: take the state apart, agree with the other ranks on who
writes what, and copy this rank's share to host memory. Everything else is the writer's.
"""

from __future__ import annotations

import math
import uuid
from typing import Any, Mapping

from .distributed import Group
from .engine import Stager, StepPayload
from .format import Manifest, dtype_name
from .options import SaveOptions
from .sharding import PieceSpec, assign_writers, local_piece
from .state import flatten


def snapshot(state: Mapping[str, Any], *, step: int, name: str, group: Group, stager: Stager,
             options: SaveOptions, copy: bool, metadata: dict | None = None,
             previous: Manifest | None = None, hold_all: bool = False) -> StepPayload:
    """Prepare ``state`` for the background writer (collectives run here, never later).

    ``hold_all``: also stage the boxes other ranks write (``payload.held``), for the memory
    tier."""
    flat = flatten(state, allow_pickle=options.allow_pickle, rank=group.rank)
    locals_: dict[str, tuple[tuple[int, ...], Any]] = {}
    specs = []
    for key, t in flat.tensors.items():
        global_shape, offsets, local = local_piece(t)
        locals_[key] = (offsets, local)
        specs.append(PieceSpec(key, dtype_name(t.dtype), global_shape, offsets,
                               tuple(local.shape), math.prod(local.shape) * t.element_size()))
    token = uuid.uuid4().hex[:12]
    if group.enabled:
        gathered = group.all_gather({"specs": specs, "items": flat.items,
                                     "aliases": flat.aliases, "token": token})
    else:
        gathered = [{"specs": specs, "items": flat.items, "aliases": flat.aliases,
                     "token": token}]
    writers = assign_writers([g["specs"] for g in gathered])
    mine = {s.key: locals_[s.key] for s in specs if writers[(s.key, s.offsets)] == group.rank}
    guards = optimizers_in(state) if options.overlap_device_copy else []
    held = {s.key: locals_[s.key] for s in specs if hold_all and s.key not in mine}
    staged, ready = stager.stage({k: t for k, (_, t) in {**mine, **held}.items()}, copy=copy,
                                 guards=guards)
    tensors = {s.key: (s.dtype, s.global_shape) for g in gathered for s in g["specs"]}
    return StepPayload(
        step=step, name=name,
        pieces={k: (offsets, staged[k]) for k, (offsets, _) in mine.items()},
        held={k: (offsets, staged[k]) for k, (offsets, _) in held.items()},
        tensors=tensors, items=_merge_items([g["items"] for g in gathered]),
        aliases=gathered[0]["aliases"], ready=ready, metadata=metadata, previous=previous,
        rank=group.rank, world_size=group.world_size, token=gathered[0]["token"])


def optimizers_in(state: Mapping[str, Any]) -> list:
    """The optimizers among the state's values (also inside a ModelOptimizer)."""
    import torch

    found = []
    for value in state.values():
        if isinstance(value, torch.optim.Optimizer):
            found.append(value)
        found.extend(o for o in getattr(value, "optimizers", ())
                     if isinstance(o, torch.optim.Optimizer))
    return found


def _merge_items(items_by_rank: list[dict[str, dict]]) -> dict[str, dict]:
    """Rank 0's items, with every rank's tree for per-rank items."""
    merged = {}
    for name, item in items_by_rank[0].items():
        if "per_rank" in item:
            trees = {}
            for items in items_by_rank:
                trees.update(items[name]["per_rank"])
            merged[name] = {"kind": item["kind"], "per_rank": trees}
        else:
            merged[name] = item
    return merged
