"""Which saved rank holds which box of a tensor, computed from its layout (format version 2).

A DTensor's boxes follow from its device mesh and placements (``Shard(d)`` or ``Replicate``)
by DTensor's own offset rule, so a manifest stores, per tensor, the mesh (once per mesh: its
shape and the ranks in mesh order) and the placements, not one record per rank. Every rank
computes from that, locally and in the same way:

* its own box (``mesh_box``), and whether it is the one that writes it (``writer``: among the
  ranks holding the same box, i.e. differing only along ``Replicate`` mesh dimensions, the
  one numbered ``crc32(key) % replicas`` in row-major order, so a replicated tensor's writes
  spread over its replicas by key);
* the saved boxes ("cells") that overlap a box it wants to read, and who wrote each
  (``cells_overlapping``: a bisection per tensor dimension, not a scan of every rank).

Nothing here imports ``torch.distributed``: a reader needs no process group and no DTensor.
``tests/save/test_scale.py`` checks ``mesh_box`` against DTensor's own function.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import zlib
from dataclasses import dataclass

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class Mesh:
    """A device mesh as a manifest stores it: its shape and the group ranks in mesh order."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    def __hash__(self) -> int:  # cheap: thousands of tensors share one mesh of many ranks
        return hash((self.shape, self.ranks[:8], self.ranks[-8:]))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Mesh):
            return NotImplemented
        return self.shape == other.shape and self.ranks == other.ranks

    def __post_init__(self) -> None:
        # rank -> flat (row-major) index, and the coordinates asked for so far
        object.__setattr__(self, "_position", {r: i for i, r in enumerate(self.ranks)})
        object.__setattr__(self, "_coords", {})

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        """The mesh coordinate of ``rank``, or None when it is not in the mesh."""
        coord = self._coords.get(rank)
        if coord is not None or rank in self._coords:
            return coord
        flat = self._position.get(rank)
        if flat is not None:
            parts = []
            for size in reversed(self.shape):
                parts.append(flat % size)
                flat //= size
            coord = tuple(reversed(parts))
        self._coords[rank] = coord
        return coord

    def rank_at(self, coord: tuple[int, ...]) -> int:
        flat = 0
        for c, size in zip(coord, self.shape):
            flat = flat * size + c
        return self.ranks[flat]


@dataclass(frozen=True)
class MeshLayout:
    """A tensor laid out over ``mesh``: ``placements[i]`` is the tensor dimension that mesh
    dimension i shards, or None where it replicates."""

    mesh: Mesh
    placements: tuple[int | None, ...]

    def __post_init__(self) -> None:
        # (the Replicate mesh dimensions, how many ranks hold each box)
        replicate = [i for i, d in enumerate(self.placements) if d is None]
        object.__setattr__(self, "replicas",
                           (replicate, math.prod(self.mesh.shape[i] for i in replicate)))


@dataclass(frozen=True)
class BoxLayout:
    """A tensor stored as explicit boxes, each with the rank that wrote it (plain tensors,
    and any layout the mesh rule does not describe)."""

    boxes: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]  # (offsets, shape, writer)


Layout = MeshLayout | BoxLayout


def _split(size: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, size) of piece ``index`` of ``size`` elements cut into ``parts`` the way
    ``torch.chunk`` and DTensor's ``Shard`` do: pieces of ceil(size / parts), the last ones
    shorter or empty (an empty piece starts at ``size``)."""
    full = -(-size // parts) if parts else 0
    start = full * index
    if start >= size:
        return size, 0
    return start, min(size, start + full) - start


def mesh_box(shape: tuple[int, ...], layout: MeshLayout, coord: tuple[int, ...]) -> Box:
    """The box held at mesh coordinate ``coord`` (DTensor's rule: mesh dimensions applied
    left to right, each cutting what the previous ones left of its tensor dimension)."""
    return _mesh_box(tuple(shape), layout.placements, layout.mesh.shape, tuple(coord))


@functools.lru_cache(maxsize=1 << 16)
def _mesh_box(shape: tuple[int, ...], placements: tuple[int | None, ...],
              mesh_shape: tuple[int, ...], coord: tuple[int, ...]) -> Box:
    offsets, sizes = [0] * len(shape), list(shape)
    for i, d in enumerate(placements):
        if d is None:
            continue
        start, sizes[d] = _split(sizes[d], mesh_shape[i], coord[i])
        offsets[d] += start
    return tuple(offsets), tuple(sizes)


def _pick(key: str) -> int:
    return zlib.crc32(key.encode())


def writer(key: str, layout: MeshLayout, coord: tuple[int, ...]) -> int:
    """The rank that writes the box held at ``coord``: the replica numbered
    ``crc32(key) % replicas`` (row-major over the Replicate mesh dimensions)."""
    replicate, count = layout.replicas
    if count == 1:
        return layout.mesh.rank_at(coord)
    pick = _pick(key) % count
    chosen = list(coord)
    for i in reversed(replicate):
        chosen[i] = pick % layout.mesh.shape[i]
        pick //= layout.mesh.shape[i]
    return layout.mesh.rank_at(tuple(chosen))


def written_by(key: str, shape: tuple[int, ...], layout: Layout, rank: int) -> list[Box]:
    """The non-empty boxes of tensor ``key`` that ``rank`` writes."""
    if isinstance(layout, BoxLayout):
        return [(o, s) for o, s, w in layout.boxes if w == rank and math.prod(s)]
    coord = layout.mesh.coordinate(rank)
    if coord is None:
        return []
    box = mesh_box(shape, layout, coord)
    if not math.prod(box[1]) or writer(key, layout, coord) != rank:
        return []
    return [box]


@functools.lru_cache(maxsize=4096)
def _intervals(size: int, cuts: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...],
                                                           tuple[tuple[int, ...], ...]]:
    """The non-empty pieces of one tensor dimension of ``size`` cut successively into
    ``cuts`` parts: (starts, lengths, the coordinates along the cutting mesh dimensions),
    sorted by start. Shared by every tensor of that size and mesh (the layers repeat)."""
    pieces = []
    for coords in itertools.product(*(range(c) for c in cuts)):
        start, length = 0, size
        for parts, index in zip(cuts, coords):
            s, length = _split(length, parts, index)
            start += s
        if length:
            pieces.append((start, length, coords))
    pieces.sort()
    return (tuple(p[0] for p in pieces), tuple(p[1] for p in pieces),
            tuple(p[2] for p in pieces))


def cells_overlapping(key: str, shape: tuple[int, ...], layout: Layout,
                      box: Box) -> list[tuple[Box, int]]:
    """The saved boxes of tensor ``key`` that overlap ``box``, each with its writer.

    For a mesh layout: per tensor dimension, the pieces its mesh dimensions cut it into are
    found by bisection, and their product is the overlapping cells; O(log ranks) per
    dimension plus the cells returned.
    """
    if isinstance(layout, BoxLayout):
        out = []
        for o, s, w in layout.boxes:
            if math.prod(s) and all(bo < oo + ss and oo < bo + bs for oo, ss, bo, bs
                                    in zip(o, s, box[0], box[1])):
                out.append(((o, s), w))
        return out
    return [(cell, writer(key, layout, coord)) for cell, coord in
            _cells(tuple(shape), layout.placements, layout.mesh.shape, box)]


@functools.lru_cache(maxsize=1 << 14)
def _cells(shape: tuple[int, ...], placements: tuple[int | None, ...],
           mesh_shape: tuple[int, ...], box: Box) -> list[tuple[Box, tuple[int, ...]]]:
    """The cells of a mesh layout overlapping ``box``, each with its mesh coordinate along
    the sharding dimensions (0 along Replicate ones); shared by the tensors of one shape."""
    per_dim = []
    for d, size in enumerate(shape):
        dims = [i for i, p in enumerate(placements) if p == d]
        starts, lengths, coords = _intervals(size, tuple(mesh_shape[i] for i in dims))
        lo, hi = box[0][d], box[0][d] + box[1][d]
        first = max(0, bisect.bisect_right(starts, lo) - 1)
        last = bisect.bisect_left(starts, hi)
        per_dim.append([(starts[j], lengths[j], dims, coords[j]) for j in range(first, last)
                        if starts[j] + lengths[j] > lo])
    out = []
    for combo in itertools.product(*per_dim):
        coord = [0] * len(mesh_shape)
        for _, _, dims, coords in combo:
            for i, c in zip(dims, coords):
                coord[i] = c
        out.append(((tuple(c[0] for c in combo), tuple(c[1] for c in combo)), tuple(coord)))
    return out
