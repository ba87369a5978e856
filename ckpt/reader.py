"""Loading a committed step into live state, in place.

Order matters for "a bad checkpoint changes nothing": the manifest is validated and compared
with the live state (keys, shapes, dtypes) before any byte is read. Tensors are then read
straight into the live tensors where they are CPU, contiguous and of the right type (no extra
copy), every chunk checked against its digest; objects get ``load_state_dict`` last.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
from typing import Any, MutableMapping

import torch

from storage_backends import Storage

from .engine import byte_view
from .errors import CorruptCheckpointError, StateMismatchError
from .format import Chunk, Manifest
from .integrity import chunk_path, digest
from .state import FlatState, check_compatible, decode, flatten, is_stateful, tensor_keys


def _live_state(state: MutableMapping[str, Any]) -> FlatState:
    """Flatten what the live state holds now, for validation and as read destinations."""
    live = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) or is_stateful(v)}
    flat = flatten(live, allow_pickle=True)
    for k, v in state.items():
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


def _is_slab(chunk: Chunk, shape: tuple[int, ...]) -> bool:
    return not shape or (all(o == 0 for o in chunk.offsets[1:]) and chunk.shape[1:] == shape[1:])


def read_tensor_into(storage: Storage, location: str, manifest: Manifest, key: str,
                     dest: torch.Tensor,
                     pool: cf.ThreadPoolExecutor | None, verify: bool = True) -> list[cf.Future]:
    """Schedule (or run) the reads of every chunk of ``key`` into contiguous CPU ``dest``."""
    entry = manifest.tensors[key]
    row = math.prod(entry.shape[1:]) if entry.shape else 1

    def one(chunk: Chunk) -> None:
        if chunk.numel == 0:
            return
        if _is_slab(chunk, entry.shape):
            start = chunk.offsets[0] * row if entry.shape else 0
            out = dest.reshape(-1)[start:start + chunk.numel].view(chunk.shape)
            read_chunk(storage, location, key, chunk, out, verify)
        else:
            tmp = torch.empty(chunk.shape, dtype=dest.dtype)
            read_chunk(storage, location, key, chunk, tmp, verify)
            dest[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.shape))].copy_(tmp)

    if pool is None:
        for c in entry.chunks:
            one(c)
        return []
    return [pool.submit(one, c) for c in entry.chunks]


def load_step(storage: Storage, location: str, manifest: Manifest, state: MutableMapping[str, Any], *,
              allow_pickle: bool = False, verify: bool = True,
              pool: cf.ThreadPoolExecutor | None = None) -> None:
    """Load ``manifest``'s step into ``state`` in place (see the module docstring)."""
    live = _live_state(state)
    spec = {k: (e.shape, e.torch_dtype) for k, e in manifest.tensors.items()}
    check_compatible(live, manifest.items, spec, manifest.aliases)
    loaded: dict[str, torch.Tensor] = {}
    futures: list[cf.Future] = []
    # Items saved but absent from `state` are left alone: a caller may restore a subset.
    needed = {manifest.resolve(k) for name in state if name in manifest.items
              for k in tensor_keys(manifest.items[name].get("tree"))}
    for key in sorted(needed):
        entry = manifest.tensors[key]
        target = live.tensors.get(key)
        if (target is not None and target.device.type == "cpu" and target.is_contiguous()
                and target.dtype == entry.torch_dtype and tuple(target.shape) == entry.shape
                and not target.is_conj() and not target.is_neg()):
            dest = target
        else:
            dest = torch.empty(entry.shape, dtype=entry.torch_dtype)
        loaded[key] = dest
        futures += read_tensor_into(storage, location, manifest, key, dest, pool, verify)
    for f in futures:
        f.result()
    for alias, target in manifest.aliases.items():
        if target in loaded:
            loaded[alias] = loaded[target]
    for name, item in manifest.items.items():
        if name not in state:
            continue
        value = decode(item["tree"], loaded, allow_pickle=allow_pickle)
        kind = item["kind"]
        try:
            if kind in ("module", "stateful"):
                state[name].load_state_dict(value)
            elif kind == "tensor":
                if state[name] is not value:
                    with torch.no_grad():
                        state[name].copy_(value)
            else:
                state[name] = value
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise StateMismatchError(f"'{name}'.load_state_dict refused the checkpoint: {e}") from e
