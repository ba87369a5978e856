"""Where each piece of a tensor lives across ranks, and who writes it.

A tensor is described globally (shape, dtype) and each rank holds a box of it: the whole
tensor for a plain (replicated) tensor, its local shard for a DTensor. Identical boxes held
by several ranks are written once, by the holder with the fewest bytes assigned so far, so a
DDP model's parameters are spread over all ranks instead of all landing on rank 0.
"""

from __future__ import annotations

import bisect
import heapq
import math
import sys
from typing import NamedTuple

import torch

from ckpt._format.layout import BoxLayout, Mesh, MeshLayout, mesh_box

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape) in the global tensor


def dtensor_type():
    """The DTensor class, or None when no DTensor can exist in this process.

    Importing torch.distributed.tensor takes about a second; a process that never imported
    it has no DTensors, so the first save of a plain model does not pay for it.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def local_piece(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """(global shape, global offsets of the local box, local tensor) of a tensor or DTensor."""
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = t.to_local()
        shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if tuple(shape) != tuple(local.shape):
            raise ValueError(f"DTensor local shape {tuple(local.shape)} != computed {tuple(shape)}")
        return tuple(t.shape), tuple(int(o) for o in offsets), local
    shape = tuple(t.shape)
    return shape, (0,) * len(shape), t


def read_box(entry, target: torch.Tensor | None) -> Box:
    """The box of a stored tensor (manifest ``entry``) that a load reads for its live
    ``target``: the target's local piece (its shard of a DTensor), or the whole tensor when
    the rank holds no live tensor for it (None). The one rule of every load's read plan."""
    if target is None:
        return (0,) * len(entry.shape), tuple(entry.shape)
    _, offsets, local = local_piece(target)
    return offsets, tuple(local.shape)


class PieceSpec(NamedTuple):
    """One rank's box of one tensor: what ranks exchange before a save (a named tuple: made
    for every tensor at every save, in a fraction of a frozen dataclass's time)."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int


def assign_writers(specs_by_rank: list[list[PieceSpec]]) -> dict[tuple[str, tuple[int, ...]], int]:
    """(key, offsets) -> the rank that writes that box; deterministic on every rank."""
    if len(specs_by_rank) == 1:  # a single process writes everything it holds
        return {(s.key, s.offsets): 0 for s in specs_by_rank[0]}
    holders: dict[tuple[str, tuple[int, ...]], tuple[PieceSpec, list[int]]] = {}
    for rank, specs in enumerate(specs_by_rank):
        for s in specs:
            entry = holders.setdefault((s.key, s.offsets), (s, []))
            entry[1].append(rank)
    load = [0] * len(specs_by_rank)
    writers = {}
    # Largest first, each to its least-loaded holder: a greedy balance good to one piece.
    for ident, (spec, ranks) in sorted(holders.items(), key=lambda kv: (-kv[1][0].nbytes, kv[0])):
        rank = min(ranks, key=lambda r: (load[r], r))
        writers[ident] = rank
        load[rank] += spec.nbytes
    return writers


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None when they share no element."""
    offsets, shape = [], []
    for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        offsets.append(lo)
        shape.append(hi - lo)
    return tuple(offsets), tuple(shape)


def sub_slices(outer: Box, inner: Box) -> tuple[slice, ...]:
    """Index of ``inner`` within a tensor that holds exactly ``outer``."""
    return tuple(slice(i - o, i - o + n) for o, i, n in zip(outer[0], inner[0], inner[1]))


def source_rank(rank: int, saved_world: int) -> int:
    """Which saved rank's per-rank values a rank gets: its own when it existed, else
    ``rank % saved_world`` (a documented rule: no rank is left without values)."""
    return rank if rank < saved_world else rank % saved_world


def prefetch(manifest, wanted) -> None:
    """Before a read plan looks up ``wanted`` ((key, box) pairs) one by one: in a format-2
    step, read and validate at once every rank table those boxes need (in parallel, and in
    batches rather than one table at a time). Nothing to do in format 1."""
    tables = manifest.rank_tables
    if tables is not None:
        tables.prefetch([(k, b) for k, b in wanted if manifest.tensors[k].in_tables])


def overlapping(entry, box: Box) -> list[tuple[object, Box]]:
    """The chunks of a manifest ``entry`` (a TensorEntry) that overlap ``box``, each with the
    overlap; empty chunks are skipped. A 0-d tensor's single chunk overlaps its empty box.

    Found by bisection on the chunks' first offsets (chunks tile the tensor, so only those
    starting less than the longest chunk's extent before the box can reach into it): a
    rank's read plan costs O(log chunks) per tensor plus the chunks it reads, not a scan of
    every chunk that every rank of a large job wrote. In a format-2 step the layout says
    which ranks wrote boxes overlapping ``box``, and only their tables are read.
    """
    if entry.in_tables:
        return entry.overlapping(box)
    chunks = entry.chunks
    if not entry.shape:
        return [(c, ((), ())) for c in chunks if c.numel]
    if len(chunks) == 1:  # most tensors: one chunk, the whole tensor; no index to build
        c = chunks[0]
        if not c.numel:
            return []
        whole = (c.offsets, c.shape)
        overlap = whole if whole == box else intersect(whole, box)
        return [] if overlap is None else [(c, overlap)]
    starts, reach, order = _dim0_index(entry)
    lo = bisect.bisect_left(starts, box[0][0] - reach + 1)
    hi = bisect.bisect_left(starts, box[0][0] + box[1][0])
    out = []
    for i in order[lo:hi]:
        c = chunks[i]
        overlap = intersect((c.offsets, c.shape), box) if c.numel else None
        if overlap is not None:
            out.append((c, overlap))
    return out


def _dim0_index(entry) -> tuple[list[int], int, list[int]]:
    """(sorted first offsets, longest first-dim extent, chunk order) of an entry, cached on
    it (manifests are immutable once parsed)."""
    cached = entry._index
    if cached is None:
        order = sorted(range(len(entry.chunks)), key=lambda i: entry.chunks[i].offsets[0])
        starts = [entry.chunks[i].offsets[0] for i in order]
        reach = max((c.shape[0] for c in entry.chunks), default=1)
        cached = (starts, max(1, reach), order)
        entry._index = cached
    return cached


def mesh_layout(t: torch.Tensor, global_shape: tuple[int, ...], box: Box,
                group_rank: dict[int, int] | None, rank: int, meshes: dict) -> MeshLayout | None:
    """The layout of DTensor ``t`` (mesh in group ranks, Shard/Replicate placements), or None
    when it has none that ``ckpt._format.layout`` describes (a plain tensor, Partial or strided
    placements, a mesh outside the group, or a local box that DTensor's rule did not give).

    ``group_rank`` maps global ranks to the saving group's ranks (None: the same);
    ``meshes`` caches one :class:`Mesh` per device mesh, shared by its tensors.
    """
    dtensor = dtensor_type()
    if dtensor is None or not isinstance(t, dtensor):
        return None
    from torch.distributed.tensor.placement_types import Replicate, Shard

    placements: list[int | None] = []
    for p in t.placements:
        if type(p) is Shard:
            placements.append(p.dim % max(1, len(global_shape)))
        elif type(p) is Replicate:
            placements.append(None)
        else:
            return None
    device_mesh = t.device_mesh
    mesh = meshes.get(id(device_mesh))
    if mesh is None:
        ranks = device_mesh.mesh.flatten().tolist()
        if group_rank is not None:
            ranks = [group_rank.get(r, -1) for r in ranks]
        mesh = meshes[id(device_mesh)] = Mesh(tuple(device_mesh.mesh.shape), tuple(ranks))
    if -1 in mesh.ranks:
        return None
    layout = MeshLayout(mesh, tuple(placements))
    coord = mesh.coordinate(rank)
    if coord is None:
        return None
    offsets, shape = mesh_box(global_shape, layout, coord)
    if shape != box[1] or (math.prod(shape) and offsets != box[0]):
        return None
    return layout


def balance_plain(tensors: dict[str, tuple[tuple[int, ...], int]], world: int) -> dict[str, BoxLayout]:
    """Writers of tensors every rank holds whole (key -> (shape, bytes)): largest first, each
    to the least-loaded rank so far; deterministic on every rank, O(tensors log ranks)."""
    heap = [(0, r) for r in range(world)]
    out = {}
    for key, (shape, nbytes) in sorted(tensors.items(), key=lambda kv: (-kv[1][1], kv[0])):
        load, rank = heapq.heappop(heap)
        out[key] = BoxLayout((((0,) * len(shape), shape, rank),))
        heapq.heappush(heap, (load + nbytes, rank))
    return out


def boxes_layouts(specs_by_rank: list[list[PieceSpec]]) -> dict[str, BoxLayout]:
    """Explicit layouts from every rank's boxes (the general case: ranks hold different
    tensors, or layouts the mesh rule does not describe), writers as ``assign_writers``."""
    writers = assign_writers(specs_by_rank)
    boxes: dict[str, dict[tuple[int, ...], tuple]] = {}
    for specs in specs_by_rank:
        for s in specs:
            if math.prod(s.shape):
                boxes.setdefault(s.key, {})[s.offsets] = (s.offsets, s.shape,
                                                         writers[(s.key, s.offsets)])
    keys = {s.key for specs in specs_by_rank for s in specs}
    return {k: BoxLayout(tuple(sorted(boxes.get(k, {}).values()))) for k in sorted(keys)}
