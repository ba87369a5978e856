"""How a manifest describes a tensor: its chunks, or the rank tables that hold them.

World-size independence: a tensor is described by its global shape and each chunk by its box
(offsets and shape) in the global tensor, so any number of ranks can read any slice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ckpt._format.layout import Box, Layout
from ckpt._format.names import DTYPES


@dataclass(frozen=True)
class Chunk:
    """A box of a tensor stored as one byte range of one data file.

    ``step`` is None when the file is in this step's directory, or the committed step whose
    directory holds it (an incremental save reusing an unchanged chunk).
    """

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    file: str
    start: int
    length: int
    digest: str
    codec: str = "raw"
    step: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class RankTables(Protocol):
    """The rank tables of a format-2 step, as a manifest uses them once they are attached
    (``ckpt._step.tables`` reads them from storage). Errors are CorruptCheckpointError."""

    def all_chunks(self, key: str) -> tuple[Chunk, ...]:
        """Every chunk of tensor ``key`` (reads every table)."""
        ...

    def overlapping(self, key: str, box: Box) -> list[tuple[Chunk, Box]]:
        """The chunks of ``key`` overlapping ``box``, each with the overlap."""
        ...

    def prefetch(self, wanted: Iterable[tuple[str, Box]]) -> None:
        """Read at once the tables that the (key, box) pairs ``wanted`` need."""
        ...

    def problems(self) -> list[Exception]:
        """One error per damaged table, or one for what the tables fail to cover."""
        ...

    def values_of(self, name: str) -> Mapping[str, Any]:
        """Per-rank item ``name``'s trees by saved rank; the mapping has ``in_tables = True``."""
        ...


class TensorEntry:
    """A tensor's global shape, dtype and the chunks that tile it.

    In a format-2 step the chunks live in the ranks' tables: ``layout`` says which rank
    wrote which box, and ``chunks`` reads every table on first use (tools that look at a
    whole step); a load asks :func:`ckpt._shared.sharding.overlapping`, which reads only the
    tables of the ranks that wrote the boxes it needs.
    """

    __slots__ = ("dtype", "shape", "layout", "_chunks", "_tables", "_key", "_index")

    def __init__(self, dtype: str, shape: tuple[int, ...], chunks: tuple[Chunk, ...] | None = None,
                 layout: Layout | None = None) -> None:
        self.dtype = dtype
        self.shape = tuple(shape)
        self.layout = layout
        self._chunks = None if chunks is None else tuple(chunks)
        self._tables: RankTables | None = None  # a format-2 step's tables, once attached
        self._key: str | None = None
        self._index: Any = None  # sharding's read index, built on first use

    def attach(self, tables: RankTables, key: str) -> None:
        """Look this tensor's chunks up as ``key`` in ``tables``."""
        self._tables, self._key = tables, key

    @property
    def in_tables(self) -> bool:
        """Its chunks are still in rank tables: look boxes up with :meth:`overlapping`
        rather than reading every chunk."""
        return self._chunks is None and self._tables is not None

    def overlapping(self, box: Box) -> list[tuple[Chunk, Box]]:
        """From the attached rank tables: the chunks overlapping ``box``, with the overlap."""
        if self._tables is None:
            raise RuntimeError("this tensor's chunks are not in rank tables")
        return self._tables.overlapping(self._key, box)

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        if self._chunks is None:
            if self._tables is None:
                raise RuntimeError("this manifest's chunks live in rank tables not attached to "
                                   "it (read it with ckpt._step.integrity.read_manifest)")
            self._chunks = self._tables.all_chunks(self._key)
        return self._chunks

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorEntry):
            return NotImplemented
        return (self.dtype, self.shape, self.layout, self.chunks) == (
            other.dtype, other.shape, other.layout, other.chunks)

    def __repr__(self) -> str:
        chunks = "unread" if self._chunks is None else f"{len(self._chunks)} chunks"
        return f"TensorEntry({self.dtype}, {list(self.shape)}, {chunks})"
