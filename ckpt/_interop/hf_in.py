"""A model, whole or sharded (FSDP2/DTensor), initialised from a Hugging Face folder of
safetensors shards (``model-0000N-of-0000M.safetensors`` plus
``model.safetensors.index.json``, or one ``model.safetensors``).

Each rank reads, for each of its parameters and buffers, only the slice its shard holds
(``safe_open(...).get_slice``: the byte ranges of those rows), from the file the index
names. Names are the module's ``state_dict`` names, matched in the index as they are or
without the module's first prefix (``transformer.h.0...`` of a ``GPT2LMHeadModel`` and
``h.0...`` of a ``GPT2Model`` both find theirs). Tied weights (one parameter under two
names) load once, from whichever name the folder holds.

Threat: whoever wrote the folder chooses the index and the files. The index is JSON
parsed with a size cap; a ``weight_map`` file name must be a plain name inside the folder;
a tensor whose shape is not the module's is refused before anything is copied; the
safetensors headers are parsed by the safetensors library (no pickle anywhere).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, StateMismatchError

from .detect import HF_INDEX_NAME, HF_SINGLE_NAME

MAX_INDEX_BYTES = 64 << 20


@dataclass
class HfLoad:
    """What one rank read: tensors, the bytes of the slices it read, the folder's size."""

    tensors: int
    bytes_read: int
    folder_bytes: int


def weight_map(folder: str) -> dict[str, str]:
    """Tensor name -> the safetensors file (inside ``folder``) that holds it."""
    index = os.path.join(folder, HF_INDEX_NAME)
    if not os.path.isfile(index):
        single = os.path.join(folder, HF_SINGLE_NAME)
        if not os.path.isfile(single):
            raise CheckpointNotFoundError(f"{folder} holds neither {HF_INDEX_NAME} nor "
                                          f"{HF_SINGLE_NAME}", path=folder)
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {k: HF_SINGLE_NAME for k in f.keys()}
    if os.path.getsize(index) > MAX_INDEX_BYTES:
        raise CorruptCheckpointError(f"{index} is over {MAX_INDEX_BYTES} bytes", path=index)
    try:
        with open(index, encoding="utf-8") as f:
            mapping = json.load(f)["weight_map"]
        if not isinstance(mapping, dict):
            raise TypeError("weight_map is not an object")
        for name, file in mapping.items():
            if (not isinstance(name, str) or not isinstance(file, str)
                    or os.path.basename(file) != file or file in ("", ".", "..")):
                raise ValueError(f"{name!r} -> {file!r} is not a file inside the folder")
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{index} is not a safetensors index: "
                                     f"{type(e).__name__}: {e}", path=index) from None
    return mapping


def load_hf(module: torch.nn.Module, folder: str | os.PathLike) -> HfLoad:
    """Initialise ``module`` (plain, or with DTensor parameters: FSDP2, tensor parallel)
    from the Hugging Face folder ``folder``, each rank reading only its shards' slices.

    Raises:
        CheckpointNotFoundError: no index and no ``model.safetensors`` in ``folder``.
        CorruptCheckpointError: the index or a file is invalid or missing.
        StateMismatchError: a name the module has is not in the folder, or its shape differs
            (nothing was copied).
    """
    from safetensors import safe_open

    folder = os.fspath(folder)
    mapping = weight_map(folder)
    targets: dict[int, tuple[str, torch.Tensor]] = {}  # one entry per tied group
    names: dict[int, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
        targets.setdefault(id(tensor), (name, tensor))
    plan: list[tuple[str, str, torch.Tensor]] = []  # (file, key, target)
    missing = []
    for key_id, (name, tensor) in targets.items():
        found = next((k for n in names[key_id] for k in _candidates(n) if k in mapping), None)
        if found is None:
            missing.append(name)
        else:
            plan.append((mapping[found], found, tensor))
    if missing:
        raise StateMismatchError(f"{folder} has no tensor for {_few(missing)} (nor without "
                                 "their first prefix); nothing was loaded", path=folder)
    slices: list[tuple[torch.Tensor, Any, tuple[slice, ...], str]] = []  # target, file, part, key
    handles: dict[str, Any] = {}
    try:
        for file, key, tensor in plan:  # check every shape before copying anything
            path = os.path.join(folder, file)
            if file not in handles:
                try:
                    handles[file] = safe_open(path, framework="pt")
                except Exception as e:
                    raise CorruptCheckpointError(f"{path} does not open as safetensors: "
                                                 f"{e}", path=path) from None
            shape = tuple(handles[file].get_slice(key).get_shape())
            local, index = _local(tensor)
            if shape != tuple(tensor.shape):
                raise StateMismatchError(f"{folder}: {key} is {list(shape)}, the module's is "
                                         f"{list(tensor.shape)}; nothing was loaded",
                                         path=folder)
            slices.append((local, handles[file], index, key))
        read = 0
        with torch.no_grad():
            for local, handle, index, key in slices:
                if local.numel() == 0:
                    continue
                part = handle.get_slice(key)[index] if index else handle.get_tensor(key)
                read += part.numel() * part.element_size()
                local.copy_(part.reshape(local.shape))
    finally:
        handles.clear()
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in set(mapping.values()))
    return HfLoad(len(slices), read, size)


def read_hf(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the folder, full, by its name (``ckpt import --from hf``)."""
    from safetensors import safe_open

    folder = os.fspath(folder)
    out: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for key, file in weight_map(folder).items():
        by_file.setdefault(file, []).append(key)
    for file, keys in sorted(by_file.items()):
        path = os.path.join(folder, file)
        try:
            with safe_open(path, framework="pt") as f:
                for key in keys:
                    out[key] = f.get_tensor(key)
        except Exception as e:
            raise CorruptCheckpointError(f"{path} does not read as safetensors: {e}",
                                         path=path) from None
    return out


_INPUT_EMBEDDINGS = ("wte.weight", "embed_tokens.weight", "word_embeddings.weight",
                     "shared.weight", "tok_embeddings.weight")


def tied_names(folder: str, names: list[str]) -> dict[str, str]:
    """The names ``save_pretrained`` left out because they are tied: ``lm_head.weight`` ->
    the input embedding, when ``config.json`` ties the word embeddings (its default), the
    folder has no ``lm_head.weight`` and exactly one input embedding."""
    config = os.path.join(folder, "config.json")
    try:
        with open(config, encoding="utf-8") as f:
            tie = json.load(f).get("tie_word_embeddings", True)
    except (OSError, ValueError, AttributeError):
        return {}
    embeddings = [n for n in names if n.endswith(_INPUT_EMBEDDINGS)]
    if tie is not True or "lm_head.weight" in names or len(embeddings) != 1:
        return {}
    return {"lm_head.weight": embeddings[0]}


def _candidates(name: str) -> list[str]:
    head, _, rest = name.partition(".")
    return [name, rest] if rest else [name]


def _local(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The tensor this rank writes and the slice of the full tensor it holds."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor, ()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                          tensor.placements)
    return tensor.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape))


def _few(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
