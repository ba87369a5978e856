"""Staging to host memory and the background writer: the only module that starts threads.

A save has two halves. :meth:`Stager.stage` runs on the caller's thread and copies every
tensor into host buffers that are allocated once and reused (pinned, with non-blocking copies
on a side stream, when the tensors are on a GPU). :func:`write_step` then does everything else
(digests, data files, fsync, commit) and runs on a background thread for an async save.
No collectives run here, so a background save never races the training loop's own.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import logging
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from storage_backends import Storage
from storage_backends.faults import fault_point

from ckpt._format.datafile import ALIGN, Piece, encode_header
from ckpt.errors import CheckpointError, StorageError
from ckpt._format.manifest import (FORMAT_VERSION_TABLES, MANIFEST_NAME, PER_RANK_IN_TABLES, Chunk, Manifest,
                     TensorEntry, chunk_doc)
from ckpt._shared.distributed import Group
from ckpt._step.incremental import CHAIN_KEY, chain_length
from ckpt._step.integrity import digest
from ckpt.options import SaveOptions
from ckpt._save.plan import ChunkPlan, assign_files, chunk_tensor, data_file_name
from ckpt._format.ranktable import encode_table, table_name
from ckpt._shared.sharding import overlapping

log = logging.getLogger("ckpt")


def _optimizer_storages(optimizers: Sequence[torch.optim.Optimizer]) -> set[int]:
    """Storage addresses of every CUDA tensor that only these optimizers' step changes."""
    out = set()
    for opt in optimizers:
        for group in opt.param_groups:
            out.update(_storage_ptr(p) for p in group["params"] if p.is_cuda)
        for per_param in opt.state.values():
            out.update(_storage_ptr(v) for v in per_param.values()
                       if isinstance(v, torch.Tensor) and v.is_cuda)
    return out


def _storage_ptr(t: torch.Tensor) -> int:
    """Where a tensor's memory starts (a DTensor's: its local shard's)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.untyped_storage().data_ptr()


def _wait_before_step(stager_ref: Callable[[], Stager | None]) -> Callable:
    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        stager = stager_ref()
        if stager is not None:
            stager.await_copies()
    return hook


_STAGERS: weakref.WeakSet = weakref.WeakSet()  # every live Stager (for await_device_copies)


def await_device_copies() -> None:
    """Make training's streams wait for every save's device-to-host copies still in flight
    that only an optimizer step waits for: for code about to change those tensors in place
    otherwise (a load into them, before the next step)."""
    for stager in list(_STAGERS):
        stager.await_copies()


class _Ready:
    """The end of a save's device-to-host copies: one event per device copied from."""

    def __init__(self, events: list) -> None:
        self.events = events

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()


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

    def exception(self) -> BaseException | None:
        """The writer's error once done (None while running or on success); not raising."""
        return self._future.exception() if self._future.done() else None

    def add_done_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        """Call ``fn(handle)`` when the save finishes (on the writer thread)."""
        self._future.add_done_callback(lambda _: fn(self))


def _record(stream: Any) -> Any:
    event = torch.cuda.Event()
    event.record(stream)
    return event


class Stager:
    """Host buffers reused across saves (one set: at most one save is in flight).

    CUDA tensors are copied on a side stream into pinned buffers. Training's stream waits
    only for the copies of tensors a forward pass may change (batch-norm statistics and
    anything else not guarded); the copies of tensors that only ``optimizer.step()`` changes
    (the parameters and the state of the optimizers passed as ``guards``) run during the
    next forward and backward, and each guard's step pre-hook makes its stream wait for them.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._streams: dict[torch.device, Any] = {}  # one side stream per device
        # per device: the event the guarded optimizers' next step waits for
        self._pending: dict[torch.device, Any] = {}
        self._hooked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        _STAGERS.add(self)

    def release_buffers(self) -> None:
        """Let the host buffers go (no save may be in flight)."""
        self._buffers.clear()

    def stage(self, tensors: dict[str, torch.Tensor], copy: bool,
              guards: Sequence[torch.optim.Optimizer] = ()
              ) -> tuple[dict[str, torch.Tensor], _Ready | None]:
        """Host-memory, contiguous copies of ``tensors``, and what to ``synchronize()`` on
        before reading them (CUDA) or None.

        With ``copy=False`` (a synchronous save: training waits anyway) CPU tensors that are
        already contiguous are used as they are.
        """
        staged: dict[str, torch.Tensor] = {}
        cuda_sources: list = []
        guarded = _optimizer_storages(guards) if guards else set()
        deferred: list = []
        for key, t in tensors.items():
            if not copy and t.device.type == "cpu":
                # resolve_*: a lazy conjugate/negative view has no plain bytes of its own
                staged[key] = t.resolve_conj().resolve_neg().contiguous()
                continue
            buf = self._buffers.get(key)
            pin = t.device.type == "cuda"
            if (buf is None or buf.shape != t.shape or buf.dtype != t.dtype
                    or (pin and not buf.is_pinned())):
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
                self._buffers[key] = buf
            if t.device.type == "cuda":
                later = t.numel() and _storage_ptr(t) in guarded
                (deferred if later else cuda_sources).append((buf, t))
            else:
                buf.copy_(t)
            staged[key] = buf
        for key in list(self._buffers):
            if key not in tensors:
                del self._buffers[key]
        return staged, self._copy_from_cuda(cuda_sources, deferred, guards)

    def _copy_from_cuda(self, first: list, deferred: list,
                        guards: Sequence[torch.optim.Optimizer]) -> _Ready | None:
        """Issue the copies of ``first`` (awaited by training's stream at once) and of
        ``deferred`` (awaited by the guards' next step), per device on its side stream."""
        self._pending = {}
        if not first and not deferred:
            return None
        events = []
        for device in dict.fromkeys(t.device for _, t in first + deferred):
            now = [(b, t) for b, t in first if t.device == device]
            later = [(b, t) for b, t in deferred if t.device == device]
            events.append(self._copy_on(device, now, later))
        if deferred:
            for optimizer in guards:
                if optimizer not in self._hooked:
                    self._hooked[optimizer] = optimizer.register_step_pre_hook(
                        _wait_before_step(weakref.ref(self)))
        return _Ready(events)

    def _copy_on(self, device: torch.device, now: list, later: list) -> Any:
        # A copy runs on the current stream of its tensor's device: the side stream and the
        # training stream are those of the tensors' device, not of the current device (a
        # model put on cuda:1 without torch.cuda.set_device).
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        main = torch.cuda.current_stream(device)
        stream.wait_stream(main)  # copy what training has computed so far
        with torch.cuda.stream(stream):
            for buf, t in now:
                buf.copy_(t, non_blocking=True)
                t.record_stream(stream)  # keep t's memory alive until the copy ran
            if now:
                # training's later in-place updates of these (a forward pass) wait for them
                main.wait_event(_record(stream))
            for buf, t in later:
                buf.copy_(t, non_blocking=True)
                t.record_stream(stream)
        event = _record(stream)
        if later:
            self._pending[device] = event
        return event

    def await_copies(self) -> None:
        """Training's streams wait (on the GPU) for the copies the guards' step waits for;
        the CPU does not."""
        for device, event in self._pending.items():
            torch.cuda.current_stream(device).wait_event(event)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


@dataclass
class StepPayload:
    """Everything the background writer needs, decoupled from the live training state.

    ``pieces`` maps each key this rank writes to (global offsets, staged local box).
    ``tensors`` (global dtype and shape of every tensor), ``items`` and ``aliases`` matter
    on the coordinator only. ``previous``: the base manifest of an incremental save.
    """

    step: int
    name: str
    pieces: dict[str, tuple[tuple[int, ...], torch.Tensor]]
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    items: dict[str, dict]
    aliases: dict[str, str]
    ready: object = None
    metadata: dict | None = None
    previous: Manifest | None = None
    rank: int = 0
    world_size: int = 1
    # Unique to this save attempt (shared by its ranks): names its staging location and files,
    # so a retried or concurrent attempt never overwrites another's objects.
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # Boxes this rank holds but another rank writes (a replicated tensor's copy): staged only
    # for the memory tier, which keeps everything a rank holds so that it restores alone.
    held: dict[str, tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=dict)
    # Format 2 (rank tables): each tensor's layout (ckpt._format.layout); None writes format 1.
    layouts: dict | None = None


@dataclass
class RankTable:
    """What one rank wrote: its files and the chunk records of its boxes (JSON-able)."""

    files: dict[str, int] = field(default_factory=dict)
    chunks: list[tuple[str, Chunk]] = field(default_factory=list)
    bytes_written: int = 0
    bytes_reused: int = 0

    def to_json(self) -> dict:
        return {"files": self.files, "written": self.bytes_written, "reused": self.bytes_reused,
                "chunks": [[k, chunk_doc(c)] for k, c in self.chunks]}

    @classmethod
    def from_json(cls, doc: dict) -> RankTable:
        chunks = [(k, Chunk(**{**c, "offsets": tuple(c["offsets"]), "shape": tuple(c["shape"])}))
                  for k, c in doc["chunks"]]
        return cls(doc["files"], chunks, doc["written"], doc["reused"])


def _plan(payload: StepPayload, options: SaveOptions) -> tuple[list, list]:
    """Cut this rank's boxes into chunks; reuse unchanged ones, return the rest.

    An incremental save digests every chunk here that its base may hold (the digests decide
    what is reused); the others' digests (None) are left to the threads that write the files.
    """
    reused, to_write = [], []
    for key, (offsets, t) in payload.pieces.items():
        previous = {}
        if payload.previous is not None and _same_layout(payload, key):
            # only the base's chunks inside this rank's box (a format-2 base: its tables of
            # the ranks that wrote them, usually this rank's own)
            try:
                previous = {(key, c.offsets, c.shape): c for c, _ in overlapping(
                    payload.previous.tensors[key], (offsets, tuple(t.shape)))}
            except CheckpointError as e:  # a damaged base table: write these chunks anew
                log.warning("incremental save of %s reuses nothing: %s", key, e)
        view = byte_view(t)
        for c in chunk_tensor(key, tuple(t.shape), t.element_size(), options.chunk_bytes):
            box = tuple(o + b for o, b in zip(offsets, c.offsets))
            data = view[c.byte_start:c.byte_start + c.byte_length]
            if not previous:  # nothing to reuse: the file writers digest, in parallel
                to_write.append((dataclasses.replace(c, offsets=box), data, None))
                continue
            d = digest(data)
            old = previous.get((key, box, c.shape))
            if old is not None and old.digest == d:
                step = payload.previous.step if old.step is None else old.step
                reused.append((key, dataclasses.replace(old, step=step)))
            else:
                to_write.append((dataclasses.replace(c, offsets=box), data, d))
    return reused, to_write


def _same_layout(payload: StepPayload, key: str) -> bool:
    old = payload.previous.tensors.get(key)
    dtype, shape = payload.tensors[key]
    return old is not None and old.dtype == dtype and old.shape == shape


def _encoder() -> Callable:
    """:func:`ckpt._format.codec.encode`, imported only when a save compresses: zstandard is an
    optional dependency (GPU images often lack it), and nothing else needs it."""
    try:
        from ckpt._format.codec import encode
    except ImportError as e:
        raise CheckpointError(f"compression='zstd' needs the zstandard package ({e}); "
                              "install it (pip install zstandard) or save uncompressed "
                              "(SaveOptions(compression=None))") from e
    return encode


def write_rank(storage: Storage, staging: str, payload: StepPayload, options: SaveOptions,
               pool: cf.ThreadPoolExecutor | None) -> RankTable:
    """Write this rank's new chunks into ``staging``; returns its table (nothing committed)."""
    fault_point("before_data")
    encode = _encoder() if options.compression else None
    reused, to_write = _plan(payload, options)
    new_bytes = sum(len(data) for _, data, _ in to_write)
    # Compressed: several files per thread, so one file's write overlaps the next's compression.
    per_thread = 4 if options.compression else 1
    n_files = max(options.write_threads * per_thread, -(-new_bytes // options.max_file_bytes))
    groups = assign_files([c for c, _, _ in to_write], n_files) if to_write else []
    data_of = {(c.key, c.index): (data, d) for c, data, d in to_write}

    def encode_chunk(c: ChunkPlan) -> tuple[ChunkPlan, str, str, Any]:
        """(plan, digest, codec, stored bytes) of one chunk."""
        data, d = data_of[(c.key, c.index)]
        d = digest(data) if d is None else d
        if not options.compression:
            return c, d, "raw", data
        dtype = payload.pieces[c.key][1].dtype
        return (c, d, *encode(data, dtype, options.compression_level,
                              options.compression_threads))

    def write_file(index: int, encoded: list) -> tuple[str, int, list]:
        name = data_file_name(payload.token, payload.rank, index)
        # Pieces of whole cache lines first: each then starts 64-byte aligned in the file, as
        # its destination is in memory (see ALIGN); one odd-sized piece would shift all after it.
        encoded = sorted(encoded, key=lambda e: len(e[3]) % ALIGN != 0)
        pieces = [Piece(f"{c.key}#{list(c.offsets)}", memoryview(stored),
                        payload.pieces[c.key][1].dtype, c.shape, stored_raw=codec == "raw")
                  for c, _, codec, stored in encoded]
        header = encode_header(pieces)
        size = storage.write(f"{staging}/{name}", [header, *(p.data for p in pieces)])
        fault_point("after_file")
        records, start = [], len(header)
        for (c, d, codec, _), piece in zip(encoded, pieces):
            records.append((c.key, Chunk(c.offsets, c.shape, name, start, len(piece.data), d,
                                         codec)))
            start += len(piece.data)
        return name, size, records

    if options.compression:
        results = _pipeline(groups, encode_chunk, write_file, pool, options.write_threads)
    else:
        def raw_file(index: int) -> tuple[str, int, list]:
            return write_file(index, [encode_chunk(c) for c in groups[index]])

        indices = range(len(groups))
        results = list(pool.map(raw_file, indices)) if pool and len(groups) > 1 else [
            raw_file(i) for i in indices]
    table = RankTable(bytes_reused=sum(c.length for _, c in reused))
    table.chunks.extend(reused)
    for name, size, records in results:
        table.files[name] = size
        table.bytes_written += size
        table.chunks.extend(records)
    return table


def _pipeline(groups: list[list[ChunkPlan]], encode_chunk: Callable, write_file: Callable,
              pool: cf.ThreadPoolExecutor | None, writers: int) -> list:
    """Compress chunk by chunk on ``pool`` (or on this thread), file after file, and hand
    each file to one of ``writers`` I/O threads as soon as its chunks are ready: the storage
    writes files while the cores compress the next ones (a file's header holds its
    compressed lengths, so a file goes out whole). In flight at once: at most ``writers``
    files being written and ``writers`` files being compressed (the pool's size)."""
    ahead = writers if pool is not None else 1
    compressing: collections.deque = collections.deque()  # per file: futures (or plans)
    writing: collections.deque = collections.deque()
    results: list = []
    started = 0

    def compress_next() -> None:
        nonlocal started
        if started < len(groups):
            group = groups[started]
            compressing.append([pool.submit(encode_chunk, c) for c in group]
                               if pool is not None else group)
            started += 1

    with cf.ThreadPoolExecutor(writers, thread_name_prefix="ckpt-put") as io:
        try:
            for _ in range(ahead):
                compress_next()
            for index in range(len(groups)):
                encoded = [f.result() if pool is not None else encode_chunk(f)
                           for f in compressing.popleft()]
                if len(writing) >= writers:
                    results.append(writing.popleft().result())
                writing.append(io.submit(write_file, index, encoded))
                compress_next()
            results += [f.result() for f in writing]
        except BaseException:
            for f in (f for group in compressing for f in group):
                if isinstance(f, cf.Future):
                    f.cancel()
            raise
    return results


def build_manifest(payload: StepPayload, tables: list[RankTable]) -> Manifest:
    """The coordinator's merge of every rank's table into the step's manifest (format 1)."""
    chunks: dict[str, list[Chunk]] = {k: [] for k in payload.tensors}
    files: dict[str, int] = {}
    for table in tables:
        files.update(table.files)
        for key, chunk in table.chunks:
            chunks[key].append(chunk)
    tensors = {key: TensorEntry(dtype, shape, tuple(sorted(chunks[key], key=lambda c: c.offsets)))
               for key, (dtype, shape) in payload.tensors.items()}
    return Manifest(step=payload.step, world_size=payload.world_size, created=time.time(),
                    tensors=tensors, aliases=payload.aliases, items=payload.items, files=files,
                    metadata=_metadata(payload))


def _metadata(payload: StepPayload) -> dict:
    metadata = dict(payload.metadata or {})
    metadata[CHAIN_KEY] = chain_length(payload.previous) + 1 if payload.previous else 0
    return metadata


def table_file(payload: StepPayload, table: RankTable) -> tuple[str, bytes, dict]:
    """Format 2: this rank's chunk table (file name and bytes) and what the rank reports in
    the commit vote (a few hundred bytes, whatever its chunk count)."""
    values = {name: item["per_rank"][str(payload.rank)] for name, item in payload.items.items()
              if "per_rank" in item}  # this rank's trees of per-rank items
    raw = encode_table(payload.step, payload.rank, table.chunks, values)
    name = table_name(payload.token, payload.rank)
    refs: dict[str, dict[str, int]] = {}
    for _, c in table.chunks:
        if c.step is not None:
            need = refs.setdefault(str(c.step), {})
            need[c.file] = max(need.get(c.file, 0), c.start + c.length)
    return name, raw, {"table": [name, len(raw), digest(raw)], "files": table.files,
                       "refs": refs, "written": table.bytes_written,
                       "reused": table.bytes_reused}


def write_table(storage: Storage, staging: str, payload: StepPayload, table: RankTable) -> dict:
    """Write this rank's chunk table next to its data files; returns its vote report."""
    name, raw, report = table_file(payload, table)
    storage.write(f"{staging}/{name}", [raw])
    return report


def build_top_manifest(payload: StepPayload, reports: list[dict]) -> Manifest:
    """The coordinator's format-2 manifest: layouts, tables and files; O(tensors + ranks)."""
    files: dict[str, int] = {}
    refs: dict[tuple[int, str], int] = {}
    for report in reports:
        files.update(report["files"])
        for step, names in report["refs"].items():
            for name, size in names.items():
                refs[(int(step), name)] = max(refs.get((int(step), name), 0), size)
    tensors = {key: TensorEntry(dtype, shape, None, payload.layouts[key])
               for key, (dtype, shape) in payload.tensors.items()}
    # Per-rank values (RNG states) lie in their ranks' tables: the manifest stays small.
    items = {name: {"kind": item["kind"], "per_rank": PER_RANK_IN_TABLES} if "per_rank" in item
             else item for name, item in payload.items.items()}
    return Manifest(step=payload.step, world_size=payload.world_size, created=time.time(),
                    tensors=tensors, aliases=payload.aliases, items=items, files=files,
                    metadata=_metadata(payload), format_version=FORMAT_VERSION_TABLES,
                    tables=[tuple(r["table"]) for r in reports], refs=refs)


def commit_step(storage: Storage, staging: str, payload: StepPayload,
                tables: list[RankTable] | None = None,
                reports: list[dict] | None = None) -> Manifest:
    """Coordinator: write the manifest and publish the step (the commit point). Format 1
    merges the ranks' ``tables``; format 2 lists the ranks' ``reports``."""
    if reports is not None:
        manifest = build_top_manifest(payload, reports)
    else:
        manifest = build_manifest(payload, tables or [])
    fault_point("before_commit")
    storage.commit(staging, payload.name, manifest.to_json(), MANIFEST_NAME)
    fault_point("after_commit")
    # The step's rank tables now lie in its directory: later incremental saves read them.
    return manifest.bind(lambda name: storage.read(f"{payload.name}/{name}"),
                         f"{storage.url}/{payload.name}")


def _abort(storage: Storage, staging: str) -> None:
    try:
        storage.abort(staging)
    except Exception:  # the original error matters more; leftovers are cleaned later
        log.warning("could not remove staging location %s", staging, exc_info=True)


class BackgroundWriter:
    """One writer thread (saves run one at a time) plus a pool for the files of one save."""

    def __init__(self, options: SaveOptions, group: Group | None = None,
                 commit_timeout: float = 600.0) -> None:
        self.options = options
        self.group = group or Group()
        self.commit_timeout = commit_timeout
        self._thread = cf.ThreadPoolExecutor(1, thread_name_prefix="ckpt-writer")
        self._pool = (cf.ThreadPoolExecutor(options.write_threads, thread_name_prefix="ckpt-io")
                      if options.write_threads > 1 else None)

    def _run(self, storage: Storage, payload: StepPayload) -> tuple[Manifest | None, RankTable]:
        if payload.ready is not None:
            payload.ready.synchronize()
        staging = storage.begin(payload.name, payload.token)
        group = self.group
        tables = payload.layouts is not None
        if not group.enabled:
            try:
                table = write_rank(storage, staging, payload, self.options, self._pool)
                if tables:
                    report = write_table(storage, staging, payload, table)
                    return commit_step(storage, staging, payload, reports=[report]), table
                return commit_step(storage, staging, payload, [table]), table
            except BaseException:
                _abort(storage, staging)
                raise
        # Two-phase commit: every rank reports its table (or its error) through the store;
        # the coordinator commits only if all ranks succeeded, then announces the outcome.
        me = f"{payload.token}/rank{group.rank}"
        try:
            table = write_rank(storage, staging, payload, self.options, self._pool)
            group.publish(me, {"ok": write_table(storage, staging, payload, table) if tables
                               else table.to_json()})
        except BaseException as e:
            group.publish(me, {"error": f"rank {group.rank}: {e}"})
            raise
        outcome = f"{payload.token}/outcome"
        if not group.is_coordinator:
            result = group.collect([outcome], self.commit_timeout + 30)[0]
            if "error" in result:
                raise CheckpointError(f"step {payload.step} was not committed: {result['error']}")
            return None, table
        keys = [f"{payload.token}/rank{r}" for r in range(group.world_size)]
        try:
            reports = group.collect(keys, self.commit_timeout)
            errors = [r["error"] for r in reports if "error" in r]
            if errors:
                raise CheckpointError("; ".join(errors))
            if tables:
                manifest = commit_step(storage, staging, payload,
                                       reports=[r["ok"] for r in reports])
            else:
                manifest = commit_step(storage, staging, payload,
                                       [RankTable.from_json(r["ok"]) for r in reports])
        except BaseException as e:
            _abort(storage, staging)
            group.publish(outcome, {"error": str(e)})
            raise
        group.publish(outcome, {"ok": True})
        group.forget(keys)
        return manifest, table

    def submit(self, storage: Storage, payload: StepPayload, blocking_seconds: float,
               after_commit: Callable[[Manifest | None], None] | None = None) -> SaveHandle:
        def job() -> SaveResult:
            t0 = time.perf_counter()
            try:
                manifest, table = self._run(storage, payload)
            except CheckpointError:
                raise
            except Exception as e:
                raise StorageError(
                    f"saving step {payload.step} to {storage.url} failed: {e}; nothing was "
                    "committed and earlier steps are intact", path=storage.url) from e
            if after_commit is not None:
                after_commit(manifest)
            return SaveResult(payload.step, f"{storage.url}/{payload.name}", table.bytes_written,
                              table.bytes_reused, len(table.files), blocking_seconds,
                              time.perf_counter() - t0)

        return SaveHandle(payload.step, self._thread.submit(job), blocking_seconds)

    def submit_call(self, step: int, blocking_seconds: float,
                    fn: Callable[[cf.ThreadPoolExecutor | None], SaveResult]) -> SaveHandle:
        """Run ``fn(pool)`` on the writer thread after the saves queued before it (the memory
        tier's per-rank publish, which needs no commit vote)."""
        return SaveHandle(step, self._thread.submit(fn, self._pool), blocking_seconds)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
