"""Checkpoint metadata of a large job, simulated without tensor bytes.

A save and a load at N ranks run, besides moving bytes, a planning path whose cost grows with
ranks x tensors: every rank's boxes are gathered and writers assigned (replicas written once),
each writer cuts its boxes into chunks and lays them out in data files, the coordinator merges
every rank's chunk table into one manifest, serializes it, a reader validates it, and each rank
of the next world plans its reads against the chunks. This module drives exactly those
functions of ckpt (``assign_writers``, ``chunk_tensor``, ``assign_files``, ``encode_header``,
``RankTable``, ``build_manifest``, ``Manifest.to_json``/``from_json``, ``overlapping_chunks``)
with boxes computed by DTensor's own sharding rule, so nothing but the bytes is made up.
``tests/test_scale.py`` checks the simulated manifest against a real gloo save.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from ckpt.datafile import Piece, encode_header
from ckpt.engine import RankTable, StepPayload, build_manifest
from ckpt.format import DTYPES, Chunk, Manifest
from ckpt.options import SaveOptions
from ckpt.plan import assign_files, chunk_tensor, data_file_name
from ckpt.sharding import PieceSpec, assign_writers

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


def _box(t: TensorSpec, mesh: tuple[int, ...], coord: list[int]) -> tuple:
    shape, offsets = _compute_local_shape_and_global_offset(t.shape, mesh, coord,
                                                            list(t.placements))
    return tuple(int(o) for o in offsets), tuple(int(s) for s in shape)


def rank_boxes(mesh: tuple[int, ...], tensors: list[TensorSpec], rank: int) -> list[tuple]:
    """One rank's (offsets, shape) box of every tensor."""
    return [_box(t, t.mesh or mesh, _coordinate(rank, t.mesh or mesh)) for t in tensors]


def rank_specs(mesh: tuple[int, ...], tensors: list[TensorSpec]) -> list[list[PieceSpec]]:
    """Every rank's boxes, as ``snapshot`` gathers them (DTensor's own offset rule; computed
    once per distinct (shape, placements) and shared, as the layers repeat)."""
    world = math.prod(mesh)
    boxes_of: dict[tuple, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    out: list[list[PieceSpec]] = [[] for _ in range(world)]
    for t in tensors:
        t_mesh = t.mesh or mesh
        if math.prod(t_mesh) != world:
            raise ValueError(f"{t.key}: mesh {t_mesh} does not have {world} ranks")
        ident = (t.shape, t.placements, t_mesh)
        boxes = boxes_of.get(ident)
        if boxes is None:
            boxes = boxes_of[ident] = [_box(t, t_mesh, _coordinate(r, t_mesh))
                                       for r in range(world)]
        itemsize = DTYPES[t.dtype].itemsize
        for rank, (offsets, shape) in enumerate(boxes):
            out[rank].append(PieceSpec(t.key, t.dtype, t.shape, offsets, shape,
                                       math.prod(shape) * itemsize))
    return out


def rank_table(rank: int, specs: list[PieceSpec], writers: dict, options: SaveOptions,
               token: str) -> RankTable:
    """What ``engine.write_rank`` records for this rank's boxes, without the bytes: the same
    chunking, file grouping, file names and header layout (uncompressed, no reuse)."""
    chunks = []
    for s in specs:
        if writers[(s.key, s.offsets)] != rank:
            continue
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


def payload(tensors: list[TensorSpec], world: int, step: int = 1,
            token: str = "000000000000") -> StepPayload:
    """The coordinator's view of a save: every tensor's global dtype and shape."""
    return StepPayload(step=step, name=f"step-{step:08d}", pieces={},
                       tensors={t.key: (t.dtype, t.shape) for t in tensors}, items={},
                       aliases={}, world_size=world, token=token)


def manifest_of(tensors: list[TensorSpec], specs: list[list[PieceSpec]],
                options: SaveOptions, token: str = "000000000000") -> Manifest:
    """The manifest a save of ``tensors`` laid out as ``specs`` commits (no bytes, no digests)."""
    writers = assign_writers(specs)
    tables = [rank_table(r, s, writers, options, token) for r, s in enumerate(specs)]
    return build_manifest(payload(tensors, len(specs), token=token), tables)

