"""Validation of a parsed manifest document, before any path, size or shape in it is used.

Names are plain file names (no ``/``, no ``..``), sizes are bounded, every chunk lies inside
its tensor, and a tensor's chunks tile it exactly (no gap, no overlap). Messages are built only
on failure: a large job's manifest holds a tensor per parameter and millions of chunks.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ckpt._format.bounds import (MAX_BYTES, MAX_DEPTH, MAX_TABLE_BYTES, MAX_ZSTD_RATIO,
                                 Invalid, bounded_int, check, dims, file_name, is_decimal,
                                 is_digest)
from ckpt._format.entries import Chunk, TensorEntry
from ckpt._format.layout import BoxLayout, Mesh, MeshLayout
from ckpt._format.names import CODECS, DTYPES, FORMAT_NAME, FORMAT_VERSION, FORMAT_VERSION_TABLES
from ckpt._format.tiling import check_tiling
from ckpt._format.tree import check_item, nesting_depth

_SHARD = re.compile(r"S(0|[1-9][0-9]?)")  # a placement that shards a dimension


def parse_manifest(doc: Any) -> dict[str, Any]:
    """The validated fields of a manifest (the keyword arguments of ``Manifest``) from its
    parsed JSON ``doc``; raises Invalid."""
    check(isinstance(doc, dict), "top level must be an object")
    check(doc.get("format") == FORMAT_NAME, f"format must be {FORMAT_NAME!r}")
    version = doc.get("format_version")
    check(version in (FORMAT_VERSION, FORMAT_VERSION_TABLES),
          f"format_version {version!r} is not supported (this ckpt reads "
          f"{FORMAT_VERSION} and {FORMAT_VERSION_TABLES})")
    step = bounded_int(doc.get("step"), "step", hi=2**62)
    world = bounded_int(doc.get("world_size"), "world_size", lo=1, hi=2**24)
    created = doc.get("created")
    # Not required finite: it only labels the step (`ckpt ls` shows a bad one as invalid).
    check(isinstance(created, (int, float)) and not isinstance(created, bool),
          "created must be a number")
    files_doc = doc.get("files")
    check(isinstance(files_doc, dict), "files must be an object")
    files = {file_name(k): bounded_int(v, f"size of {k}") for k, v in files_doc.items()}
    tensors_doc = doc.get("tensors")
    check(isinstance(tensors_doc, dict), "tensors must be an object")
    tables: list[tuple[str, int, str]] = []
    refs: dict[tuple[int, str], int] = {}
    if version == FORMAT_VERSION:
        tensors = {k: _parse_tensor(k, v, step, files) for k, v in tensors_doc.items()}
    else:
        meshes = _parse_meshes(doc.get("meshes"), world)
        tensors = {k: _parse_laid_out(k, v, meshes, world) for k, v in tensors_doc.items()}
        tables = _parse_tables(doc.get("tables"), world, files)
        refs = _parse_refs(doc.get("refs"), step)
    aliases = doc.get("aliases", {})
    check(isinstance(aliases, dict), "aliases must be an object")
    for k, v in aliases.items():
        if not (isinstance(v, str) and v in tensors and k not in tensors):
            raise Invalid(f"alias {k!r} -> {v!r} is dangling")
    items = doc.get("items")
    check(isinstance(items, dict), "items must be an object")
    for name, item in items.items():
        check_item(name, item, tensors, aliases, in_tables=version == FORMAT_VERSION_TABLES)
    metadata = doc.get("metadata", {})
    check(isinstance(metadata, dict), "metadata must be an object")
    check(nesting_depth(metadata) <= MAX_DEPTH, f"metadata nests deeper than {MAX_DEPTH} levels")
    return dict(step=step, world_size=world, created=float(created), tensors=tensors,
                aliases=aliases, items=items, files=files, metadata=metadata,
                format_version=version, tables=tables, refs=refs)


def _parse_meshes(doc: Any, world: int) -> list[Mesh]:
    check(isinstance(doc, list) and len(doc) <= 4096, "meshes must be a list")
    meshes = []
    for i, m in enumerate(doc):
        check(isinstance(m, dict), f"mesh {i} must be an object")
        shape = dims(m.get("shape"), f"shape of mesh {i}")
        check(bool(shape) and all(shape) and math.prod(shape) <= world,
              f"mesh {i} has shape {list(shape)}, which does not fit {world} ranks")
        ranks = m.get("ranks")
        check(isinstance(ranks, list) and len(ranks) == math.prod(shape)
              and all(type(r) is int and 0 <= r < world for r in ranks)
              and len(set(ranks)) == len(ranks),
              f"mesh {i}: ranks must list {math.prod(shape)} distinct ranks below {world}")
        meshes.append(Mesh(shape, tuple(ranks)))
    return meshes


def _dtype_and_shape(key: str, doc: Any) -> tuple[str, tuple[int, ...]]:
    if not isinstance(doc, dict):
        raise Invalid(f"tensor {key!r} must be an object")
    dtype = doc.get("dtype")
    if not (isinstance(dtype, str) and dtype in DTYPES):
        raise Invalid(f"tensor {key!r} has unknown dtype {dtype!r}")
    shape = dims(doc.get("shape"), "shape", key)
    if math.prod(shape) * DTYPES[dtype].itemsize > MAX_BYTES:
        raise Invalid(f"tensor {key!r} is absurdly large")
    return dtype, shape


def _parse_laid_out(key: str, doc: Any, meshes: list[Mesh], world: int) -> TensorEntry:
    """A format-2 tensor: dtype, shape and the layout that says which rank wrote which box."""
    dtype, shape = _dtype_and_shape(key, doc)
    layout = doc.get("layout")
    if not isinstance(layout, dict):
        raise Invalid(f"tensor {key!r} has no layout")
    if "boxes" in layout:
        return TensorEntry(dtype, shape, None, _parse_boxes(key, layout["boxes"], shape, world))
    mesh = layout.get("mesh")
    if not (type(mesh) is int and 0 <= mesh < len(meshes)):
        raise Invalid(f"tensor {key!r} names mesh {mesh!r}")
    placements_doc = layout.get("placements")
    if not (isinstance(placements_doc, list) and len(placements_doc) == len(meshes[mesh].shape)):
        raise Invalid(f"tensor {key!r} needs one placement per dimension of mesh {mesh}")
    placements = []
    for p in placements_doc:
        if not (p == "R" or (isinstance(p, str) and _SHARD.fullmatch(p) is not None
                             and int(p[1:]) < len(shape))):
            raise Invalid(f"tensor {key!r} has placement {p!r} (\"R\" or \"S<dim>\" of its "
                          f"{len(shape)} dims)")
        placements.append(None if p == "R" else int(p[1:]))
    return TensorEntry(dtype, shape, None, MeshLayout(meshes[mesh], tuple(placements)))


def _parse_boxes(key: str, boxes_doc: Any, shape: tuple[int, ...], world: int) -> BoxLayout:
    """An explicit layout: each box with the rank that wrote it; together they tile."""
    if not isinstance(boxes_doc, list):
        raise Invalid(f"boxes of {key!r} must be a list")
    boxes = []
    for i, b in enumerate(boxes_doc):
        if not (isinstance(b, list) and len(b) == 3):
            raise Invalid(f"box {i} of {key!r} must be [offsets, shape, writer]")
        offsets, box = dims(b[0], f"box {i}", key), dims(b[1], f"box {i}", key)
        if not len(offsets) == len(box) == len(shape):
            raise Invalid(f"box {i} of {key!r} has the wrong rank")
        for o, n, size in zip(offsets, box, shape):
            if o + n > size:
                raise Invalid(f"box {i} of {key!r} lies outside the tensor's shape "
                              f"{list(shape)}")
        writer = b[2]
        if type(writer) is not int or not 0 <= writer <= world - 1:
            raise Invalid(f"writer of box {i} of {key!r} must be an integer in "
                          f"[0, {world - 1}]")
        boxes.append((offsets, box, writer))
    if not (len(boxes) == 1 and boxes[0][1] == shape and not any(boxes[0][0])):
        # (one box that is the whole tensor, such as a rank's RNG state, tiles it)
        check_tiling(key, shape, [(o, s) for o, s, _ in boxes])
    return BoxLayout(tuple(boxes))


def _parse_tables(doc: Any, world: int, files: dict[str, int]) -> list[tuple[str, int, str]]:
    check(isinstance(doc, list) and len(doc) == world,
          f"tables must list one table per rank ({world})")
    tables = []
    for r, t in enumerate(doc):
        check(isinstance(t, list) and len(t) == 3,
              f"table of rank {r} must be [file, size, digest]")
        name = file_name(t[0], f"table of rank {r}")
        size = bounded_int(t[1], f"size of rank {r}'s table", hi=MAX_TABLE_BYTES)
        check(is_digest(t[2]), f"table of rank {r} has a malformed digest")
        check(name not in files, f"table of rank {r} is also listed as a data file")
        tables.append((name, size, t[2]))
    check(len({t[0] for t in tables}) == len(tables), "two ranks name the same table")
    return tables


def _parse_refs(doc: Any, step: int) -> dict[tuple[int, str], int]:
    check(isinstance(doc, dict), "refs must be an object")
    refs = {}
    for s, names in doc.items():
        check(is_decimal(s) and int(s) < step,
              f"refs names step {s!r}, which is not an earlier step")
        check(isinstance(names, dict), f"refs of step {s} must be an object")
        for name, size in names.items():
            refs[(int(s), file_name(name))] = bounded_int(size, f"size of {name}")
    return refs


def _parse_tensor(key: str, doc: Any, step: int, files: dict[str, int]) -> TensorEntry:
    """A format-1 tensor: dtype, shape and every chunk, which must tile it."""
    dtype, shape = _dtype_and_shape(key, doc)
    itemsize = DTYPES[dtype].itemsize
    chunks_doc = doc.get("chunks")
    if not isinstance(chunks_doc, list):
        raise Invalid(f"chunks of {key!r} must be a list")
    chunks = []
    for i, c in enumerate(chunks_doc):
        try:
            chunks.append(_parse_chunk(c, shape, itemsize, step, files))
        except Invalid as e:
            raise Invalid(f"chunk {i} of {key!r} {e}") from None
    if not (len(chunks) == 1 and chunks[0].shape == shape and not any(chunks[0].offsets)):
        check_tiling(key, shape, chunks)  # (one chunk that is the whole tensor tiles it)
    return TensorEntry(dtype, shape, tuple(chunks))


def _parse_chunk(c: Any, shape: tuple[int, ...], itemsize: int, step: int,
                 files: dict[str, int]) -> Chunk:
    """One chunk of a tensor; the caller prefixes messages with the chunk."""
    if not isinstance(c, dict):
        raise Invalid("must be an object")
    offsets = dims(c.get("offsets"), "offsets")
    box = dims(c.get("shape"), "shape")
    if box != shape or any(offsets):  # (a chunk that is the whole tensor lies inside it)
        if not len(offsets) == len(shape) == len(box):
            raise Invalid("has the wrong rank")
        for o, b, s in zip(offsets, box, shape):
            if o + b > s:
                raise Invalid(f"lies outside the tensor's shape {list(shape)}")
    elif len(offsets) != len(shape):
        raise Invalid("has the wrong rank")
    codec = c.get("codec", "raw")
    if not (isinstance(codec, str) and codec in CODECS):
        raise Invalid(f"has unknown codec {codec!r}")
    length = c.get("length")
    if type(length) is not int or not 0 <= length <= MAX_BYTES:
        raise Invalid(f"length must be an integer in [0, {MAX_BYTES}]")
    raw_len = math.prod(box) * itemsize
    if codec == "raw":
        if length != raw_len:
            raise Invalid(f"has length {length} but its box holds {raw_len} bytes")
    elif not (length <= raw_len + 1024 and raw_len <= (length + 64) * MAX_ZSTD_RATIO):
        raise Invalid(f"claims {raw_len} bytes compressed into {length}: no zstd frame "
                      "expands that much")
    start = c.get("start")
    if type(start) is not int or not 0 <= start <= MAX_BYTES:
        raise Invalid(f"start must be an integer in [0, {MAX_BYTES}]")
    ref = c.get("step")
    fname = c.get("file")
    if ref is None:
        # The keys of `files` are validated file names: one of them needs no second check.
        if not (isinstance(fname, str) and fname in files):
            raise Invalid(f"names {file_name(fname, 'file')!r}, which is not among files")
        if start + length > files[fname]:
            raise Invalid(f"ends at byte {start + length}, past the end of {fname!r}")
    else:
        fname = file_name(fname, "file")
        if not (type(ref) is int and 0 <= ref < step):
            raise Invalid(f"refers to step {ref!r}, which is not an earlier step")
    if not is_digest(c.get("digest")):
        raise Invalid("has a malformed digest")
    return Chunk(offsets, box, fname, start, length, c["digest"], codec, ref)
