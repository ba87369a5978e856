"""Per-rank chunk tables (format version 2): what one rank wrote, as one compact binary file.

Layout of a table file (all integers little-endian)::

    b"CKPTRT02"                   magic
    u64 header length H
    H bytes of JSON               {"step", "rank", "keys": [...], "files": [...], "dims", "rows"}
    padding to a multiple of 8
    rows x record                 a packed numpy structured array (record_dtype)

A record is one chunk: the index of its tensor in ``keys``, of its file in ``files``, its codec
(index in ``names.CODECS``), the earlier step holding its file (-1: this step), the byte
range, the xxh3-64 digest of its raw bytes, and its box (``dims`` offsets and sizes, padded
with 0 and 1 past the tensor's own dimensions).

The top-level manifest records each table's size and digest, so a table is checked against
both before it is parsed (by ``ckpt._step.tables``, which fetches it); then every record is
validated against the manifest as numpy operations over whole columns (boxes inside their
tensor, lengths, files and byte ranges), and the rows of each tensor must tile exactly the
boxes the manifest's layout says this rank wrote (the corner identity of
``tiling.check_tiling``, vectorized). All of it is linear in the table's size, before any
chunk is handed out.
"""

from __future__ import annotations

import bisect
import json
import struct
from typing import Any

import numpy as np

from ckpt._format.bounds import (MAX_BYTES, MAX_DIMS, MAX_TILING_CORNERS, MAX_ZSTD_RATIO,
                                 Invalid, file_name)
from ckpt._format.entries import Chunk
from ckpt._format.gcpause import paused_gc
from ckpt._format.layout import Box, written_by
from ckpt._format.manifest import Manifest
from ckpt._format.names import CODECS, DTYPES

MAGIC = b"CKPTRT02"
MAX_HEADER_BYTES = 64 << 20


def record_dtype(dims: int) -> np.dtype:
    return np.dtype([("tensor", "<u4"), ("file", "<u4"), ("codec", "u1"), ("ref", "<i8"),
                     ("start", "<u8"), ("length", "<u8"), ("digest", "<u8"),
                     ("offsets", "<u8", (dims,)), ("shape", "<u8", (dims,))])


def table_name(token: str, rank: int) -> str:
    """A rank's table file: like data files, it starts with the rank mod 256 in hex, so a
    large job's tables spread over 256 key prefixes (docs/storage.md)."""
    return f"table-{rank % 256:02x}-{token}-r{rank:05d}.ckt"


def encode_table(step: int, rank: int, chunks: list[tuple[str, Chunk]],
                 values: dict[str, Any] | None = None) -> bytes:
    """The table file of ``rank``'s chunks (and its trees of per-rank items, ``values``)."""
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
    head = {"step": step, "rank": rank, "keys": list(keys), "files": list(files),
            "dims": dims, "rows": len(rows)}
    if values:
        head["values"] = values
    header = json.dumps(head, separators=(",", ":"), allow_nan=False).encode()
    header += b" " * (-(len(header) + 16) % 8)
    return MAGIC + struct.pack("<Q", len(header)) + header + records.tobytes()


class _Rows:
    """The validated records of a batch of tables as Python lists, sorted by (table, tensor,
    first offset): chunks are built from them one by one (numpy scalars are slow)."""

    def __init__(self, offsets: np.ndarray, shape: np.ndarray, cols: dict[str, np.ndarray],
                 files: list[str]) -> None:
        self.files = files
        with paused_gc():  # tens of thousands of small lists at once
            self.offsets, self.shape = offsets.tolist(), shape.tolist()
            self.file, self.start, self.length, self.digest, self.codec, self.ref = (
                cols[c].tolist() for c in ("file", "start", "length", "digest", "codec", "ref"))
            self.first = [o[0] for o in self.offsets]


class Table:
    """One rank's validated table: its chunks by tensor, sorted by first offset (a view of
    the rows of the batch it was validated in)."""

    def __init__(self, rows: _Rows, span: dict[str, tuple[int, int]], reach: dict[str, int],
                 ndims: dict[str, int], values: dict[str, Any]) -> None:
        self.rows = rows
        self.values = values  # item name -> this rank's tree of that per-rank item
        self.span = span  # key -> [a, b) in rows
        self._reach = reach  # key -> its longest first-dimension extent (bisection look-back)
        self.ndims = ndims

    def chunk(self, i: int, key: str) -> Chunk:
        r, nd = self.rows, self.ndims[key]
        ref = r.ref[i]
        return Chunk(tuple(r.offsets[i][:nd]), tuple(r.shape[i][:nd]), r.files[r.file[i]],
                     r.start[i], r.length[i], f"{r.digest[i]:016x}", CODECS[r.codec[i]],
                     None if ref < 0 else ref)

    def chunks(self, key: str) -> list[Chunk]:
        a, b = self.span.get(key, (0, 0))
        return [self.chunk(i, key) for i in range(a, b)]

    def overlapping(self, key: str, box: Box) -> list[tuple[Chunk, Box]]:
        """This table's chunks of ``key`` that overlap ``box``, each with the overlap
        (bisection on first offsets; a Chunk is built only for the chunks returned)."""
        a, b = self.span.get(key, (0, 0))
        nd = self.ndims.get(key, 0)
        if nd == 0:
            return [(self.chunk(i, key), ((), ())) for i in range(a, b)]
        first = self.rows.first
        lo = bisect.bisect_left(first, box[0][0] - self._reach[key] + 1, a, b)
        hi = bisect.bisect_left(first, box[0][0] + box[1][0], a, b)
        offsets, shape = self.rows.offsets, self.rows.shape
        out = []
        for i in range(lo, hi):
            o, s = offsets[i], shape[i]
            start, size = [], []
            for d in range(nd):
                first_, last = max(o[d], box[0][d]), min(o[d] + s[d], box[0][d] + box[1][d])
                if last <= first_:
                    break
                start.append(first_)
                size.append(last - first_)
            else:
                out.append((self.chunk(i, key), (tuple(start), tuple(size))))
        return out


class BadTable(Invalid):
    """A table failed validation; ``rank`` says whose (a batch validates many)."""

    def __init__(self, rank: int, why: str) -> None:
        super().__init__(why)
        self.rank = rank


class TensorIndex:
    """The manifest's tensors as arrays (position, rank, shape padded with 1, item size),
    built once per manifest and shared by every batch of tables validated against it."""

    def __init__(self, manifest: Manifest) -> None:
        entries = list(manifest.tensors.values())
        self.position = {k: i for i, k in enumerate(manifest.tensors)}
        self.ndim = np.array([len(e.shape) for e in entries], dtype=np.int64)
        width = max([1] + self.ndim.tolist())
        self.shape = np.ones((len(entries), width), dtype=np.uint64)
        for i, e in enumerate(entries):
            self.shape[i, :len(e.shape)] = e.shape
        self.itemsize = np.array([DTYPES[e.dtype].itemsize for e in entries], dtype=np.uint64)

    def shapes(self, dims: int) -> np.ndarray:
        """Every tensor's shape as ``dims`` columns (callers checked that none has more)."""
        have = self.shape.shape[1]
        if dims <= have:
            return self.shape[:, :dims]
        return np.hstack([self.shape, np.ones((len(self.shape), dims - have), np.uint64)])


def _read_head(raw: bytes, manifest: Manifest, rank: int) -> tuple:
    """(keys, files, dims, records, values) of ``rank``'s table, its header checked."""
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
    if not isinstance(files, list):
        raise Invalid("files must be a list of distinct names")
    files = [file_name(f) for f in files]  # (names first: a list is no set member)
    if len(set(files)) != len(files):
        raise Invalid("files must be a list of distinct names")
    if not (type(dims) is int and 1 <= dims <= MAX_DIMS and type(rows) is int and rows >= 0):
        raise Invalid("dims or rows out of range")
    dtype = record_dtype(dims)
    start = 16 + hlen
    if len(raw) != start + rows * dtype.itemsize:
        raise Invalid(f"holds {len(raw) - start} bytes of records, not {rows} x "
                      f"{dtype.itemsize}")
    values = head.get("values", {})
    want = manifest.in_tables()
    if not isinstance(values, dict) or set(values) != want:
        held = sorted(values) if isinstance(values, dict) else values
        raise Invalid(f"holds values of items {held!r}, the manifest's per-rank items are "
                      f"{sorted(want)}")
    # each tree is checked when first asked for (Tables.value): a reader of many tables
    # uses one rank's values, and an RNGState's tree is ~7.6 KB of JSON
    return keys, files, dims, np.frombuffer(raw, dtype=dtype, count=rows, offset=start), values


class _Batch:
    """The records of several tables as one set of columns, so that validating them costs
    a fixed number of numpy operations per batch rather than per table (a reader of a
    replicated layout reads hundreds of small tables)."""

    def __init__(self, heads: list[tuple[int, list[str], list[str], int, np.ndarray]],
                 index: TensorIndex) -> None:
        self.heads = heads
        self.dims = dims = max(h[3] for h in heads)
        recs = [h[4] for h in heads]
        counts = np.array([len(r) for r in recs], dtype=np.int64)
        self.row_base = np.concatenate([[0], np.cumsum(counts)])
        self.table = np.repeat(np.arange(len(heads)), counts)  # row -> table
        nkeys = np.array([len(h[1]) for h in heads], dtype=np.int64)
        nfiles = np.array([len(h[2]) for h in heads], dtype=np.int64)
        self.key_base = np.concatenate([[0], np.cumsum(nkeys)])
        file_base = np.concatenate([[0], np.cumsum(nfiles)])
        cat = (lambda f: np.concatenate([r[f] for r in recs]) if recs else np.zeros(0))
        self.local_tensor = cat("tensor").astype(np.int64)
        self.local_file = cat("file").astype(np.int64)
        self.nkeys, self.nfiles = nkeys, nfiles
        self.cols = {f: cat(f) for f in ("codec", "ref", "start", "length", "digest")}
        self.offsets = np.concatenate([_widen(r["offsets"], dims, 0) for r in recs])
        self.shape = np.concatenate([_widen(r["shape"], dims, 1) for r in recs])
        self.group = self.local_tensor + self.key_base[self.table]  # (table, tensor) id
        self.file = self.local_file + file_base[self.table]
        self.files = [f for h in heads for f in h[2]]
        self.keys = [(h[0], k) for h in heads for k in h[1]]  # group -> (rank, key)
        self.group_tensor = np.array([index.position[k] for _, k in self.keys], dtype=np.int64)
        self.group_dims = np.repeat(np.array([h[3] for h in heads], dtype=np.int64), nkeys)

    def fail(self, mask: np.ndarray, why: str) -> None:
        if mask.any():
            i = int(np.argmax(mask))
            t = int(self.table[i])
            rank, keys = self.heads[t][0], self.heads[t][1]
            raise BadTable(rank, f"chunk {i - int(self.row_base[t])} (of "
                                 f"{keys[int(self.local_tensor[i])]!r}) {why}")

    def fail_table(self, mask: np.ndarray, why: str) -> None:
        if mask.any():
            raise BadTable(self.heads[int(self.table[int(np.argmax(mask))])][0], why)


def _widen(a: np.ndarray, dims: int, fill: int) -> np.ndarray:
    if a.shape[1] == dims:
        return a
    return np.hstack([a, np.full((len(a), dims - a.shape[1]), fill, dtype=a.dtype)])


def parse_tables(raws: dict[int, bytes], manifest: Manifest,
                 index: TensorIndex) -> dict[int, Table]:
    """Validate ``raws`` (rank -> bytes) as those ranks' tables of ``manifest`` (a format-2
    Manifest), all in one pass over their records; raises BadTable naming the first bad
    table and the problem."""
    heads = []
    for rank, raw in raws.items():
        try:
            heads.append((rank, *_read_head(raw, manifest, rank)))
        except Invalid as e:
            raise BadTable(rank, str(e)) from None
    b = _Batch(heads, index)
    _check_records(b, manifest, index)
    _check_tiling(b, manifest, index)
    return _tables_of(b, index)


def _tables_of(b: _Batch, index: TensorIndex) -> dict[int, Table]:
    order = np.lexsort((b.offsets[:, 0], b.group))
    group = b.group[order]
    rows = _Rows(b.offsets[order], b.shape[order], {f: c[order] for f, c in
                                                     [*b.cols.items(), ("file", b.file)]},
                 b.files)
    bounds = np.searchsorted(group, np.arange(len(b.keys) + 1)).tolist()
    starts = [a for a, z in zip(bounds, bounds[1:]) if a < z]
    longest = (np.maximum.reduceat(b.shape[order][:, 0], starts).tolist() if starts else [])
    reach_at = dict(zip(starts, longest))
    ndim = index.ndim.tolist()
    out = {}
    for t, (rank, keys, _, _, _, values) in enumerate(b.heads):
        span, reach, ndims = {}, {}, {}
        for j, key in enumerate(keys):
            g = int(b.key_base[t]) + j
            span[key] = (bounds[g], bounds[g + 1])
            reach[key] = int(reach_at.get(bounds[g], 1))
            ndims[key] = ndim[index.position[key]]
        out[rank] = Table(rows, span, reach, ndims, values)
    return out


def _check_records(b: _Batch, manifest: Manifest, index: TensorIndex) -> None:
    n, dims = len(b.group), b.dims
    if not n:
        return
    b.fail_table(b.local_tensor >= b.nkeys[b.table],
                 "a chunk names a tensor index past the table's keys")
    b.fail_table((b.local_file >= b.nfiles[b.table]) | (b.cols["codec"] >= len(CODECS)),
                 "a chunk names a file or codec index out of range")
    ndim_g = index.ndim[b.group_tensor]
    if (ndim_g > b.group_dims).any():
        g = int(np.argmax(ndim_g > b.group_dims))
        raise BadTable(b.keys[g][0], "a tensor has more dimensions than the table's dims")
    t = b.group_tensor[b.group]  # row -> manifest tensor
    tshape = index.shapes(dims)[t]
    off, shp = b.offsets, b.shape
    pad = np.arange(dims)[None, :] >= index.ndim[t][:, None]
    b.fail(((off != 0) & pad).any(axis=1) | ((shp != 1) & pad).any(axis=1), "has the wrong rank")
    big = np.uint64(MAX_BYTES)
    b.fail((off > big).any(axis=1) | (shp > big).any(axis=1), "is absurdly large")
    b.fail(((off + shp) > tshape).any(axis=1), "lies outside its tensor")
    numel = np.prod(shp, axis=1, dtype=np.uint64)  # bounded by the tensor's (checked)
    raw_len = numel * index.itemsize[t]
    length, first = b.cols["length"], b.cols["start"]
    b.fail((length > big) | (first > big), "has an absurd byte range")
    raw_codec = b.cols["codec"] == 0
    b.fail(raw_codec & (length != raw_len), "has the wrong length for its box")
    b.fail(~raw_codec & ((length > raw_len + np.uint64(1024))
                         | (raw_len // np.uint64(MAX_ZSTD_RATIO) > length + np.uint64(64))),
           "claims a compression ratio no zstd frame reaches")
    ref = b.cols["ref"]
    b.fail((ref < -1) | (ref >= manifest.step), "refers to a step that is not earlier")
    own = np.array([manifest.files.get(f, -1) for f in b.files], dtype=np.int64)
    end = (first + length).astype(np.int64)  # both bounded by 2^50
    mine = ref < 0
    b.fail(mine & (own[b.file] < 0), "names a file not among the manifest's files")
    b.fail(mine & (end > own[b.file]), "ends past the end of its file")
    if (~mine).any():
        pairs = ref * len(b.files) + b.file
        uniq, inverse = np.unique(pairs[~mine], return_inverse=True)
        sizes = np.array([manifest.refs.get((int(p) // len(b.files),
                                             b.files[int(p) % len(b.files)]), -1)
                          for p in uniq], dtype=np.int64)
        limit = np.full(n, 0, dtype=np.int64)
        limit[~mine] = sizes[inverse]
        b.fail(~mine & (limit < 0), "names an earlier step's file the manifest's refs do "
               "not list")
        b.fail(~mine & (end > limit), "ends past the size refs record for its file")


def _corners(tensor: np.ndarray, lo: np.ndarray, hi: np.ndarray, split: list[int]):
    """Points and +-1 weights of the boxes' corners along ``split`` dims (tiling.check_tiling)."""
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


def _check_tiling(b: _Batch, manifest: Manifest, index: TensorIndex) -> None:
    """Each table's rows of each tensor tile exactly the boxes the layout says its rank
    wrote (the corner identity over (table, tensor) groups, for the whole batch at once)."""
    dims = b.dims
    cells_g, cells_lo, cells_hi = [], [], []
    for g, (rank, key) in enumerate(b.keys):
        e = manifest.tensors[key]
        for offsets, shape in written_by(key, e.shape, e.layout, rank):
            pad = dims - len(shape)
            cells_g.append(g)
            cells_lo.append(offsets + (0,) * pad)
            cells_hi.append(tuple(o + s for o, s in zip(offsets, shape)) + (1,) * pad)
    g = b.group
    lo = b.offsets.astype(np.int64)
    hi = lo + b.shape.astype(np.int64)
    cg = np.array(cells_g, dtype=np.int64)
    clo = np.array(cells_lo, dtype=np.int64).reshape(-1, dims)
    chi = np.array(cells_hi, dtype=np.int64).reshape(-1, dims)
    full = index.shapes(dims).astype(np.int64)
    whole_r = full[b.group_tensor[g]] if len(g) else full[:0]
    whole_c = full[b.group_tensor[cg]] if len(cg) else full[:0]
    split = [d for d in range(dims)
             if (lo[:, d] != 0).any() or (hi[:, d] != whole_r[:, d]).any()
             or (clo[:, d] != 0).any() or (chi[:, d] != whole_c[:, d]).any()]
    if (len(g) + len(cg)) << len(split) > MAX_TILING_CORNERS * len(b.heads):
        raise BadTable(b.heads[0][0], f"splits {len(split)} dimensions into {len(g)} chunks, "
                       "more than ckpt ever writes")
    p1, w1 = _corners(g, lo, hi, split)
    p2, w2 = _corners(cg, clo, chi, split)
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
        # the first point whose weights do not cancel belongs to a (table, tensor) group
        bad = int(points[int(np.argmax(np.repeat(total, np.bincount(group)) != 0)), 0])
        raise BadTable(b.keys[bad][0], f"its chunks of {b.keys[bad][1]!r} do not tile the "
                       "boxes the manifest's layout assigns this rank (a gap, an overlap or "
                       "a box it did not write)")
