"""Staging to host memory and the background writer: the only module that starts threads.

A save has two halves. :meth:`Stager.stage` runs on the caller's thread and copies every
tensor into host buffers that are allocated once and reused (pinned, with non-blocking copies
on a side stream, when the tensors are on a GPU). :func:`write_step` then does everything else
(digests, data files, fsync, commit) and runs on a background thread for an async save.
No collectives run here, so a background save never races the training loop's own.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch

from storage_backends import Storage
from storage_backends.faults import fault_point

from .codec import encode
from .datafile import Piece, encode_header
from .errors import CheckpointError, StorageError
from .format import MANIFEST_NAME, Chunk, Manifest, TensorEntry, dtype_name
from .incremental import CHAIN_KEY, chain_length, reusable_chunk
from .integrity import digest
from .options import SaveOptions
from .plan import assign_files, chunk_tensor
from .state import FlatState

log = logging.getLogger("ckpt")


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass(frozen=True)
class SaveResult:
    """What one committed save wrote."""

    step: int
    location: str
    bytes_written: int
    bytes_reused: int
    files: int
    blocking_seconds: float
    write_seconds: float


class SaveHandle:
    """A save in flight: ``done()``, ``wait(timeout)`` and ``result(timeout)``.

    ``wait`` and ``result`` return the :class:`SaveResult`, or raise the writer's error
    (a :class:`CheckpointError` with the original chained as ``__cause__``).
    """

    def __init__(self, step: int, future: cf.Future, blocking_seconds: float) -> None:
        self.step = step
        self.blocking_seconds = blocking_seconds
        self._future = future
        self.error_reported = False

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SaveResult:
        try:
            return self._future.result(timeout)
        except cf.TimeoutError:
            raise TimeoutError(f"the save of step {self.step} is still running") from None
        except BaseException:
            self.error_reported = True
            raise

    result = wait

    def failed(self) -> bool:
        return self._future.done() and self._future.exception() is not None


class Stager:
    """Host buffers reused across saves (one set: at most one save is in flight)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._stream = None

    def stage(self, tensors: dict[str, torch.Tensor], copy: bool) -> tuple[dict[str, torch.Tensor], object]:
        """Host-memory, contiguous copies of ``tensors`` and an event to wait on (CUDA) or None.

        With ``copy=False`` (a synchronous save: training waits anyway) CPU tensors that are
        already contiguous are used as they are.
        """
        staged: dict[str, torch.Tensor] = {}
        cuda_sources = []
        for key, t in tensors.items():
            if not copy and t.device.type == "cpu":
                staged[key] = t.contiguous()
                continue
            buf = self._buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                pin = t.device.type == "cuda"
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
                self._buffers[key] = buf
            if t.device.type == "cuda":
                cuda_sources.append((buf, t))
            else:
                buf.copy_(t)
            staged[key] = buf
        for key in list(self._buffers):
            if key not in tensors:
                del self._buffers[key]
        return staged, self._copy_from_cuda(cuda_sources)

    def _copy_from_cuda(self, pairs: list) -> object:
        if not pairs:
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        main = torch.cuda.current_stream()
        self._stream.wait_stream(main)  # copy what training has computed so far
        with torch.cuda.stream(self._stream):
            for buf, t in pairs:
                buf.copy_(t, non_blocking=True)
                t.record_stream(self._stream)  # keep t's memory alive until the copy ran
        event = torch.cuda.Event()
        event.record(self._stream)
        main.wait_stream(self._stream)  # later in-place updates wait for the copy, not the CPU
        return event

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


@dataclass
class StepPayload:
    """Everything the background writer needs, decoupled from the live training state.

    ``previous``: the newest committed manifest, for an incremental save (None: full save).
    """

    step: int
    name: str
    tensors: dict[str, torch.Tensor]
    flat: FlatState
    ready: object = None
    metadata: dict | None = None
    previous: Manifest | None = None
    rank: int = 0
    world_size: int = 1
    # Unique to this save attempt (shared by its ranks): names its staging location and files,
    # so a retried or concurrent attempt never overwrites another's objects.
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:12])


@dataclass
class WriteStats:
    bytes_written: int = 0
    bytes_reused: int = 0
    files: int = 0


def _plan(payload: StepPayload, options: SaveOptions) -> tuple[dict[str, list], list]:
    """Digest every chunk; keep references to unchanged ones, return the ones to write."""
    chunks: dict[str, list] = {}
    to_write = []
    for key, t in payload.tensors.items():
        view = byte_view(t)
        name = dtype_name(t.dtype)
        chunks[key] = []
        for c in chunk_tensor(key, tuple(t.shape), t.element_size(), options.chunk_bytes):
            data = view[c.byte_start:c.byte_start + c.byte_length]
            d = digest(data)
            reused = reusable_chunk(payload.previous, key, name, tuple(t.shape), c.index,
                                    c.offsets, c.shape, d)
            chunks[key].append(reused)
            if reused is None:
                to_write.append((c, data, d))
    return chunks, to_write


def write_step(storage: Storage, payload: StepPayload, options: SaveOptions,
               pool: cf.ThreadPoolExecutor | None) -> tuple[Manifest, WriteStats]:
    """Write and commit one step; returns its manifest and what was written.

    On any failure the staging location is removed and nothing is committed.
    """
    if payload.ready is not None:
        payload.ready.synchronize()
    staging = storage.begin(payload.name, payload.token)
    stats = WriteStats()
    try:
        fault_point("before_data")
        chunks, to_write = _plan(payload, options)
        new_bytes = sum(len(data) for _, data, _ in to_write)
        n_files = max(options.write_threads, -(-new_bytes // options.max_file_bytes))
        groups = assign_files([c for c, _, _ in to_write], n_files)
        data_of = {(c.key, c.index): (data, d) for c, data, d in to_write}

        def write_file(index: int) -> tuple[str, int, list[tuple]]:
            name = f"data-{payload.token}-r{payload.rank:05d}-{index:03d}.safetensors"
            pieces, meta = [], []
            for c in groups[index]:
                data, d = data_of[(c.key, c.index)]
                dtype = payload.tensors[c.key].dtype
                codec, stored = "raw", data
                if options.compression:
                    codec, stored = encode(data, dtype, options.compression_level)
                pieces.append(Piece(f"{c.key}#{c.index}", memoryview(stored), dtype, c.shape,
                                    stored_raw=codec == "raw"))
                meta.append((c, d, codec, len(stored)))
            header = encode_header(pieces)
            size = storage.write(f"{staging}/{name}", [header, *(p.data for p in pieces)])
            fault_point("after_file")
            records, start = [], len(header)
            for c, d, codec, length in meta:
                records.append((c, Chunk(c.offsets, c.shape, name, start, length, d, codec)))
                start += length
            return name, size, records

        indices = range(len(groups)) if to_write else []
        results = list(pool.map(write_file, indices)) if pool and len(groups) > 1 else [
            write_file(i) for i in indices]
        for _, _, records in results:
            for plan, chunk in records:
                chunks[plan.key][plan.index] = chunk
        tensors = {
            key: TensorEntry(dtype_name(t.dtype), tuple(t.shape), tuple(chunks[key]))
            for key, t in payload.tensors.items()
        }
        metadata = dict(payload.metadata or {})
        metadata[CHAIN_KEY] = chain_length(payload.previous) + 1 if payload.previous else 0
        manifest = Manifest(
            step=payload.step, world_size=payload.world_size, created=time.time(),
            tensors=tensors, aliases=payload.flat.aliases, items=payload.flat.items,
            files={name: size for name, size, _ in results}, metadata=metadata)
        fault_point("before_commit")
        raw = manifest.to_json()
        storage.commit(staging, payload.name, raw, MANIFEST_NAME)
        fault_point("after_commit")
    except BaseException:
        try:
            storage.abort(staging)
        except Exception:  # the original error matters more; leftovers are cleaned later
            log.warning("could not remove staging location %s", staging, exc_info=True)
        raise
    stats.bytes_written = sum(size for _, size, _ in results) + len(raw)
    stats.bytes_reused = sum(c.length for e in tensors.values() for c in e.chunks
                             if c.step is not None)
    stats.files = len(results) + 1
    return manifest, stats


class BackgroundWriter:
    """One writer thread (saves run one at a time) plus a pool for the files of one save."""

    def __init__(self, options: SaveOptions) -> None:
        self.options = options
        self._thread = cf.ThreadPoolExecutor(1, thread_name_prefix="ckpt-writer")
        self._pool = (cf.ThreadPoolExecutor(options.write_threads, thread_name_prefix="ckpt-io")
                      if options.write_threads > 1 else None)

    def submit(self, storage: Storage, payload: StepPayload, blocking_seconds: float,
               after_commit: Callable[[Manifest], None] | None = None) -> SaveHandle:
        def job() -> SaveResult:
            t0 = time.perf_counter()
            try:
                manifest, stats = write_step(storage, payload, self.options, self._pool)
            except CheckpointError:
                raise
            except Exception as e:
                raise StorageError(
                    f"saving step {payload.step} to {storage.url} failed: {e}; nothing was "
                    "committed and earlier steps are intact", path=storage.url) from e
            if after_commit is not None:
                after_commit(manifest)
            return SaveResult(payload.step, f"{storage.url}/{payload.name}", stats.bytes_written,
                              stats.bytes_reused, stats.files, blocking_seconds,
                              time.perf_counter() - t0)

        return SaveHandle(payload.step, self._thread.submit(job), blocking_seconds)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
