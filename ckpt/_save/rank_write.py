"""Writing one rank's share of a step into the staging location: chunks, digests, files, its table.

Chunks unchanged since an incremental save's base are reused, not written. Digests and
compression run on the writer's pool; compressed files go through a pipeline that writes one
file while the next is compressed. Nothing here is committed: see :mod:`ckpt._save.commit`.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import logging
from typing import Any, Callable

from storage_backends import Storage
from storage_backends.faults import fault_point

from ckpt._format.datafile import ALIGN, Piece, encode_header
from ckpt._format.entries import Chunk
from ckpt._format.ranktable import encode_table, table_name
from ckpt._shared.progress import ByteCounter
from ckpt._save.payload import RankTable, StepPayload
from ckpt._save.chunking import ChunkPlan, assign_files, chunk_tensor, data_file_name
from ckpt._shared.buffers import byte_view
from ckpt._shared.sharding import overlapping
from ckpt._format.digest import digest
from ckpt.errors import CheckpointError
from ckpt.options import SaveOptions

log = logging.getLogger("ckpt")


def _plan(payload: StepPayload, options: SaveOptions) -> tuple[list, list]:
    """Cut this rank's boxes into chunks; reuse unchanged ones, return the rest.

    An incremental save digests every chunk here that its base may hold (the digests decide
    what is reused); the others' digests (None) are left to the threads that write the files.
    A digest the memory tier took of the same staged bytes (``payload.digests``) is used as
    it is: nothing is digested twice.
    """
    reused, to_write = [], []
    known = payload.digests
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
            d = known.get((key, c.byte_start, c.byte_length))
            if not previous:  # nothing to reuse: the file writers digest, in parallel
                to_write.append((dataclasses.replace(c, offsets=box), data, d))
                continue
            d = digest(data) if d is None else d
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
               pool: cf.ThreadPoolExecutor | None,
               progress: ByteCounter | None = None, threads: int | None = None) -> RankTable:
    """Write this rank's new chunks into ``staging``; returns its table (nothing committed).
    ``progress`` counts the chunks' bytes (before compression) as their files are written;
    ``threads`` (at most the pool's size; default ``options.write_threads``) files are
    written at once."""
    threads = options.write_threads if threads is None else threads
    fault_point("before_data")
    encode = _encoder() if options.compression else None
    reused, to_write = _plan(payload, options)
    new_bytes = sum(len(data) for _, data, _ in to_write)
    if progress is not None:
        progress.total = new_bytes
    # Compressed: several files per thread, so one file's write overlaps the next's compression.
    per_thread = 4 if options.compression else 1
    n_files = max(threads * per_thread, -(-new_bytes // options.max_file_bytes))
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
        if progress is not None:
            progress.add(sum(len(data_of[(c.key, c.index)][0]) for c, _, _, _ in encoded))
        records, start = [], len(header)
        for (c, d, codec, _), piece in zip(encoded, pieces):
            records.append((c.key, Chunk(c.offsets, c.shape, name, start, len(piece.data), d,
                                         codec)))
            start += len(piece.data)
        return name, size, records

    if options.compression:
        results = _pipeline(groups, encode_chunk, write_file, pool if threads > 1 else None,
                            threads)
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
