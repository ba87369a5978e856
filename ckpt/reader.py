"""Loading a committed step into live state, in place, on any world size.

Order matters for "a bad checkpoint changes nothing": the manifest is validated and compared
with the live state (keys, shapes, dtypes) before any byte is read. Each rank then reads only
the chunks that overlap the boxes it holds (the whole tensor for a plain tensor, its shard for
a DTensor) into fresh host buffers, every chunk checked against its digest. A chunk that only partly overlaps is read whole (its digest covers
the whole chunk) and the overlap copied; chunks are a few MiB, so that bounds the extra bytes.
Objects get ``load_state_dict`` last.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
from typing import Any, Callable, MutableMapping

import torch

from storage_backends import Storage

from .engine import byte_view
from .errors import CorruptCheckpointError, StateMismatchError, UnsupportedValueError
from .format import Chunk, Manifest
from .integrity import chunk_path, digest
from .sharding import Box, dtensor_type, intersect, local_piece, source_rank, sub_slices
from .state import (FlatState, check_compatible, decode, flatten, holds_pickle, is_stateful,
                    item_tree, load_stateful, tensor_keys)


def _live_state(state: MutableMapping[str, Any], rank: int) -> FlatState:
    """Flatten what the live state holds now, for validation and as read destinations."""
    live = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) or is_stateful(v)}
    flat = flatten(live, allow_pickle=True, rank=rank, keep_vars=True)
    for k in state:
        if k not in live:
            flat.items[k] = {"kind": "value", "tree": None}
    return flat


def read_chunk(storage: Storage, location: str, key: str, chunk: Chunk,
               out: torch.Tensor, verify: bool = True) -> None:
    """Fill ``out`` (a contiguous CPU tensor of the chunk's shape) with the chunk's data."""
    path = chunk_path(location, chunk)
    view = byte_view(out)
    try:
        if chunk.codec == "raw":
            storage.read_into(path, chunk.start, view)
        else:
            from .codec import decode_into  # compression is optional on the read path

            decode_into(chunk.codec, storage.read(path, chunk.start, chunk.length), view, out.dtype)
    except (EOFError, FileNotFoundError, ValueError) as e:
        raise CorruptCheckpointError(
            f"{storage.url}/{path}: cannot read {key} at {list(chunk.offsets)}: {e}",
            path=f"{storage.url}/{path}") from e
    if verify and digest(view) != chunk.digest:
        raise CorruptCheckpointError(
            f"{storage.url}/{path}: digest mismatch in {key} at offsets {list(chunk.offsets)} "
            f"(bytes {chunk.start}..{chunk.start + chunk.length}): the data is corrupt",
            path=f"{storage.url}/{path}")


def _rows_of(dest_box: Box, chunk: Chunk) -> bool:
    """Whether the chunk is a run of whole rows of the destination box (one contiguous read)."""
    offsets, shape = dest_box
    if not shape:
        return True
    return (chunk.offsets[1:] == offsets[1:] and chunk.shape[1:] == shape[1:]
            and offsets[0] <= chunk.offsets[0]
            and chunk.offsets[0] + chunk.shape[0] <= offsets[0] + shape[0])


ReadJob = tuple[str, int, Callable[[], None]]  # (file path, start, read that fills dest)


def box_reads(storage: Storage, location: str, manifest: Manifest, key: str,
              dest: torch.Tensor, dest_box: Box, verify: bool = True) -> list[ReadJob]:
    """The reads that fill contiguous CPU ``dest``, which holds ``dest_box`` of ``key``:
    one per overlapping chunk, tagged with its file and offset so a caller can order them."""
    entry = manifest.tensors[key]
    row = math.prod(dest.shape[1:])

    def one(chunk: Chunk, overlap: Box) -> None:
        if _rows_of(dest_box, chunk):
            start = (chunk.offsets[0] - dest_box[0][0]) * row if entry.shape else 0
            out = dest.reshape(-1)[start:start + chunk.numel].view(chunk.shape)
            read_chunk(storage, location, key, chunk, out, verify)
        else:
            tmp = torch.empty(chunk.shape, dtype=dest.dtype)
            read_chunk(storage, location, key, chunk, tmp, verify)
            dest[sub_slices(dest_box, overlap)].copy_(
                tmp[sub_slices((chunk.offsets, chunk.shape), overlap)])

    jobs = []
    for chunk in entry.chunks:
        overlap = intersect((chunk.offsets, chunk.shape), dest_box) if entry.shape else (
            (), ())
        if chunk.numel and overlap is not None:
            jobs.append((chunk_path(location, chunk), chunk.start,
                         lambda c=chunk, o=overlap: one(c, o)))
    return jobs


def run_reads(jobs: list[ReadJob], pool: cf.ThreadPoolExecutor | None) -> None:
    """Run reads file by file, each file's in offset order (sequential reads, which the
    kernel's readahead serves best), files in parallel on ``pool``."""
    by_file: dict[str, list[ReadJob]] = {}
    for job in jobs:
        by_file.setdefault(job[0], []).append(job)

    def read_file(file_jobs: list[ReadJob]) -> None:
        for _, _, read in sorted(file_jobs, key=lambda j: j[1]):
            read()

    if pool is None or len(by_file) < 2:
        for file_jobs in by_file.values():
            read_file(file_jobs)
        return
    for future in [pool.submit(read_file, f) for f in by_file.values()]:
        future.result()


def load_step(storage: Storage, location: str, manifest: Manifest,
              state: MutableMapping[str, Any], *, rank: int = 0, allow_pickle: bool = False,
              verify: bool = True, pool: cf.ThreadPoolExecutor | None = None,
              in_place: bool = False) -> None:
    """Load ``manifest``'s step into this rank's ``state`` (see the module docstring).

    By default everything is read into fresh host buffers and checked first; the live state
    changes only once every chunk passed its digest and every value decoded, through
    ``load_state_dict``. With ``in_place``, tensors that are CPU, contiguous and of the
    saved dtype and shape are read straight into their memory (no second copy, no second
    buffer): a digest mismatch then leaves them partly overwritten — right for a restore
    that falls back to another step (which overwrites them again), not for a one-off load.
    Everything that can be checked without the data (manifest, files, keys, shapes, dtypes,
    parameter groups, pickle) is still checked before the first byte is read.
    """
    src = source_rank(rank, manifest.world_size)
    live = _live_state(state, src)
    spec = {k: (e.shape, e.torch_dtype) for k, e in manifest.tensors.items()}
    check_compatible(live, manifest.items, spec, manifest.aliases, src)
    # Items saved but absent from `state` are left alone: a caller may restore a subset.
    wanted = {name: item_tree(manifest.items[name], src) for name in state
              if name in manifest.items}
    _check_optimizers(state, wanted)
    if not allow_pickle and any(holds_pickle(tree) for tree in wanted.values()):
        raise UnsupportedValueError(
            f"{storage.url}/{location} holds pickled values; load it with allow_pickle=True "
            "only if you trust where it came from (nothing was loaded)", path=location)
    needed = {manifest.resolve(k) for tree in wanted.values() for k in tensor_keys(tree)}
    loaded: dict[str, torch.Tensor] = {}
    jobs: list[ReadJob] = []
    for key in sorted(needed):
        entry = manifest.tensors[key]
        target = live.tensors.get(key)
        if target is None:
            box: Box = ((0,) * len(entry.shape), entry.shape)
        else:
            _, offsets, local = local_piece(target)
            box = (offsets, tuple(local.shape))
        if in_place and target is not None and _readable_in_place(target, entry):
            buf = target
            loaded[key] = live.originals[key]  # load_state_dict's copy_ onto itself skips
        else:
            buf = torch.empty(box[1], dtype=entry.torch_dtype)
            loaded[key] = buf if target is None else _like(target, buf)
        jobs += box_reads(storage, location, manifest, key, buf, box, verify)
    run_reads(jobs, pool)
    for alias, target in manifest.aliases.items():
        if target in loaded:
            loaded[alias] = loaded[target]
    values = {name: decode(tree, loaded, allow_pickle=allow_pickle) for name, tree in wanted.items()}
    for name, value in values.items():
        kind = manifest.items[name]["kind"]
        try:
            if kind in ("module", "stateful"):
                load_stateful(state[name], value)
            elif kind == "tensor":
                with torch.no_grad():
                    state[name].copy_(value)
            else:
                state[name] = value
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise StateMismatchError(f"'{name}'.load_state_dict refused the checkpoint: {e}") from e


def _readable_in_place(t: torch.Tensor, entry: Any) -> bool:
    dtensor = dtensor_type()
    return (not (dtensor is not None and isinstance(t, dtensor)) and t.device.type == "cpu"
            and t.is_contiguous() and t.dtype == entry.torch_dtype
            and tuple(t.shape) == entry.shape and not t.is_conj() and not t.is_neg())


def _like(target: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's box, on the CPU) in the form of ``target``: a DTensor with the
    same mesh and placements for a DTensor, else the plain buffer (load_state_dict moves it)."""
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(target, dtensor):
        return dtensor.from_local(local.to(target.to_local().device), target.device_mesh,
                                  target.placements, run_check=False, shape=target.shape,
                                  stride=target.stride())
    return local


def _check_optimizers(state: MutableMapping[str, Any], wanted: dict[str, Any]) -> None:
    """An optimizer refuses param groups of other sizes; find that before anything changes."""
    for name, tree in wanted.items():
        obj = state[name]
        if not isinstance(obj, torch.optim.Optimizer) or not isinstance(tree, dict):
            continue
        saved = [len(g.get("params", [])) for g in tree.get("param_groups", [])
                 if isinstance(g, dict)]
        live = [len(g["params"]) for g in obj.param_groups]
        if saved != live:
            raise StateMismatchError(
                f"'{name}': the checkpoint's optimizer has parameter groups of sizes {saved}, "
                f"this optimizer {live}; nothing was loaded")
