"""Tunables, gathered in one place as small frozen dataclasses validated on creation."""

from __future__ import annotations

import os
from dataclasses import dataclass

# 8 MiB chunks: large enough that per-chunk overhead (a manifest entry, one read, one digest)
# is negligible next to the bytes, small enough that an incremental save of a partly changed
# tensor rewrites little and a load has several chunks per file to read in parallel.
DEFAULT_CHUNK_BYTES = 8 << 20


def default_threads() -> int:
    """Writer/reader threads: one per core, at most 4 (a local disk gains nothing beyond)."""
    return max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class SaveOptions:
    """How a save lays out and writes its bytes.

    Args:
        chunk_bytes: target size of one chunk (the unit of digests, reuse and parallel reads).
        write_threads: data files written in parallel by one rank (one file per thread).
        allow_pickle: store values that are neither tensors nor JSON by pickling them.
    """

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    write_threads: int = default_threads()
    allow_pickle: bool = False

    def __post_init__(self) -> None:
        if self.chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be at least 4096, not {self.chunk_bytes}")
        if self.write_threads < 1:
            raise ValueError(f"write_threads must be at least 1, not {self.write_threads}")
