"""Tunables, gathered in one place as small frozen dataclasses validated on creation."""

from __future__ import annotations

import math
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
        compression: None, or "zstd" (floating-point chunks byte-grouped first).
        compression_level: the zstd level; 1 is as small as 3 on weights and much faster.
        compression_threads: zstd worker threads per file being written (0: compress on
            the writer thread itself); benchmarks/bench_compression.py measures the choice.
        overlap_device_copy: copy the CUDA tensors that only ``optimizer.step()`` changes
            (parameters and state of the optimizers in the saved state) during the next
            forward and backward; their optimizer's step waits for the copy. False: training
            waits for every copy, as before (for code that changes parameters in place
            other than through ``optimizer.step()``).
        rank_tables: write format 2 (a small manifest plus one chunk table per rank; see
            docs/format.md). None: whenever more than one rank saves; a single process
            writes format 1 (one manifest holding every chunk) unless this is True.
    """

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    write_threads: int = default_threads()
    allow_pickle: bool = False
    compression: str | None = None
    compression_level: int = 1
    compression_threads: int = 0
    overlap_device_copy: bool = True
    rank_tables: bool | None = None

    def __post_init__(self) -> None:
        if self.chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be at least 4096, not {self.chunk_bytes}")
        if self.write_threads < 1:
            raise ValueError(f"write_threads must be at least 1, not {self.write_threads}")
        if self.compression not in (None, "zstd"):
            raise ValueError(f"compression must be None or 'zstd', not {self.compression!r}")
        if self.compression_threads < 0:
            raise ValueError(f"compression_threads must be >= 0, not {self.compression_threads}")
        if not -7 <= self.compression_level <= 22:
            raise ValueError(f"compression_level must be in [-7, 22], not {self.compression_level}")

    @property
    def max_file_bytes(self) -> int:
        """Compressed files are assembled in memory before writing: keep each one small."""
        return 64 << 20 if self.compression else 1 << 62


@dataclass(frozen=True)
class KeepBest:
    """Retention by a metric passed at save time (``mgr.save(step, state, metrics={...})``).

    Args:
        n: how many of the best steps to keep.
        metric: the name of the metric, e.g. ``"val_loss"``.
        mode: ``"min"`` (lower is better) or ``"max"``.
    """

    n: int
    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"keep_best must be a positive integer, not {self.n!r}")
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError("keep_best needs best_metric=, the name of a metric passed to "
                             "save(..., metrics={name: value})")
        if self.mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', not {self.mode!r}")

    def select(self, values: dict[int, float | None]) -> set[int]:
        """The ``n`` steps with the best values (a missing or non-finite value never ranks;
        on a tie the newer step wins)."""
        sign = 1.0 if self.mode == "min" else -1.0
        ranked = sorted((sign * v, -step) for step, v in values.items()
                        if isinstance(v, (int, float)) and math.isfinite(v))
        return {-neg_step for _, neg_step in ranked[:self.n]}
