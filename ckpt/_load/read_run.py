"""Running a load's reads: file by file on a pool, through reused host buffers, and the apply
pass's copies into the live tensors (a side stream per device for CUDA ones)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from typing import Any, Callable

import torch

from storage_backends import Storage

from ckpt._format.entries import Chunk
from ckpt._load.chunk_read import OpenFiles, read_chunk, read_chunk_into, verify_run
from ckpt._load.read_plan import ChunkRead, ReadJob
from ckpt._shared.buffers import byte_view
from ckpt._shared.sharding import sub_slices
from ckpt._step.integrity import chunk_path


class Scratch:
    """Host buffers reused by each reading thread (the load's bounded memory): one block
    buffer for streamed reads and chunk-sized ones for whole chunks.

    ``take`` hands out two buffers per thread in turn; a pinned one is reused only once the
    host-to-device copy recorded on it has finished, so one chunk's read overlaps the
    previous chunk's copy.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def take(self, chunk: Chunk, dtype: torch.dtype, pinned: bool = False) -> torch.Tensor:
        slots = getattr(self._local, "slots", None)
        if slots is None:
            slots = self._local.slots = {False: [[None, None], [None, None]],
                                         True: [[None, None], [None, None]]}
            self._local.turn = 0
        self._local.turn ^= 1
        slot = slots[pinned][self._local.turn]
        nbytes = chunk.numel * dtype.itemsize
        if slot[1] is not None:
            slot[1].synchronize()  # the copy out of this buffer must be done before reuse
            slot[1] = None
        if slot[0] is None or slot[0].numel() < nbytes:
            slot[0] = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
        return slot[0][:nbytes].view(dtype).view(chunk.shape)

    def block(self, nbytes: int) -> memoryview:
        """This thread's buffer for streamed reads (the verify pass)."""
        buf = getattr(self._local, "block", None)
        if buf is None or len(buf) != nbytes:
            buf = self._local.block = byte_view(torch.empty(nbytes, dtype=torch.uint8))
        return buf

    def copied(self, pinned: bool, event: Any) -> None:
        """The last buffer taken is being copied out until ``event`` completes."""
        self._local.slots[pinned][self._local.turn][1] = event


class Applier:
    """The apply pass: fills destinations, keeps count of what changed for error messages."""

    def __init__(self, storage: Storage, location: str, scratch: Scratch, verify: bool,
                 files: OpenFiles, staged: dict[int, torch.Tensor] | None = None) -> None:
        self.storage, self.location, self.scratch, self.files = storage, location, scratch, files
        self.verify = verify  # one-pass load: check each chunk where it landed
        self.staged = staged if staged is not None else {}  # id(read) -> its verified chunk
        self._lock = threading.Lock()
        self._streams: dict[torch.device, Any] = {}
        self.started: set[str] = set()
        self.finished: dict[str, int] = {}

    def stream(self, device: torch.device) -> Any:
        with self._lock:
            s = self._streams.get(device)
            if s is None:
                s = self._streams[device] = torch.cuda.Stream(device=device)
                # what training queued on the tensors runs before the copies overwrite them
                s.wait_stream(torch.cuda.current_stream(device))
            return s

    def __call__(self, r: ChunkRead) -> None:
        with self._lock:
            self.started.add(r.key)
        staged = self.staged.pop(id(r), None)
        if staged is not None:  # read and verified before: a copy from memory
            r.dest[sub_slices(r.dest_box, r.overlap)].copy_(
                staged[sub_slices((r.chunk.offsets, r.chunk.shape), r.overlap)])
        elif r.into is not None:
            read_chunk_into(self.storage, self.location, r.key, r.chunk, r.into, r.dest.dtype,
                       self.verify, self.files)
        else:
            cuda = r.dest.device.type == "cuda"
            tmp = self.scratch.take(r.chunk, r.dest.dtype, pinned=cuda)
            read_chunk(self.storage, self.location, r.key, r.chunk, tmp, self.verify, self.files)
            src = tmp[sub_slices((r.chunk.offsets, r.chunk.shape), r.overlap)]
            dst = r.dest[sub_slices(r.dest_box, r.overlap)]
            if cuda:
                stream = self.stream(r.dest.device)
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                self.scratch.copied(True, event)
            else:
                dst.copy_(src)
        with self._lock:
            self.finished[r.key] = self.finished.get(r.key, 0) + 1

    def wait(self) -> None:
        """Every host-to-device copy issued has completed."""
        for s in self._streams.values():
            s.synchronize()


def verify_jobs(storage: Storage, location: str, reads: list[ChunkRead],
                scratch: Scratch) -> list[ReadJob]:
    """The verify pass's reads: one per run of adjacent stored-raw chunks of a file where the
    storage streams (see :mod:`ckpt._load.reader`), one per chunk otherwise. Where the
    storage reads from memory (``reads_from_memory``) each run is cut into one piece per core,
    for :func:`run_reads` to read in parallel (``cached``)."""
    jobs: list[ReadJob] = []
    streamed: list[ChunkRead] = []
    block = getattr(storage, "stream_block", None)  # duck-typed sources may lack it
    for r in sorted(reads, key=lambda r: (chunk_path(location, r.chunk), r.chunk.start)):
        if block is None or r.chunk.codec != "raw":
            jobs.append((chunk_path(location, r.chunk), r.chunk.start, lambda r=r: read_chunk(
                storage, location, r.key, r.chunk, scratch.take(r.chunk, r.dest.dtype))))
        else:
            streamed.append(r)
    runs = adjacent_runs(streamed, lambda r: chunk_path(location, r.chunk), lambda r: r.chunk)
    if getattr(storage, "reads_from_memory", False):
        runs = [part for run in runs for part in _cut(run, _cores())]
    for run in runs:
        path = chunk_path(location, run[0].chunk)
        jobs.append((path, run[0].chunk.start,
                     lambda path=path, run=run: verify_run(storage, path, run,
                                                           scratch.block(block))))
    return jobs


def adjacent_runs(items: list[Any], path_of: Callable[[Any], str],
                  chunk_of: Callable[[Any], Chunk]) -> list[list[Any]]:
    """``items`` (in file order) in runs whose chunks follow each other in one file."""
    runs: list[list[Any]] = []
    for item in items:
        if runs and path_of(runs[-1][-1]) == path_of(item):
            before = chunk_of(runs[-1][-1])
            if before.start + before.length == chunk_of(item).start:
                runs[-1].append(item)
                continue
        runs.append([item])
    return runs


def run_reads(jobs: list[ReadJob], pool: cf.ThreadPoolExecutor | None,
              cached: bool = False) -> None:
    """Run reads file by file, each file's in offset order (sequential reads, which the
    kernel's readahead serves best), files in parallel on ``pool``.

    ``cached``: the bytes are in memory (the page cache, after the verify pass read them, or
    the memory tier's shared memory), so a read is a memory copy, bound by the CPU rather
    than the disk: where there are more cores than files, each file's reads are cut into as
    many runs (contiguous, each in offset order) as there are cores per file, read in
    parallel.

    After a failure no further read starts, and the error is raised only once every read
    already running has returned, so nothing changes behind the caller's back.
    """
    by_file: dict[str, list[ReadJob]] = {}
    for job in jobs:
        by_file.setdefault(job[0], []).append(job)
    runs = [sorted(file_jobs, key=lambda j: j[1]) for file_jobs in by_file.values()]
    if cached and pool is not None and runs:
        runs = [part for run in runs for part in _cut(run, _cores() // len(runs))]
    stop = threading.Event()

    def read_file(file_jobs: list[ReadJob]) -> None:
        for _, _, read in file_jobs:
            if stop.is_set():
                return
            try:
                read()
            except BaseException:
                stop.set()
                raise

    if pool is None or len(runs) < 2:
        for file_jobs in runs:
            read_file(file_jobs)
        return
    futures = [pool.submit(read_file, f) for f in runs]
    cf.wait(futures)
    for future in futures:
        future.result()


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cut(run: list, parts: int) -> list[list]:
    """``run`` (one file's reads in offset order) cut into at most ``parts`` contiguous runs
    of about as many reads each."""
    parts = max(1, min(parts, len(run)))
    size = -(-len(run) // parts)
    return [run[i:i + size] for i in range(0, len(run), size)]
