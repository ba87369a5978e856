"""The blocking half of a save: take the state apart, agree with the other ranks on who
writes what, and copy this rank's share to host memory. Everything else is the writer's.
"""

from __future__ import annotations

import json
import math
import uuid
from typing import Any, Callable, Mapping

from ckpt._format.digest import digest
from ckpt._format.layout import BoxLayout, Layout, written_by
from ckpt._format.manifest import Manifest
from ckpt._format.names import DTYPE_NAMES, dtype_name
from ckpt._save.payload import StepPayload
from ckpt._save.staging import Stager
from ckpt._shared.distributed import Group
from ckpt._shared.sharding import (PieceSpec, assign_writers, balance_plain, boxes_layouts,
                                   dtensor_type, local_piece, mesh_layout)
from ckpt._shared.state import FlatState, flatten, tensor_keys
from ckpt.errors import CheckpointError
from ckpt.options import SaveOptions

# The memory tier's staging destinations (see :func:`snapshot`).
Destinations = Callable[[list[tuple[str, tuple[int, ...], Any]]], Any]


def snapshot(state: Mapping[str, Any], *, step: int, name: str, group: Group, stager: Stager,
             options: SaveOptions, copy: bool, metadata: dict | None = None,
             previous: Manifest | None = None, hold_all: bool = False,
             destinations: Destinations | None = None) -> StepPayload:
    """Prepare ``state`` for the background writer (collectives run here, never later).

    ``hold_all``: also stage the boxes other ranks write (``payload.held``), for the memory
    tier. ``destinations``: called with the boxes to stage, (key, global offsets, local
    tensor), returns where to copy some of them (the memory tier's shared pages, a
    ``staging.Destination``) or None; the chunk digests it takes while copying go into
    ``payload.digests``, for the root's writer."""
    flat = flatten(state, allow_pickle=options.allow_pickle, rank=group.rank)
    token = uuid.uuid4().hex[:12]
    tables = options.rank_tables if options.rank_tables is not None else group.enabled
    if not tables and not group.enabled:
        return _snapshot_alone(state, flat, token, step=step, name=name, group=group,
                               stager=stager, options=options, copy=copy, metadata=metadata,
                               previous=previous, hold_all=hold_all,
                               destinations=destinations)
    locals_: dict[str, tuple[tuple[int, ...], Any]] = {}
    specs = []
    for key, t in flat.tensors.items():
        global_shape, offsets, local = local_piece(t)
        locals_[key] = (offsets, local)
        specs.append(PieceSpec(key, dtype_name(t.dtype), global_shape, offsets,
                               tuple(local.shape), math.prod(local.shape) * t.element_size()))
    if tables:
        return _snapshot_tables(state, flat, specs, locals_, token, step=step, name=name,
                                group=group, stager=stager, options=options, copy=copy,
                                metadata=metadata, previous=previous, hold_all=hold_all,
                                destinations=destinations)
    gathered = group.all_gather({"specs": specs, "items": flat.items, "aliases": flat.aliases,
                                 "token": token})
    _check_same_items([_item_names(g["items"]) for g in gathered])
    writers = assign_writers([g["specs"] for g in gathered])
    mine = [s.key for s in specs if writers[(s.key, s.offsets)] == group.rank]
    pieces, held, ready, digests = _stage(state, [s.key for s in specs], locals_, mine,
                                          stager=stager, options=options, copy=copy,
                                          hold_all=hold_all, destinations=destinations)
    tensors = {s.key: (s.dtype, s.global_shape) for g in gathered for s in g["specs"]}
    return StepPayload(
        step=step, name=name, pieces=pieces, held=held, tensors=tensors,
        items=_merge_items([g["items"] for g in gathered]), aliases=gathered[0]["aliases"],
        ready=ready, metadata=metadata, previous=previous, rank=group.rank,
        world_size=group.world_size, token=gathered[0]["token"], digests=digests)


def _snapshot_alone(state: Mapping[str, Any], flat: FlatState, token: str, *, step: int,
                    name: str, group: Group, stager: Stager, options: SaveOptions, copy: bool,
                    metadata: dict | None, previous: Manifest | None, hold_all: bool,
                    destinations: Destinations | None) -> StepPayload:
    """Format 1 in a single process: it writes every box it holds, nothing to agree on.
    (Most of a small save's time is spent per tensor: this loop does only what it needs.)"""
    locals_: dict[str, tuple[tuple[int, ...], Any]] = {}
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    dtensor, names, origins = dtensor_type(), DTYPE_NAMES, _ORIGINS
    for key, t in flat.tensors.items():
        if dtensor is not None and isinstance(t, dtensor):
            global_shape, offsets, local = local_piece(t)
        else:
            global_shape = tuple(t.shape)
            offsets, local = origins[len(global_shape)], t
        locals_[key] = (offsets, local)
        dtype = t.dtype
        tensors[key] = (names.get(dtype) or dtype_name(dtype), global_shape)
    keys = list(tensors)
    pieces, held, ready, digests = _stage(state, keys, locals_, keys, stager=stager,
                                          options=options, copy=copy, hold_all=hold_all,
                                          destinations=destinations)
    return StepPayload(
        step=step, name=name, pieces=pieces, held=held, tensors=tensors,
        items=dict(flat.items), aliases=flat.aliases, ready=ready, metadata=metadata,
        previous=previous, rank=group.rank, world_size=group.world_size, token=token,
        digests=digests)


# The offsets of a whole tensor, by its number of dimensions (torch allows at most 64).
_ORIGINS = tuple((0,) * n for n in range(65))


def _snapshot_tables(state: Mapping[str, Any], flat: FlatState, specs: list[PieceSpec],
                     locals_: dict, token: str, *, step: int, name: str, group: Group,
                     stager: Stager, options: SaveOptions, copy: bool, metadata: dict | None,
                     previous: Manifest | None, hold_all: bool,
                     destinations: Destinations | None = None) -> StepPayload:
    """Format 2: who writes what follows from each tensor's layout, computed locally.

    Ranks exchange only a digest of their tensors' descriptions (keys, dtypes, shapes,
    layouts), the names of their per-rank items and tensors, and a token: O(1) per rank,
    whatever the size of the per-rank values (each rank's trees go into its own table and
    rank step; nothing reads another rank's). Only when ranks disagree (they hold different
    tensors) or a layout is not one that ``ckpt._format.layout`` describes are every rank's boxes
    gathered, as in format 1.
    """
    group_rank = None
    if group.enabled and group.pg is not None:
        import torch.distributed as dist

        group_rank = {dist.get_global_rank(group.pg, r): r for r in range(group.world_size)}
    meshes: dict = {}
    layouts: dict[str, Layout] = {}
    plain: dict[str, tuple[tuple[int, ...], int]] = {}
    described = True
    # The tensors of per-rank values (an RNGState's generator state) have names of their own
    # on each rank: each rank writes its own, and they stay out of the description that
    # ranks compare (else every save with an RNGState would gather every box).
    own = {k for item in flat.items.values() if "per_rank" in item
           for tree in item["per_rank"].values() for k in tensor_keys(tree)}
    for s in specs:
        if s.key in own:
            continue
        t = flat.tensors[s.key]
        layout = mesh_layout(t, s.global_shape, (s.offsets, s.shape), group_rank, group.rank,
                             meshes)
        if layout is not None:
            layouts[s.key] = layout
        elif s.shape == s.global_shape:
            plain[s.key] = (s.global_shape, s.nbytes)
        else:
            described = False  # a shard the mesh rule does not describe
    mesh_ids = {m: i for i, m in enumerate(dict.fromkeys(meshes.values()))}
    description = json.dumps([[m.shape, m.ranks] for m in mesh_ids] + [
        [s.key, s.dtype, s.global_shape,
         [mesh_ids[layouts[s.key].mesh], layouts[s.key].placements] if s.key in layouts
         else None] for s in specs if s.key not in own])
    mine = {"sig": digest(description.encode()), "described": described, "token": token,
            "names": _item_names(flat.items),
            "own": [[s.key, s.dtype, list(s.global_shape)] for s in specs if s.key in own]}
    gathered = group.all_gather(mine)
    _check_same_items([g["names"] for g in gathered])
    world = group.world_size
    if all(g["described"] and g["sig"] == mine["sig"] for g in gathered):
        layouts.update(balance_plain(plain, world))
        tensors = {s.key: (s.dtype, s.global_shape) for s in specs if s.key not in own}
        for rank, g in enumerate(gathered):
            for key, dtype, shape in g["own"]:
                tensors[key] = (dtype, tuple(shape))
                layouts[key] = BoxLayout((((0,) * len(shape), tuple(shape), rank),))
    else:  # ranks hold different tensors: gather every box (format 1's exchange)
        all_specs = group.all_gather(specs)
        layouts = boxes_layouts(all_specs)
        tensors = {s.key: (s.dtype, s.global_shape) for r in all_specs for s in r}
    pieces, held, ready, digests = _stage(
        state, [s.key for s in specs], locals_, written_here(specs, layouts, group.rank),
        stager=stager, options=options, copy=copy, hold_all=hold_all,
        destinations=destinations)
    # Per-rank items carry this rank's tree only: it goes into this rank's table (and rank
    # step); the manifest marks them "in the tables".
    return StepPayload(
        step=step, name=name, pieces=pieces, held=held, tensors=tensors, items=dict(flat.items),
        aliases=flat.aliases, ready=ready, metadata=metadata, previous=previous, rank=group.rank,
        world_size=world, token=gathered[0]["token"], layouts=layouts, digests=digests)


def _item_names(items: dict[str, dict]) -> dict[str, list[str]]:
    """The names of the state's items and of its per-rank items, sorted (ranks may list the
    state's keys in any order)."""
    return {"items": sorted(items),
            "per_rank": sorted(name for name, item in items.items() if "per_rank" in item)}


def _check_same_items(by_rank: list[dict[str, list[str]]]) -> None:
    """Every rank must save the same items: the manifest holds rank 0's items (and each rank's
    tree of a per-rank item), so an item only another rank holds would be lost without a
    word (a save committed, a restore missing it). Every rank sees the same lists, so all
    raise, before anything is written."""
    for what, label in (("per_rank", "per-rank items"), ("items", "items")):
        lists = [names[what] for names in by_rank]
        differ = [r for r, names in enumerate(lists) if names != lists[0]]
        if differ:
            raise CheckpointError(
                f"ranks save different {label} (rank 0: {lists[0]}, rank {differ[0]}: "
                f"{lists[differ[0]]}); nothing was saved: pass the same state keys on every "
                "rank (a value only some ranks have: wrap it in ckpt.PerRank on every rank)")


def _stage(state: Mapping[str, Any], order: list[str], locals_: dict,
           mine: list[str], *, stager: Stager, options: SaveOptions, copy: bool,
           hold_all: bool, destinations: Destinations | None = None
           ) -> tuple[dict, dict, Any, Any]:
    """Copy to host the boxes this rank writes (``mine``, in the order of the keys of its
    boxes, ``order``) and, with ``hold_all``, the others it holds (for the memory tier):
    (pieces, held, ready, the chunk digests taken while copying, or {})."""
    writes = set(mine)
    held = [key for key in order if key not in writes] if hold_all else []
    keys = [*mine, *held]
    # The optimizers only order device-to-host copies: looked for only when there are some.
    guards = optimizers_in(state) if options.overlap_device_copy and any(
        locals_[k][1].is_cuda for k in keys) else []
    into = destinations([(k, *locals_[k]) for k in keys]) if destinations else None
    staged, ready = stager.stage({k: locals_[k][1] for k in keys}, copy=copy, guards=guards,
                                 into=into)
    return ({k: (locals_[k][0], staged[k]) for k in mine},
            {k: (locals_[k][0], staged[k]) for k in held}, ready,
            into.known_digests() if into is not None else {})


def written_here(specs: list[PieceSpec], layouts: dict[str, Layout], rank: int) -> list[str]:
    """The keys whose box this rank holds and writes (its layout names it the writer), in
    the order of ``specs`` (which fixes the layout of its data files)."""
    return [s.key for s in specs if math.prod(s.shape) and (s.offsets, s.shape) in
            written_by(s.key, s.global_shape, layouts[s.key], rank)]


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
