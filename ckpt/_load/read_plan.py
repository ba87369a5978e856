"""Planning a load's reads: which stored chunks fill which bytes of which destination."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from storage_backends import Storage

from ckpt._format.entries import Chunk
from ckpt._format.manifest import Manifest
from ckpt._load.chunk_read import read_chunk, read_chunk_into
from ckpt._shared.buffers import byte_view
from ckpt._shared.sharding import Box, overlapping, sub_slices
from ckpt._shared.state import holds_pickle, tensor_keys
from ckpt._step.integrity import chunk_path
from ckpt.errors import UnsupportedValueError


def _rows_of(dest_box: Box, chunk: Chunk) -> bool:
    """Whether the chunk is a run of whole rows of the destination box (one contiguous read)."""
    offsets, shape = dest_box
    if not shape:
        return True
    return (chunk.offsets[1:] == offsets[1:] and chunk.shape[1:] == shape[1:]
            and offsets[0] <= chunk.offsets[0]
            and chunk.offsets[0] + chunk.shape[0] <= offsets[0] + shape[0])


@dataclass
class ChunkRead:
    """One chunk to read for one destination box."""

    key: str
    chunk: Chunk
    overlap: Box
    dest: torch.Tensor  # holds dest_box of the tensor: a live tensor, its local shard, or new
    dest_box: Box
    into: memoryview | None  # the bytes of dest the chunk is read straight into, or None


ReadJob = tuple[str, int, Callable[[], None]]  # (file path, start, read that fills dest)


def reads_for(manifest: Manifest, key: str, dest: torch.Tensor,
              dest_box: Box) -> list[ChunkRead]:
    """One read per stored chunk of ``key`` that overlaps ``dest_box`` (which ``dest`` holds)."""
    whole = _direct_bytes(dest)  # once per tensor: the per-chunk part is a slice of it
    return [ChunkRead(key, chunk, overlap, dest, dest_box, _direct(whole, dest, dest_box, chunk))
            for chunk, overlap in overlapping(manifest.tensors[key], dest_box)]


def _direct_bytes(dest: torch.Tensor) -> memoryview | None:
    """The bytes of ``dest`` when chunks can be read straight into it, or None (bounce)."""
    if (dest.device.type != "cpu" or not dest.is_contiguous() or dest.is_conj()
            or dest.is_neg()):
        return None
    return byte_view(dest)


def _direct(whole: memoryview | None, dest: torch.Tensor, dest_box: Box,
            chunk: Chunk) -> memoryview | None:
    """The part of ``whole`` (the bytes of ``dest``, which holds ``dest_box``) that
    ``chunk`` fills when it is a run of whole rows of it, or None (bounce)."""
    if whole is None or not _rows_of(dest_box, chunk):
        return None
    start = (chunk.offsets[0] - dest_box[0][0]) * math.prod(dest.shape[1:]) if dest.dim() else 0
    size = dest.element_size()
    return whole[start * size:(start + chunk.numel) * size]


def box_reads(storage: Storage, location: str, manifest: Manifest, key: str,
              dest: torch.Tensor, dest_box: Box, verify: bool = True) -> list[ReadJob]:
    """The reads that fill CPU ``dest``, which holds ``dest_box`` of ``key``: one per
    overlapping chunk, tagged with its file and offset so a caller can order them."""
    def one(r: ChunkRead) -> None:
        if r.into is not None:
            read_chunk_into(storage, location, key, r.chunk, r.into, dest.dtype, verify)
            return
        tmp = torch.empty(r.chunk.shape, dtype=dest.dtype)
        read_chunk(storage, location, key, r.chunk, tmp, verify)
        dest[sub_slices(dest_box, r.overlap)].copy_(
            tmp[sub_slices((r.chunk.offsets, r.chunk.shape), r.overlap)])

    return [(chunk_path(location, r.chunk), r.chunk.start, lambda r=r: one(r))
            for r in reads_for(manifest, key, dest, dest_box)]


def needed_tensors(storage: Storage, location: str, manifest: Manifest,
                   trees: dict[str, Any], allow_pickle: bool) -> set[str]:
    """The stored tensors that the item ``trees`` to be loaded refer to (aliases resolved);
    refuses pickled values unless ``allow_pickle``, before any tensor is read."""
    if not allow_pickle and any(holds_pickle(tree) for tree in trees.values()):
        raise UnsupportedValueError(
            f"{storage.url}/{location} holds pickled values; load it with allow_pickle=True "
            "only if you trust where it came from (nothing was loaded)", path=location)
    return {manifest.resolve(k) for tree in trees.values() for k in tensor_keys(tree)}
