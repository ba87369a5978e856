"""Per-rank chunk tables (format version 2): what one rank wrote, as one compact binary file.

Layout of a table file (all integers little-endian)::

    b"CKPTRT02"                   magic
    u64 header length H
    H bytes of JSON               {"step", "rank", "keys": [...], "files": [...], "dims", "rows"}
    padding to a multiple of 8
    rows x record                 a packed numpy structured array (RECORD_FIELDS)

A record is one chunk: the index of its tensor in ``keys``, of its file in ``files``, its codec
(index in ``format.CODECS``), the earlier step holding its file (-1: this step), the byte
range, the xxh3-64 digest of its raw bytes, and its box (``dims`` offsets and sizes, padded
with 0 and 1 past the tensor's own dimensions).

The top-level manifest records each table's size and digest, so a table is checked against
both before it is parsed; then every record is validated against the manifest as numpy
operations over whole columns (boxes inside their tensor, lengths, files and byte ranges),
and the rows of each tensor must tile exactly the boxes the manifest's layout says this rank
wrote (the corner identity of format._check_tiling, vectorized). All of it is linear in the
table's size, before any chunk is handed out.
"""

from __future__ import annotations

import bisect
import json
import math
import struct
import threading
from typing import Callable

import numpy as np

from .format import (CODECS, DTYPES, MAX_BYTES, MAX_DIMS, MAX_TILING_CORNERS, MAX_ZSTD_RATIO,
                     Chunk, Invalid, file_name)
from .errors import CorruptCheckpointError
from .integrity import digest as content_digest
from .layout import Box, cells_overlapping, written_by
from .sharding import intersect

MAGIC = b"CKPTRT02"
MAX_TABLE_BYTES = 1 << 30
MAX_HEADER_BYTES = 64 << 20


def record_dtype(dims: int) -> np.dtype:
    return np.dtype([("tensor", "<u4"), ("file", "<u4"), ("codec", "u1"), ("ref", "<i8"),
                     ("start", "<u8"), ("length", "<u8"), ("digest", "<u8"),
                     ("offsets", "<u8", (dims,)), ("shape", "<u8", (dims,))])


def table_name(token: str, rank: int) -> str:
    """A rank's table file: like data files, it starts with the rank mod 256 in hex, so a
    large job's tables spread over 256 key prefixes (docs/storage.md)."""
    return f"table-{rank % 256:02x}-{token}-r{rank:05d}.ckt"


def encode_table(step: int, rank: int, chunks: list[tuple[str, Chunk]]) -> bytes:
    """The table file of ``rank``'s chunks."""
    keys: dict[str, int] = {}
    files: dict[str, int] = {}
    dims = max([1] + [len(c.shape) for _, c in chunks])
    rows = []
    codec_index = {c: i for i, c in enumerate(CODECS)}
    for key, c in chunks:
        pad = dims - len(c.shape)
        rows.append((keys.setdefault(key, len(keys)), files.setdefault(c.file, len(files)),
                     codec_index[c.codec], -1 if c.step is None else c.step, c.start, c.length,
                     int(c.digest, 16), c.offsets + (0,) * pad, c.shape + (1,) * pad))
    records = np.array(rows, dtype=record_dtype(dims))
    header = json.dumps({"step": step, "rank": rank, "keys": list(keys), "files": list(files),
                         "dims": dims, "rows": len(rows)}, separators=(",", ":")).encode()
    header += b" " * (-(len(header) + 16) % 8)
    return MAGIC + struct.pack("<Q", len(header)) + header + records.tobytes()


class Table:
    """One rank's validated table: its chunks by tensor, sorted by first offset."""

    def __init__(self, keys: list[str], files: list[str], records: np.ndarray,
                 ndims: dict[str, int]) -> None:
        self.files = files
        order = np.lexsort((records["offsets"][:, 0], records["tensor"]))
        self.records = records[order]
        tensor = self.records["tensor"]
        bounds = np.searchsorted(tensor, np.arange(len(keys) + 1))
        self.span = {k: (int(bounds[i]), int(bounds[i + 1])) for i, k in enumerate(keys)}
        self.ndims = ndims
        # Python lists once: chunks are built from them one by one (numpy scalars are slow)
        rec = self.records
        self._cols = (rec["offsets"].tolist(), rec["shape"].tolist(), rec["file"].tolist(),
                      rec["start"].tolist(), rec["length"].tolist(), rec["digest"].tolist(),
                      rec["codec"].tolist(), rec["ref"].tolist())
        self._first = [o[0] for o in self._cols[0]]
        self._reach = {k: int(rec["shape"][a:b, 0].max()) if b > a else 1
                       for k, (a, b) in self.span.items()}

    def chunk(self, i: int, key: str) -> Chunk:
        offsets, shape, file, start, length, dig, codec, ref = self._cols
        nd = self.ndims[key]
        return Chunk(tuple(offsets[i][:nd]), tuple(shape[i][:nd]), self.files[file[i]],
                     start[i], length[i], f"{dig[i]:016x}", CODECS[codec[i]],
                     None if ref[i] < 0 else ref[i])

    def chunks(self, key: str) -> list[Chunk]:
        a, b = self.span.get(key, (0, 0))
        return [self.chunk(i, key) for i in range(a, b)]

    def overlapping(self, key: str, box: Box) -> list[Chunk]:
        """This table's chunks of ``key`` that overlap ``box`` (bisection on first offsets)."""
        a, b = self.span.get(key, (0, 0))
        if self.ndims.get(key) == 0:
            return [self.chunk(i, key) for i in range(a, b)]
        lo = bisect.bisect_left(self._first, box[0][0] - self._reach[key] + 1, a, b)
        hi = bisect.bisect_left(self._first, box[0][0] + box[1][0], a, b)
        out = []
        for i in range(lo, hi):
            c = self.chunk(i, key)
            if all(co < bo + bs and bo < co + cs for co, cs, bo, bs
                   in zip(c.offsets, c.shape, box[0], box[1])):
                out.append(c)
        return out


def parse_table(raw: bytes, manifest, rank: int) -> Table:
    """Validate ``raw`` as ``rank``'s table of ``manifest`` (a format-2 Manifest); raises
    format.Invalid naming the problem."""
    if len(raw) < 16 or raw[:8] != MAGIC:
        raise Invalid("is not a ckpt rank table (bad magic)")
    (hlen,) = struct.unpack("<Q", raw[8:16])
    if hlen > min(MAX_HEADER_BYTES, len(raw) - 16):
        raise Invalid(f"header length {hlen} does not fit the table ({len(raw)} bytes)")
    try:
        head = json.loads(raw[16:16 + hlen])
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise Invalid(f"header is not valid JSON ({type(e).__name__})") from None
    if not isinstance(head, dict):
        raise Invalid("header is not an object")
    if head.get("step") != manifest.step or head.get("rank") != rank:
        raise Invalid(f"belongs to step {head.get('step')!r} rank {head.get('rank')!r}, not "
                      f"step {manifest.step} rank {rank}")
    keys, files, dims, rows = (head.get(f) for f in ("keys", "files", "dims", "rows"))
    if not (isinstance(keys, list) and all(isinstance(k, str) and k in manifest.tensors
                                           for k in keys) and len(set(keys)) == len(keys)):
        raise Invalid("names tensors the manifest does not hold (or one twice)")
    if not isinstance(files, list) or len(set(files)) != len(files):
        raise Invalid("files must be a list of distinct names")
    files = [file_name(f) for f in files]
    if not (type(dims) is int and 1 <= dims <= MAX_DIMS and type(rows) is int and rows >= 0):
        raise Invalid("dims or rows out of range")
    dtype = record_dtype(dims)
    start = 16 + hlen
    if len(raw) != start + rows * dtype.itemsize:
        raise Invalid(f"holds {len(raw) - start} bytes of records, not {rows} x "
                      f"{dtype.itemsize}")
    rec = np.frombuffer(raw, dtype=dtype, count=rows, offset=start)
    _check_records(rec, keys, files, dims, manifest)
    entries = [manifest.tensors[k] for k in keys]
    _check_tiling(rec, keys, entries, dims, manifest, rank)
    return Table(keys, files, rec, {k: len(e.shape) for k, e in zip(keys, entries)})


def _fail(mask: np.ndarray, rec: np.ndarray, keys: list[str], why: str) -> None:
    if mask.any():
        i = int(np.argmax(mask))
        raise Invalid(f"chunk {i} (of {keys[int(rec['tensor'][i])]!r}) {why}")


def _check_records(rec: np.ndarray, keys: list[str], files: list[str], dims: int,
                   manifest) -> None:
    n = len(rec)
    if not n:
        return
    t = rec["tensor"].astype(np.int64)
    if (t >= len(keys)).any():
        raise Invalid("a chunk names a tensor index past the table's keys")
    if (rec["file"] >= len(files)).any() or (rec["codec"] >= len(CODECS)).any():
        raise Invalid("a chunk names a file or codec index out of range")
    entries = [manifest.tensors[k] for k in keys]
    ndim = np.array([len(e.shape) for e in entries], dtype=np.int64)
    if (ndim > dims).any():
        raise Invalid(f"a tensor has more dimensions than the table's {dims}")
    tshape = np.ones((len(keys), dims), dtype=np.uint64)
    for i, e in enumerate(entries):
        tshape[i, :len(e.shape)] = e.shape
    itemsize = np.array([DTYPES[e.dtype].itemsize for e in entries], dtype=np.uint64)
    off, shp = rec["offsets"], rec["shape"]
    pad = np.arange(dims)[None, :] >= ndim[t][:, None]
    _fail(((off != 0) & pad).any(axis=1) | ((shp != 1) & pad).any(axis=1), rec, keys,
          "has the wrong rank")
    big = np.uint64(MAX_BYTES)
    _fail((off > big).any(axis=1) | (shp > big).any(axis=1), rec, keys, "is absurdly large")
    _fail(((off + shp) > tshape[t]).any(axis=1), rec, keys, "lies outside its tensor")
    numel = np.prod(shp, axis=1, dtype=np.uint64)  # bounded by the tensor's (checked)
    raw_len = numel * itemsize[t]
    length, first = rec["length"], rec["start"]
    _fail((length > big) | (first > big), rec, keys, "has an absurd byte range")
    raw_codec = rec["codec"] == 0
    _fail(raw_codec & (length != raw_len), rec, keys, "has the wrong length for its box")
    _fail(~raw_codec & ((length > raw_len + np.uint64(1024))
                        | (raw_len // np.uint64(MAX_ZSTD_RATIO) > length + np.uint64(64))),
          rec, keys, "claims a compression ratio no zstd frame reaches")
    ref = rec["ref"]
    _fail((ref < -1) | (ref >= manifest.step), rec, keys, "refers to a step that is not earlier")
    own = np.array([manifest.files.get(f, -1) for f in files], dtype=np.int64)
    end = (first + length).astype(np.int64)  # both bounded by 2^50
    fidx = rec["file"].astype(np.int64)
    mine = ref < 0
    _fail(mine & (own[fidx] < 0), rec, keys, "names a file not among the manifest's files")
    _fail(mine & (end > own[fidx]), rec, keys, "ends past the end of its file")
    if (~mine).any():
        pairs = ref * len(files) + fidx
        uniq, inverse = np.unique(pairs[~mine], return_inverse=True)
        sizes = np.array([manifest.refs.get((int(p) // len(files), files[int(p) % len(files)]),
                                            -1) for p in uniq], dtype=np.int64)
        limit = np.full(n, 0, dtype=np.int64)
        limit[~mine] = sizes[inverse]
        _fail(~mine & (limit < 0), rec, keys, "names an earlier step's file the manifest's "
              "refs do not list")
        _fail(~mine & (end > limit), rec, keys, "ends past the size refs record for its file")


def _corners(tensor: np.ndarray, lo: np.ndarray, hi: np.ndarray, split: list[int]):
    """Points and +-1 weights of the boxes' corners along ``split`` dims (format._check_tiling)."""
    points, weights = [], []
    for bits in range(1 << len(split)):
        cols = [tensor]
        sign = np.ones(len(tensor), dtype=np.int64)
        for j, d in enumerate(split):
            if bits >> j & 1:
                cols.append(hi[:, d])
                sign = -sign
            else:
                cols.append(lo[:, d])
        points.append(np.stack(cols, axis=1))
        weights.append(sign)
    return np.concatenate(points), np.concatenate(weights)


def _check_tiling(rec: np.ndarray, keys: list[str], entries: list, dims: int, manifest,
                  rank: int) -> None:
    """Each tensor's rows tile exactly the boxes the layout says ``rank`` wrote."""
    cells_t, cells_lo, cells_hi = [], [], []
    for i, (key, e) in enumerate(zip(keys, entries)):
        for offsets, shape in written_by(key, e.shape, e.layout, rank):
            pad = dims - len(shape)
            cells_t.append(i)
            cells_lo.append(offsets + (0,) * pad)
            cells_hi.append(tuple(o + s for o, s in zip(offsets, shape)) + (1,) * pad)
    t = rec["tensor"].astype(np.int64)
    lo = rec["offsets"].astype(np.int64)
    hi = lo + rec["shape"].astype(np.int64)
    ct = np.array(cells_t, dtype=np.int64)
    clo = np.array(cells_lo, dtype=np.int64).reshape(-1, dims)
    chi = np.array(cells_hi, dtype=np.int64).reshape(-1, dims)
    tshape = np.ones((max(1, len(keys)), dims), dtype=np.int64)
    for i, e in enumerate(entries):
        tshape[i, :len(e.shape)] = e.shape
    split = [d for d in range(dims)
             if (lo[:, d] != 0).any() or (hi[:, d] != tshape[t, d]).any()
             or (clo[:, d] != 0).any() or (chi[:, d] != tshape[ct, d]).any()]
    if (len(rec) + len(ct)) << len(split) > MAX_TILING_CORNERS:
        raise Invalid(f"splits {len(split)} dimensions into {len(rec)} chunks, more than "
                      "ckpt ever writes")
    p1, w1 = _corners(t, lo, hi, split)
    p2, w2 = _corners(ct, clo, chi, split)
    points = np.concatenate([p1, p2])
    if not len(points):
        return
    # sum the weights per distinct point: sort the points, cut where a point changes
    order = np.lexsort(points.T[::-1])
    points = points[order]
    weights = np.concatenate([w1, -w2])[order]
    group = np.concatenate([[0], np.cumsum((points[1:] != points[:-1]).any(axis=1))])
    total = np.bincount(group, weights=weights)
    if np.any(total != 0):
        raise Invalid("its chunks do not tile the boxes the manifest's layout assigns this "
                      "rank (a gap, an overlap or a box it did not write)")


class Tables:
    """The rank tables of one format-2 step, read on demand and cached (thread-safe).

    ``read(name)`` returns a table file's bytes (relative to the step's location).
    """

    def __init__(self, manifest, read: Callable[[str], bytes], where: str) -> None:
        self.manifest = manifest
        self.read = read
        self.where = where
        self._tables: dict[int, Table] = {}
        self._lock = threading.Lock()
        self._all: dict[str, tuple[Chunk, ...]] | None = None

    def table(self, rank: int) -> Table:
        table = self._tables.get(rank)  # a dict read is atomic; filled under the lock
        if table is not None:
            return table
        name, size, want = self.manifest.tables[rank]
        where = f"{self.where}/{name}"
        try:
            raw = self.read(name)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{where} (rank {rank}'s chunk table) is missing; "
                                         "the step cannot be loaded", path=where) from None
        if len(raw) != size or content_digest(raw) != want:
            raise CorruptCheckpointError(
                f"{where}: rank {rank}'s chunk table is {len(raw)} bytes with digest "
                f"{content_digest(raw)}, the manifest recorded {size} bytes and {want}: it was "
                "changed or damaged; the step cannot be loaded", path=where)
        try:
            table = parse_table(raw, self.manifest, rank)
        except Invalid as e:
            raise CorruptCheckpointError(f"{where}: invalid chunk table: {e}; the step "
                                         "cannot be loaded", path=where) from None
        with self._lock:
            self._tables[rank] = table
        return table

    def overlapping(self, key: str, box: Box) -> list[tuple[Chunk, Box]]:
        """The chunks of ``key`` overlapping ``box``, each with the overlap, from the tables
        of the ranks whose saved boxes overlap it (found from the layout)."""
        entry = self.manifest.tensors[key]
        out = []
        for cell, rank in cells_overlapping(key, entry.shape, entry.layout, box):
            table = self.table(rank)
            if key not in table.span:
                raise CorruptCheckpointError(
                    f"{self.where}: rank {rank}'s chunk table lacks {key!r}, which the "
                    "layout says it wrote; the step cannot be loaded", path=self.where)
            for c in table.overlapping(key, box):
                overlap = intersect((c.offsets, c.shape), box) if c.numel else None
                if overlap is not None:
                    out.append((c, overlap))
        return out

    def all_chunks(self, key: str) -> tuple[Chunk, ...]:
        """Every chunk of ``key`` (reads every table once, then cached): what tools that
        look at a whole step use (verify, inspect, diff, export)."""
        if self._all is None:
            per: dict[str, list[Chunk]] = {k: [] for k in self.manifest.tensors}
            for rank in range(len(self.manifest.tables)):
                table = self.table(rank)
                for k in table.span:
                    per[k].extend(table.chunks(k))
            self._check_complete(per)
            self._all = {k: tuple(sorted(v, key=lambda c: c.offsets)) for k, v in per.items()}
        return self._all[key]

    def _check_complete(self, per: dict[str, list[Chunk]]) -> None:
        for key, chunks in per.items():
            entry = self.manifest.tensors[key]
            covered = sum(c.numel for c in chunks)
            if covered != math.prod(entry.shape):
                raise CorruptCheckpointError(
                    f"{self.where}: the rank tables cover {covered} of the "
                    f"{math.prod(entry.shape)} elements of {key!r}; the step cannot be loaded",
                    path=self.where)
