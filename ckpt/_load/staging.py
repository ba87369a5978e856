"""Staging memory for an atomic load's live destinations: each chunk read once into memory of
its own and verified there, then copied into its live tensor once every chunk has passed.

It replaces the two passes (verify, then read again into place) where the second read would
fetch the bytes again: storages without a page cache between the passes (object stores,
where ``stream_block`` is None and every read is a request). On a file system the page cache
already holds what the verify pass read, so the second read is the same memory copy that
staging ends with, and staging would add fresh pages for the whole state (on the 2-core VM of
docs/benchmarks.md a fresh page costs more than copying it: 256 MiB of new pages take
0.3-1.2 s to touch, a page-cache read of them ~0.1 s). ``STAGE_FILE_SYSTEMS`` switches it on
there too (benchmarks/bench_restore.py measures both).

Bounded: the staged bytes may not exceed ``BUDGET_FRACTION`` of the memory available when
the load starts, shared by the ranks of the host (``LOCAL_WORLD_SIZE``: they load at the same
time and each sees the same free memory); a load whose live chunks need more takes the two
passes and logs so. CPU destinations only: CUDA tensors keep their pinned bounce buffers.

Who can steer it: whoever writes the root writes the manifest, but a staged chunk is a chunk
of a live tensor whose shape and dtype the manifest was checked against before any read, so
staging never exceeds the live tensors' bytes nor the budget; a chunk that fails its digest
leaves the live tensors untouched (the staged buffers are dropped).
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from storage_backends import Storage, reads_are_requests

from ckpt._load.chunk_read import OpenFiles, read_chunk
from ckpt._load.read_plan import ChunkRead

log = logging.getLogger("ckpt")

#: Stage live chunks on file systems too (off: the page cache serves the second read).
STAGE_FILE_SYSTEMS = False
#: The most a load may stage: this fraction of the memory available when it starts.
BUDGET_FRACTION = 0.25


def available_memory() -> int:
    """Bytes of memory available to new allocations (``MemAvailable``), or free pages."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def staging_budget() -> int:
    """The bytes this process may stage: its share of ``BUDGET_FRACTION`` of the memory
    available now."""
    try:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_ranks = 1
    return int(available_memory() * BUDGET_FRACTION) // local_ranks


def staged_bytes(reads: list[ChunkRead]) -> int:
    """The staging memory ``reads`` take (whole chunks: a chunk's digest covers all of it)."""
    return sum(r.chunk.numel * r.dest.element_size() for r in reads)


def plan_staging(storage: Storage, live: list[ChunkRead]
                 ) -> tuple[list[ChunkRead], list[ChunkRead]]:
    """Split the reads into live tensors into (read once into staging, verified then read
    again); logs when the budget sends them to two passes."""
    cpu = [r for r in live if r.dest.device.type == "cpu"]
    cached = not reads_are_requests(storage)
    if not cpu or (cached and not STAGE_FILE_SYSTEMS):
        return [], live
    need, budget = staged_bytes(cpu), staging_budget()
    if need > budget:
        log.info("ckpt.load: the live tensors' chunks (%d bytes) exceed the staging budget "
                 "(%d bytes, this process's share of %g%% of the available memory): each is "
                 "verified first, then read again from %s into place", need, budget,
                 BUDGET_FRACTION * 100, storage.url)
        return [], live
    staged = {id(r) for r in cpu}
    return cpu, [r for r in live if id(r) not in staged]


class Stage:
    """Reads chunks into staging buffers (digested as they land) and keeps them by read."""

    def __init__(self, storage: Storage, location: str, files: OpenFiles) -> None:
        self.storage, self.location, self.files = storage, location, files
        self.buffers: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def __call__(self, r: ChunkRead) -> None:
        buf = torch.empty(r.chunk.shape, dtype=r.dest.dtype)
        read_chunk(self.storage, self.location, r.key, r.chunk, buf, True, self.files)
        with self._lock:
            self.buffers[id(r)] = buf
