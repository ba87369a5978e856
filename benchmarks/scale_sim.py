"""Checkpoint metadata of a large job, simulated without tensor bytes.

A save and a load at N ranks run, besides moving bytes, a planning path whose cost grows with
ranks and tensors. In format 2 (docs/format.md) each rank decides from the tensors' layouts
which of its boxes it writes (``snapshot.written_here``), cuts them into chunks and data files
(``chunk_tensor``, ``assign_files``, ``encode_header``) and writes its chunk table
(``rank_write.table_file``); the coordinator collects one small report per rank and builds the
top-level manifest (``commit.build_top_manifest``, ``Manifest.to_json``); a reader validates
it (``Manifest.from_json``) and each rank of the next world finds the chunks overlapping its
boxes (``sharding.overlapping``: the layout names the ranks whose tables it reads, which are
then checked against their digests and validated). This module drives exactly those
functions, with boxes computed by DTensor's own sharding rule, so nothing but the bytes (and
the chunk digests) is made up. ``tests/save/test_scale.py`` checks a simulated step against a real
gloo save.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, replace

from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from ckpt._format.datafile import Piece, encode_header
from ckpt._save.commit import build_top_manifest
from ckpt._save.payload import RankTable, StepPayload
from ckpt._save.rank_write import table_file
from ckpt._format.entries import Chunk
from ckpt._format.manifest import Manifest
from ckpt._format.names import DTYPES
from ckpt._format.layout import BoxLayout, Mesh, MeshLayout
from ckpt.options import SaveOptions
from ckpt._save.chunking import assign_files, chunk_tensor, data_file_name
from ckpt._shared.sharding import PieceSpec
from ckpt._save.snapshot import written_here

# A 70B-parameter decoder (Llama-3-70B's shapes): 80 layers, hidden 8192, MLP 28672,
# 64 query heads and 8 key/value heads of 128, vocabulary 128256.
HIDDEN, MLP, KV, VOCAB, LAYERS = 8192, 28672, 1024, 128256, 80

# How tensor parallelism splits each kind of weight: column-parallel along dim 0,
# row-parallel along dim 1, norms replicated.
_TP_DIM = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0,
           "o_proj": 1, "down_proj": 1, "embed_tokens": 0, "lm_head": 0}


def llama70b_shapes(layers: int = LAYERS) -> dict[str, tuple[int, ...]]:
    """Parameter name -> global shape."""
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": (KV, HIDDEN),
            p + "self_attn.v_proj.weight": (KV, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (MLP, HIDDEN),
            p + "mlp.up_proj.weight": (MLP, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, MLP),
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
        })
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


@dataclass(frozen=True)
class TensorSpec:
    """One global tensor of the simulated state and how it is laid out over the mesh."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    mesh: tuple[int, ...] | None = None  # None: the state's mesh


def model_state(layout: str, world: int, *, optimizer: bool = True,
                layers: int = LAYERS) -> tuple[tuple[int, ...], list[TensorSpec]]:
    """(mesh shape, tensors) of the 70B model (bf16) and its Adam state (fp32) under
    ``layout``: "fsdp" (Shard(0) over all ranks), "hsdp" (replicas of 8-way FSDP groups:
    mesh (world/8, 8), (Replicate, Shard(0))) or "tp_fsdp" (mesh (world/8, 8): FSDP over
    the first dim, 8-way tensor parallel over the second)."""
    if layout == "fsdp":
        mesh: tuple[int, ...] = (world,)
    elif layout in ("hsdp", "tp_fsdp"):
        if world % 8:
            raise ValueError(f"{layout} needs a world that is a multiple of 8, not {world}")
        mesh = (world // 8, 8)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    tensors = []
    for key, shape in llama70b_shapes(layers).items():
        if layout == "fsdp":
            place: tuple[Placement, ...] = (Shard(0),)
        elif layout == "hsdp":
            place = (Replicate(), Shard(0))
        else:
            kind = key.split(".")[-2]
            tp = _TP_DIM.get(kind)
            place = (Shard(0), Shard(tp) if tp is not None else Replicate())
        tensors.append(TensorSpec(f"model/{key}", "bfloat16", shape, place))
        if optimizer:
            for moment in ("exp_avg", "exp_avg_sq"):
                tensors.append(TensorSpec(f"optim/state/{key}/{moment}", "float32", shape, place))
    return mesh, tensors


def _coordinate(rank: int, mesh: tuple[int, ...]) -> list[int]:
    coord = []
    for size in reversed(mesh):
        coord.append(rank % size)
        rank //= size
    return coord[::-1]


_BOXES: dict[tuple, tuple] = {}


def _box(t: TensorSpec, mesh: tuple[int, ...], coord: list[int]) -> tuple:
    """DTensor's own offset rule (cached: the layers repeat)."""
    ident = (t.shape, t.placements, mesh, tuple(coord))
    box = _BOXES.get(ident)
    if box is None:
        shape, offsets = _compute_local_shape_and_global_offset(t.shape, mesh, coord,
                                                                list(t.placements))
        box = _BOXES[ident] = (tuple(int(o) for o in offsets), tuple(int(s) for s in shape))
    return box


def rank_boxes(mesh: tuple[int, ...], tensors: list[TensorSpec], rank: int) -> list[tuple]:
    """One rank's (offsets, shape) box of every tensor."""
    return [_box(t, t.mesh or mesh, _coordinate(rank, t.mesh or mesh)) for t in tensors]


def rank_specs(mesh: tuple[int, ...], tensors: list[TensorSpec], rank: int) -> list[PieceSpec]:
    """One rank's boxes as ``snapshot`` describes them."""
    out = []
    for t, (offsets, shape) in zip(tensors, rank_boxes(mesh, tensors, rank)):
        out.append(PieceSpec(t.key, t.dtype, t.shape, offsets, shape,
                             math.prod(shape) * DTYPES[t.dtype].itemsize))
    return out


def rng_state(world: int) -> tuple[dict, dict[str, tuple[str, tuple[int, ...], int]]]:
    """A real trainer's per-rank ``ckpt.RNGState`` on ``world`` ranks as a save records it:
    the item (one tree per rank: a real RNGState's tree, renamed per rank, ~7.6 KB of JSON)
    and each rank's own tensors (key -> (dtype, shape, the rank that holds and writes it))."""
    import ckpt
    from ckpt._format.names import dtype_name
    from ckpt._shared.state import flatten

    flat = flatten({"rng": ckpt.RNGState()}, rank=0)
    tree = json.dumps(flat.items["rng"]["per_rank"]["0"])
    per_rank = {str(r): json.loads(tree.replace('"rng@0/', f'"rng@{r}/')) for r in range(world)}
    own = {k.replace("rng@0/", f"rng@{r}/", 1): (dtype_name(t.dtype), tuple(t.shape), r)
           for r in range(world) for k, t in flat.tensors.items()}
    return {"rng": {"kind": "stateful", "per_rank": per_rank}}, own


RNG = tuple[dict, dict[str, tuple[str, tuple[int, ...], int]]]  # what rng_state returns


def layouts_of(mesh: tuple[int, ...], tensors: list[TensorSpec],
               rng: RNG | None = None) -> dict[str, MeshLayout | BoxLayout]:
    """Each tensor's layout as ``sharding.mesh_layout`` derives it from a DTensor (one
    :class:`Mesh` object per mesh, ranks in order)."""
    meshes: dict[tuple[int, ...], Mesh] = {}
    out = {}
    for t in tensors:
        shape = t.mesh or mesh
        m = meshes.get(shape)
        if m is None:
            m = meshes[shape] = Mesh(shape, tuple(range(math.prod(shape))))
        out[t.key] = MeshLayout(m, tuple(p.dim if isinstance(p, Shard) else None
                                         for p in t.placements))
    for key, (_, shape, rank) in (rng[1] if rng else {}).items():  # snapshot's rule
        out[key] = BoxLayout((((0,) * len(shape), shape, rank),))
    return out


def rank_table(rank: int, specs: list[PieceSpec], mine: list[str], options: SaveOptions,
               token: str) -> RankTable:
    """What ``rank_write.write_rank`` records for this rank's boxes, without the bytes: the same
    chunking, file grouping, file names and header layout (uncompressed, no reuse)."""
    chunks = []
    by_key = {s.key: s for s in specs}
    for key in mine:
        s = by_key[key]
        for c in chunk_tensor(s.key, s.shape, DTYPES[s.dtype].itemsize, options.chunk_bytes):
            chunks.append((replace(c, offsets=tuple(o + b for o, b in zip(s.offsets, c.offsets))),
                           s.dtype))
    dtype_of = {(c.key, c.index): dtype for c, dtype in chunks}
    plans = [c for c, _ in chunks]
    new_bytes = sum(c.byte_length for c in plans)
    n_files = max(options.write_threads, -(-new_bytes // options.max_file_bytes))
    table = RankTable()
    for index, group in enumerate(assign_files(plans, n_files) if plans else []):
        name = data_file_name(token, rank, index)
        pieces = [Piece(f"{c.key}#{list(c.offsets)}", _Sized(c.byte_length),
                        DTYPES[dtype_of[(c.key, c.index)]], c.shape) for c in group]
        start = len(encode_header(pieces))
        for c in group:
            table.chunks.append((c.key, Chunk(c.offsets, c.shape, name, start, c.byte_length,
                                              "0" * 16)))
            start += c.byte_length
        table.files[name] = start
        table.bytes_written += start
    return table


class _Sized:
    """Stands in for a chunk's bytes where only their length is used (the file header)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def payload(tensors: list[TensorSpec], world: int, layouts: dict, rank: int = 0,
            step: int = 1, token: str = "000000000000", rng: RNG | None = None) -> StepPayload:
    """A rank's view of a save: every tensor's global dtype, shape and layout (and with
    ``rng``, every rank's RNG tensors and this rank's RNG tree among the items: a save
    exchanges no other rank's trees)."""
    items, own = rng or ({}, {})
    items = {name: {**item, "per_rank": {str(rank): item["per_rank"][str(rank)]}}
             for name, item in items.items()}
    return StepPayload(step=step, name=f"step-{step:08d}", pieces={},
                       tensors={**{t.key: (t.dtype, t.shape) for t in tensors},
                                **{k: (d, shape) for k, (d, shape, _) in own.items()}},
                       items=items, aliases={}, world_size=world, token=token, rank=rank,
                       layouts=layouts)


def save_rank(mesh: tuple[int, ...], tensors: list[TensorSpec], layouts: dict, rank: int,
              options: SaveOptions, token: str = "000000000000",
              rng: RNG | None = None) -> tuple[str, bytes, dict]:
    """Rank ``rank``'s part of a save: which boxes it writes, its chunks and data files, and
    its chunk table (name, bytes) with the report it sends to the commit vote."""
    specs = rank_specs(mesh, tensors, rank)
    for key, (dtype, shape, r) in (rng[1] if rng else {}).items():
        if r == rank:
            specs.append(PieceSpec(key, dtype, shape, (0,) * len(shape), shape,
                                   math.prod(shape) * DTYPES[dtype].itemsize))
    table = rank_table(rank, specs, written_here(specs, layouts, rank), options, token)
    world = math.prod(mesh)
    return table_file(payload(tensors, world, layouts, rank, token=token, rng=rng), table)


def step_of(mesh: tuple[int, ...], tensors: list[TensorSpec], options: SaveOptions,
            token: str = "000000000000", rng: RNG | None = None
            ) -> tuple[Manifest, dict[str, bytes]]:
    """The manifest and rank tables a save of ``tensors`` (and ``rng``) commits (no bytes,
    no digests); every rank's part computed (small worlds: the tests)."""
    world = math.prod(mesh)
    layouts = layouts_of(mesh, tensors, rng)
    files, reports = {}, []
    for rank in range(world):
        name, raw, report = save_rank(mesh, tensors, layouts, rank, options, token, rng)
        files[name] = raw
        reports.append(report)
    manifest = build_top_manifest(payload(tensors, world, layouts, token=token, rng=rng),
                                  reports)
    return manifest, files


def count_chunks(tensors: list[TensorSpec], layouts: dict, options: SaveOptions) -> int:
    """How many chunks a save writes in all, without computing every rank's table: each
    tensor's saved boxes are the product of its dimensions' pieces (``layout._intervals``),
    and a box's chunk count depends only on its shape."""
    from collections import Counter

    from ckpt._format.layout import _intervals

    total = 0
    for t in tensors:
        layout = layouts[t.key]
        per_dim = []
        for d, size in enumerate(t.shape):
            cuts = tuple(layout.mesh.shape[i] for i, p in enumerate(layout.placements) if p == d)
            per_dim.append(Counter(_intervals(size, cuts)[1]).items())
        for combo in itertools.product(*per_dim):
            shape = tuple(length for length, _ in combo)
            n = math.prod(count for _, count in combo)
            total += n * len(chunk_tensor(t.key, shape, DTYPES[t.dtype].itemsize,
                                          options.chunk_bytes))
    return total
