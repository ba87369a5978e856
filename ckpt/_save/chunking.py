"""Who writes which bytes: cutting tensors into chunks and chunks into data files.

Chunks are slabs along the first dimension, so each is one contiguous byte range of a
contiguous tensor (no gather on write, one read on load). The chunk size trades manifest
size against the granularity of incremental saves and of parallel reads (see knobs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkPlan:
    """A slab of a tensor: its box in the global tensor and its byte range in the tensor."""

    key: str
    index: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    byte_start: int
    byte_length: int


def chunk_tensor(key: str, shape: tuple[int, ...], itemsize: int,
                 chunk_bytes: int) -> list[ChunkPlan]:
    """Cut a contiguous tensor of ``shape`` into slabs of about ``chunk_bytes`` along dim 0."""
    total = math.prod(shape) * itemsize
    if not shape or total <= chunk_bytes or shape[0] <= 1:
        return [ChunkPlan(key, 0, (0,) * len(shape), tuple(shape), 0, total)]
    row_bytes = total // shape[0]
    rows = max(1, chunk_bytes // max(1, row_bytes))
    plans = []
    for i, r0 in enumerate(range(0, shape[0], rows)):
        n = min(rows, shape[0] - r0)
        plans.append(ChunkPlan(key, i, (r0,) + (0,) * (len(shape) - 1), (n,) + tuple(shape[1:]),
                               r0 * row_bytes, n * row_bytes))
    return plans


def assign_files(chunks: list[ChunkPlan], n_files: int) -> list[list[ChunkPlan]]:
    """Split chunks, in order, into at most ``n_files`` groups of about equal bytes."""
    total = sum(c.byte_length for c in chunks)
    n_files = max(1, min(n_files, len(chunks)))
    target = total / n_files
    groups: list[list[ChunkPlan]] = [[]]
    filled = 0
    for c in chunks:
        if groups[-1] and filled >= target * len(groups) and len(groups) < n_files:
            groups.append([])
        groups[-1].append(c)
        filled += c.byte_length
    return groups


def data_file_name(token: str, rank: int, index: int) -> str:
    """The name of a rank's ``index``-th data file of a save attempt.

    It starts with two hex digits that cycle with the rank (``data-3f-...``), so the keys of
    a large job spread over 256 key prefixes: S3 serves about 3,500 PUT/s per prefix, and
    thousands of ranks writing under one ``step-N/data-<token>`` prefix would be throttled.
    """
    return f"data-{rank % 256:02x}-{token}-r{rank:05d}-{index:03d}.safetensors"
