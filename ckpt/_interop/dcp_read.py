"""Reading a DCP checkpoint directory with torch's own reader and planner, made safe.

``torch.distributed.checkpoint.load`` does the resharding: each rank plans the chunks that
overlap the shards it holds (DTensor/FSDP2 shards, plain tensors) and reads only those
entries' byte ranges from the ``.distcp`` files. ckpt wraps it in three places:

- the metadata is parsed by :func:`parse_metadata` (no pickle executed, fields validated);
- every data file is checked to reach the end of its last entry before anything is read, so
  a truncated ``.distcp`` is a :class:`CorruptCheckpointError` naming the file, not a torch
  deserialization error half-way through a load;
- non-tensor values (DCP stores them with ``torch.save``) are loaded with
  ``weights_only=True`` unless the caller passes ``allow_pickle=True``. Tensor entries are
  always read with ``weights_only=True`` by torch itself.

DCP files carry no checksums: flipped bits inside a tensor load as they are. ``ckpt import``
turns a DCP checkpoint into a ckpt step with digests.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from ckpt.errors import CorruptCheckpointError, UnsupportedValueError

from .dcp_metadata import MAX_METADATA_BYTES, file_extents, parse_metadata
from .detect import METADATA_NAME


class _SafeMetadata:
    """``read_metadata`` through the restricted parser, then the data files' sizes checked;
    mixed into torch's local and fsspec readers."""

    bytes_read = 0  # the stored entries this reader read, in bytes

    def _file_size(self, path: str) -> int:
        raise NotImplementedError

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        self.bytes_read += sinfo.length
        return super()._slice_file(file, sinfo)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        cached = getattr(self, "_ckpt_metadata", None)
        if cached is not None:
            return cached
        where = str(self.fs.concat_path(self.path, METADATA_NAME))
        with self.fs.create_stream(where, "rb") as f:
            raw = f.read(MAX_METADATA_BYTES + 1)
        metadata = parse_metadata(raw, where)
        for name, end in file_extents(metadata).items():
            path = str(self.fs.concat_path(self.path, name))
            try:
                size = self._file_size(path)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{path} is missing: the DCP metadata names it",
                                             path=path) from None
            if size < end:
                raise CorruptCheckpointError(
                    f"{path} is truncated: {size} bytes, but the DCP metadata places data up "
                    f"to byte {end}; the checkpoint cannot be loaded (copy it again, or use "
                    "an older one)", path=path)
        self._ckpt_metadata = metadata
        return metadata


class SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    """torch's local DCP reader with ckpt's metadata checks."""

    def _file_size(self, path: str) -> int:
        return os.stat(path).st_size


def open_reader(path: str | os.PathLike, storage_options: dict | None = None) -> Any:
    """A safe DCP reader of a local directory or an fsspec URL."""
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        class SafeFsspecReader(_SafeMetadata, FsspecReader):
            def _file_size(self, p: str) -> int:
                return self.fs.fs.size(p)

        return SafeFsspecReader(text, **(storage_options or {}))
    return SafeFileSystemReader(text.removeprefix("file://"))


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, loading non-tensor values without pickle unless allowed."""

    def __init__(self, allow_pickle: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.allow_pickle = allow_pickle

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=not self.allow_pickle)
        except pickle.UnpicklingError as e:
            why = str(e).partition("WeightsUnpickler error: ")[2].split(". ")[0] or str(e)
            raise UnsupportedValueError(
                f"DCP value {fqn!r} needs pickle to load ({why}); pass allow_pickle=True if "
                "you trust the checkpoint") from None
        except Exception as e:
            raise CorruptCheckpointError(f"DCP value {fqn!r} does not load: "
                                         f"{type(e).__name__}: {e}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
