"""Reading a DCP ``.metadata`` file without running what it could ask a pickle to run.

DCP writes its metadata with ``pickle.dump``. A plain ``pickle.load`` of a file someone else
wrote runs any callable that file names, so ckpt never does that: :func:`parse_metadata`
unpickles with a loader that resolves only DCP's own metadata dataclasses, ``torch.Size``,
torch dtypes and layouts, and ``pathlib`` paths (all constructors without side effects), and
then checks every field's type and range as ckpt checks its own manifests. Anything else is
a :class:`CorruptCheckpointError`; no opt-in turns the check off (a metadata file that names
other classes was not written by ``dcp.save``).

Threat: whoever can write the checkpoint directory (a shared bucket, a downloaded run) sends
a ``.metadata`` of their choosing. What it can cost: at most ``MAX_METADATA_BYTES`` read and
parsed; a pickle naming any other global, an entry pointing outside the directory
(``../``), a negative or overflowing offset, or chunks outside their tensor are refused.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import posixpath
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ckpt.errors import CorruptCheckpointError

from .detect import METADATA_NAME

MAX_METADATA_BYTES = 256 << 20  # a million tensors' entries stay far below this

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_md, name)
    for name in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                 "ChunkStorageMetadata", "TensorProperties", "StorageMeta",
                 "_MEM_FORMAT_ENCODING")
}
_ALLOWED[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
_ALLOWED[("torch", "Size")] = torch.Size
_ALLOWED[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
for _cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.Path):
    _ALLOWED[("pathlib", _cls.__name__)] = _cls
for _name, _value in vars(torch).items():
    if isinstance(_value, (torch.dtype, torch.layout, torch.memory_format)):
        _ALLOWED[("torch", _name)] = _value


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals a DCP metadata file names; refuses every other one."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which is not part of "
                                         "DCP's metadata") from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent id")


def parse_metadata(raw: bytes, where: str) -> dcp_md.Metadata:
    """The validated :class:`Metadata` of a DCP checkpoint from the bytes of its
    ``.metadata`` file; ``where`` names it in errors.

    Raises:
        CorruptCheckpointError: not DCP metadata, a forbidden global, or a field out of range.
    """
    if len(raw) > MAX_METADATA_BYTES:
        raise CorruptCheckpointError(f"{where} is {len(raw)} bytes, over the "
                                     f"{MAX_METADATA_BYTES}-byte limit of a DCP metadata file",
                                     path=where)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as e:  # any malformed pickle: its own error says which opcode
        raise CorruptCheckpointError(f"{where} is not a DCP metadata file ckpt can read "
                                     f"safely: {type(e).__name__}: {e}", path=where) from None
    try:
        _check(metadata)
    except (TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(f"{where} is invalid DCP metadata: {e}",
                                     path=where) from None
    return metadata


def _check(md: Any) -> None:
    """Types and ranges of every field the loaders use."""
    if not isinstance(md, dcp_md.Metadata):
        raise TypeError(f"it holds a {type(md).__name__}, not DCP's Metadata")
    if not isinstance(md.state_dict_metadata, dict):
        raise TypeError("state_dict_metadata is not a dict")
    for fqn, entry in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise TypeError(f"key {fqn!r} is not a string")
        if isinstance(entry, dcp_md.TensorStorageMetadata):
            _check_tensor(fqn, entry)
        elif not isinstance(entry, dcp_md.BytesStorageMetadata):
            raise TypeError(f"{fqn}: entry is a {type(entry).__name__}")
    if not isinstance(md.storage_data, dict):
        raise TypeError("storage_data is not a dict")
    for index, info in md.storage_data.items():
        if not isinstance(index, dcp_md.MetadataIndex) or not isinstance(index.fqn, str):
            raise TypeError(f"storage_data key {index!r} is not a MetadataIndex")
        if index.fqn not in md.state_dict_metadata:
            raise ValueError(f"storage_data names {index.fqn!r}, which has no entry")
        if not isinstance(info, _StorageInfo):
            raise TypeError(f"{index.fqn}: storage entry is a {type(info).__name__}")
        check_relative(info.relative_path, index.fqn)
        for field in ("offset", "length"):
            value = getattr(info, field)
            if type(value) is not int or value < 0:
                raise ValueError(f"{index.fqn}: {field} {value!r} is not a non-negative int")
        if info.transform_descriptors:
            raise ValueError(f"{index.fqn}: stored with transforms "
                             f"{list(info.transform_descriptors)}, which ckpt does not read")
    if md.planner_data is not None:
        if not isinstance(md.planner_data, dict):
            raise TypeError("planner_data is not a dict")
        for fqn, path in md.planner_data.items():
            if not (isinstance(path, tuple)
                    and all(type(p) in (str, int) for p in path)):
                raise TypeError(f"planner_data of {fqn!r} is not a tuple of keys")


def _check_tensor(fqn: str, entry: dcp_md.TensorStorageMetadata) -> None:
    if not isinstance(entry.properties, dcp_md.TensorProperties):
        raise TypeError(f"{fqn}: properties are a {type(entry.properties).__name__}")
    if not isinstance(entry.properties.dtype, torch.dtype):
        raise TypeError(f"{fqn}: dtype {entry.properties.dtype!r}")
    size = _dims(entry.size, f"{fqn}: size")
    if not isinstance(entry.chunks, list):
        raise TypeError(f"{fqn}: chunks are not a list")
    for chunk in entry.chunks:
        if not isinstance(chunk, dcp_md.ChunkStorageMetadata):
            raise TypeError(f"{fqn}: a chunk is a {type(chunk).__name__}")
        offsets = _dims(chunk.offsets, f"{fqn}: chunk offsets")
        sizes = _dims(chunk.sizes, f"{fqn}: chunk sizes")
        if not len(offsets) == len(sizes) == len(size) or any(
                o + s > d for o, s, d in zip(offsets, sizes, size)):
            raise ValueError(f"{fqn}: chunk at {list(offsets)} of {list(sizes)} lies outside "
                             f"the tensor's {list(size)}")


def _dims(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (torch.Size, tuple, list)) or not all(
            type(d) is int and d >= 0 for d in value):
        raise TypeError(f"{what} {value!r} is not a list of non-negative ints")
    return tuple(value)


def check_relative(name: Any, fqn: str) -> None:
    """A data file named by the metadata stays inside the checkpoint directory."""
    if (not isinstance(name, str) or not name or name.startswith("/") or "\\" in name
            or posixpath.normpath(name) != name or name.split("/")[0] == ".."):
        raise ValueError(f"{fqn}: data file {name!r} is not a file inside the checkpoint "
                         "directory")


def file_extents(md: dcp_md.Metadata) -> dict[str, int]:
    """The least size each data file must have: the end of its last stored entry."""
    ends: dict[str, int] = {}
    for info in md.storage_data.values():
        end = info.offset + info.length
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), end)
    return ends
