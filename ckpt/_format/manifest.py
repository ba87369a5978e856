"""The manifest: what a committed step holds, as typed dataclasses <-> JSON.

Everything read from disk is validated here, in one place, before any path, size or shape in
it is used: names are plain file names (no ``/``, no ``..``), sizes are bounded, every chunk
lies inside its tensor, and a tensor's chunks tile it exactly (no gap, no overlap).

World-size independence: a tensor is described by its global shape and each chunk by its box
(offsets and shape) in the global tensor, so any number of ranks can read any slice.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import gc
import json
import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ckpt.errors import CorruptCheckpointError, UnsupportedValueError
from ckpt._format.layout import BoxLayout, Mesh, MeshLayout

FORMAT_NAME = "ckpt"
FORMAT_VERSION = 1  # one JSON manifest holding every chunk (small worlds)
FORMAT_VERSION_TABLES = 2  # a top-level manifest plus one chunk table per rank
# Format 2: a per-rank item's "per_rank" is this marker; each rank's tree is in its table.
PER_RANK_IN_TABLES = "tables"
MAX_TABLE_BYTES = 1 << 30
MANIFEST_NAME = "manifest.json"
STEP_PREFIX = "step-"
MAX_MANIFEST_BYTES = 1 << 30
MAX_BYTES = 1 << 50  # 1 PiB: anything larger in a manifest is corruption, not a model
MAX_DIMS = 64
MAX_DEPTH = 200  # nesting of item trees and metadata (restore decodes them recursively)
# zstd's densest frame (RLE blocks: 4 bytes per 128 KiB) expands at most about 32768x; a
# compressed chunk that claims more is corrupt, whatever its frame header says, and must not
# make a reader allocate its claimed size.
MAX_ZSTD_RATIO = 1 << 15
MAX_TILING_CORNERS = 1 << 22  # bound of the tiling check's work (see _check_tiling)
ITEM_KINDS = ("module", "stateful", "tensor", "value")

# Patterns end in \Z, not $ (which also matches before a final newline), and spell digits
# [0-9] (\d also matches other scripts' digits, which int() reads).
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}\Z")
_DIGEST = re.compile(r"[0-9a-f]{16}\Z")
_SHARD = re.compile(r"S(0|[1-9][0-9]?)")  # a placement that shards a dimension
# Only the name step_dir() gives a step: another spelling of its number (step-000000005,
# step-5, other digits) would name the same step twice, and the collector would take the
# stray directory's state (no manifest) for the real step's and delete it.
STEP_DIR = re.compile(r"step-([0-9]{8}|[1-9][0-9]{8,})\Z")

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
        "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
        "float8_e8m0fnu", "float4_e2m1fn_x2",
    )
    if hasattr(torch, name)
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
CODECS = ("raw", "zstd", "zstd-grouped")


def step_dir(step: int) -> str:
    """The directory name of a committed step."""
    return f"{STEP_PREFIX}{step:08d}"


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise UnsupportedValueError(
            f"tensors of dtype {dtype} cannot be checkpointed (quantized and other "
            "non-plain dtypes): dequantize or convert them first") from None


@dataclass(frozen=True)
class Chunk:
    """A box of a tensor stored as one byte range of one data file.

    ``step`` is None when the file is in this step's directory, or the committed step whose
    directory holds it (an incremental save reusing an unchanged chunk).
    """

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    file: str
    start: int
    length: int
    digest: str
    codec: str = "raw"
    step: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class TensorEntry:
    """A tensor's global shape, dtype and the chunks that tile it.

    In a format-2 step the chunks live in the ranks' tables: ``layout`` says which rank
    wrote which box, and ``chunks`` reads every table on first use (tools that look at a
    whole step); a load asks :func:`ckpt._shared.sharding.overlapping`, which reads only the tables
    of the ranks that wrote the boxes it needs.
    """

    __slots__ = ("dtype", "shape", "layout", "_chunks", "_tables", "_key", "_index")

    def __init__(self, dtype: str, shape: tuple[int, ...], chunks: tuple[Chunk, ...] | None = None,
                 layout: Any = None) -> None:
        self.dtype = dtype
        self.shape = tuple(shape)
        self.layout = layout
        self._chunks = None if chunks is None else tuple(chunks)
        self._tables: Any = None  # ranktable.Tables of a format-2 step, once bound
        self._key: str | None = None
        self._index: Any = None  # sharding's read index, built on first use

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        if self._chunks is None:
            if self._tables is None:
                raise RuntimeError("this manifest's chunks live in rank tables it was not "
                                   "bound to (read it with ckpt._step.integrity.read_manifest)")
            self._chunks = self._tables.all_chunks(self._key)
        return self._chunks

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorEntry):
            return NotImplemented
        return (self.dtype, self.shape, self.layout, self.chunks) == (
            other.dtype, other.shape, other.layout, other.chunks)

    def __repr__(self) -> str:
        chunks = "unread" if self._chunks is None else f"{len(self._chunks)} chunks"
        return f"TensorEntry({self.dtype}, {list(self.shape)}, {chunks})"


@dataclass
class Manifest:
    """One committed step. ``items`` maps each top-level state key to how it was saved."""

    step: int
    world_size: int
    created: float
    tensors: dict[str, TensorEntry]
    aliases: dict[str, str]
    items: dict[str, dict[str, Any]]
    files: dict[str, int]
    metadata: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    # Format 2 only: each rank's table (file name, size, digest), indexed by rank, and the
    # files of earlier steps its reused chunks live in ((step, name) -> bytes they need).
    tables: list[tuple[str, int, str]] = field(default_factory=list)
    refs: dict[tuple[int, str], int] = field(default_factory=dict)

    def to_json(self) -> bytes:
        with paused_gc():  # a document of many small objects (see paused_gc)
            return self._to_json()

    def _to_json(self) -> bytes:
        # Built by hand: dataclasses.asdict deep-copies every field of millions of chunks and
        # was the slowest part of a large job's commit (benchmarks/bench_scale.py).
        doc = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("tables", "refs")}
        if self.format_version == FORMAT_VERSION:
            doc["tensors"] = {key: {"dtype": e.dtype, "shape": list(e.shape),
                                    "chunks": [chunk_doc(c) for c in e.chunks]}
                              for key, e in self.tensors.items()}
        else:
            meshes: dict[Any, int] = {}
            doc["tensors"] = {key: {"dtype": e.dtype, "shape": list(e.shape),
                                    "layout": _layout_doc(e.layout, meshes)}
                              for key, e in self.tensors.items()}
            doc["meshes"] = [{"shape": list(m.shape), "ranks": list(m.ranks)} for m in meshes]
            doc["tables"] = [list(t) for t in self.tables]
            refs: dict[str, dict[str, int]] = {}
            for (step, name), size in sorted(self.refs.items()):
                refs.setdefault(str(step), {})[name] = size
            doc["refs"] = refs
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()

    def bind(self, read: Any, where: str) -> Manifest:
        """Let a format-2 manifest read its rank tables: ``read(name)`` returns the bytes of
        a file of the step's directory; ``where`` names it in messages. Returns self."""
        if self.format_version == FORMAT_VERSION_TABLES:
            from ckpt._format.ranktable import Tables

            tables = Tables(self, read, where)
            for key, entry in self.tensors.items():
                entry._tables, entry._key = tables, key
            for name in self.in_tables():
                # rank r's tree is read from rank r's table when asked for
                self.items[name] = {**self.items[name], "per_rank": tables.values_of(name)}
        return self

    def table_problems(self) -> list[CorruptCheckpointError]:
        """Format 2: read and validate every rank table; one error per damaged table (each
        naming its file), or one saying what the tables together fail to cover. Empty when
        all is well, and for format 1. (What ``ckpt verify`` lists; a load stops at the
        first bad table it needs.)"""
        tables = next((e._tables for e in self.tensors.values() if e._tables is not None),
                      None)
        return [] if tables is None else tables.problems()

    def in_tables(self) -> set[str]:
        """Format 2: the per-rank items whose trees lie in the rank tables (each rank's in
        its own table) rather than in this manifest."""
        return {name for name, item in self.items.items()
                if item.get("per_rank") == PER_RANK_IN_TABLES
                or getattr(item.get("per_rank"), "in_tables", False)}

    def own_files(self) -> dict[str, int]:
        """Every file of this step's own directory: data files and (format 2) rank tables."""
        return {**self.files, **{name: size for name, size, _ in self.tables}}

    def referenced_files(self) -> set[tuple[int, str]]:
        """(step, file) of every earlier step's file this step's chunks use."""
        if self.format_version == FORMAT_VERSION_TABLES:
            return set(self.refs)
        return {(c.step, c.file) for e in self.tensors.values() for c in e.chunks
                if c.step is not None}

    @classmethod
    def from_json(cls, raw: bytes, *, where: str) -> Manifest:
        """Parse and validate a manifest; raises CorruptCheckpointError naming ``where``."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"{where}: manifest is {len(raw)} bytes", path=where)
        with paused_gc():
            return cls._from_json(raw, where)

    @classmethod
    def _from_json(cls, raw: bytes, where: str) -> Manifest:
        try:
            doc = json.loads(raw)
        except RecursionError:
            raise CorruptCheckpointError(
                f"{where}: manifest nests deeper than Python can parse; the step cannot be "
                "loaded", path=where) from None
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(
                f"{where}: manifest is not valid JSON ({e}); the step cannot be loaded",
                path=where,
            ) from e
        try:
            return _parse(doc)
        except _Invalid as e:
            raise CorruptCheckpointError(
                f"{where}: invalid manifest: {e}; the step cannot be loaded", path=where
            ) from None

    def resolve(self, key: str) -> str:
        """The stored tensor behind ``key`` (following an alias)."""
        return self.aliases.get(key, key)


def chunk_doc(c: Chunk) -> dict[str, Any]:
    """A chunk as the manifest stores it (``step`` only for a chunk of an earlier step)."""
    doc = {"offsets": list(c.offsets), "shape": list(c.shape), "file": c.file,
           "start": c.start, "length": c.length, "digest": c.digest, "codec": c.codec}
    if c.step is not None:
        doc["step"] = c.step
    return doc


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while building many small objects that form no
    cycles (a parsed manifest, a batch of table rows): each allocation burst otherwise sets
    off full passes that scan every object of the process, which in a large job's process
    cost more than the work itself (benchmarks/bench_scale.py). Nests; restores the state."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Invalid(Exception):
    pass


Invalid = _Invalid  # raised by validation helpers; callers turn it into CorruptCheckpointError


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise _Invalid(message)


def _int(value: Any, what: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
    if type(value) is int and lo <= value <= hi:
        return value
    raise _Invalid(f"{what} must be an integer in [{lo}, {hi}]")


def _dims(value: Any, what: str, of: str | None = None) -> tuple[int, ...]:
    """A validated box shape or offsets; messages name ``what`` (``of`` key ``of``), built
    only on failure."""
    if isinstance(value, list) and len(value) <= MAX_DIMS:
        for v in value:  # a loop, not all(<generator>): this runs for every chunk
            if type(v) is not int or not 0 <= v <= MAX_BYTES:
                break
        else:
            return tuple(value)
        raise _Invalid(f"{_named(what, of)} must be a list of integers in [0, {MAX_BYTES}]")
    raise _Invalid(f"{_named(what, of)} must be a list of at most {MAX_DIMS} ints")


def _named(what: str, of: str | None) -> str:
    return what if of is None else f"{what} of {of!r}"


def file_name(value: Any, what: str = "file") -> str:
    """A validated plain file name: no directories, no '..', bounded length."""
    if isinstance(value, str) and _FILE_NAME.match(value) and ".." not in value:
        return value
    raise _Invalid(f"{what} {value!r} is not a plain file name")


def is_decimal(value: Any) -> bool:
    """A string of ASCII digits, as ckpt writes a number used as a key (a step of ``refs``,
    a rank of ``per_rank``). str.isdigit() also accepts other scripts' digits and
    superscripts, which int() reads as another number or refuses with a ValueError."""
    return isinstance(value, str) and value.isascii() and value.isdigit()


def _parse(doc: Any) -> Manifest:
    _check(isinstance(doc, dict), "top level must be an object")
    _check(doc.get("format") == FORMAT_NAME, f"format must be {FORMAT_NAME!r}")
    version = doc.get("format_version")
    _check(version in (FORMAT_VERSION, FORMAT_VERSION_TABLES),
           f"format_version {version!r} is not supported (this ckpt reads "
           f"{FORMAT_VERSION} and {FORMAT_VERSION_TABLES})")
    step = _int(doc.get("step"), "step", hi=2**62)
    world = _int(doc.get("world_size"), "world_size", lo=1, hi=2**24)
    created = doc.get("created")
    # Not required finite: it only labels the step (`ckpt ls` shows a bad one as invalid).
    _check(isinstance(created, (int, float)) and not isinstance(created, bool),
           "created must be a number")
    files_doc = doc.get("files")
    _check(isinstance(files_doc, dict), "files must be an object")
    files = {file_name(k): _int(v, f"size of {k}") for k, v in files_doc.items()}
    tensors_doc = doc.get("tensors")
    _check(isinstance(tensors_doc, dict), "tensors must be an object")
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
    _check(isinstance(aliases, dict), "aliases must be an object")
    for k, v in aliases.items():
        if not (isinstance(v, str) and v in tensors and k not in tensors):
            raise _Invalid(f"alias {k!r} -> {v!r} is dangling")
    items = doc.get("items")
    _check(isinstance(items, dict), "items must be an object")
    for name, item in items.items():
        _check_item(name, item, tensors, aliases, in_tables=version == FORMAT_VERSION_TABLES)
    metadata = doc.get("metadata", {})
    _check(isinstance(metadata, dict), "metadata must be an object")
    _check(_depth(metadata) <= MAX_DEPTH, f"metadata nests deeper than {MAX_DEPTH} levels")
    return Manifest(step=step, world_size=world, created=float(created), tensors=tensors,
                    aliases=aliases, items=items, files=files, metadata=metadata,
                    format_version=version, tables=tables, refs=refs)


def _layout_doc(layout: Any, meshes: dict[Any, int]) -> dict[str, Any]:
    if isinstance(layout, BoxLayout):
        return {"boxes": [[list(o), list(s), w] for o, s, w in layout.boxes]}
    index = meshes.setdefault(layout.mesh, len(meshes))
    return {"mesh": index, "placements": ["R" if d is None else f"S{d}"
                                          for d in layout.placements]}


def _parse_meshes(doc: Any, world: int) -> list:
    _check(isinstance(doc, list) and len(doc) <= 4096, "meshes must be a list")
    meshes = []
    for i, m in enumerate(doc):
        _check(isinstance(m, dict), f"mesh {i} must be an object")
        shape = _dims(m.get("shape"), f"shape of mesh {i}")
        _check(bool(shape) and all(shape) and math.prod(shape) <= world,
               f"mesh {i} has shape {list(shape)}, which does not fit {world} ranks")
        ranks = m.get("ranks")
        _check(isinstance(ranks, list) and len(ranks) == math.prod(shape)
               and all(type(r) is int and 0 <= r < world for r in ranks)
               and len(set(ranks)) == len(ranks),
               f"mesh {i}: ranks must list {math.prod(shape)} distinct ranks below {world}")
        meshes.append(Mesh(shape, tuple(ranks)))
    return meshes


def _parse_laid_out(key: str, doc: Any, meshes: list, world: int) -> TensorEntry:
    """A format-2 tensor: dtype, shape and the layout that says which rank wrote which box.
    (Messages are built only on failure: this runs once per tensor and box.)"""
    if not isinstance(doc, dict):
        raise _Invalid(f"tensor {key!r} must be an object")
    dtype = doc.get("dtype")
    if not (isinstance(dtype, str) and dtype in DTYPES):
        raise _Invalid(f"tensor {key!r} has unknown dtype {dtype!r}")
    shape = _dims(doc.get("shape"), "shape", key)
    if math.prod(shape) * DTYPES[dtype].itemsize > MAX_BYTES:
        raise _Invalid(f"tensor {key!r} is absurdly large")
    layout = doc.get("layout")
    if not isinstance(layout, dict):
        raise _Invalid(f"tensor {key!r} has no layout")
    if "boxes" in layout:
        boxes_doc = layout["boxes"]
        if not isinstance(boxes_doc, list):
            raise _Invalid(f"boxes of {key!r} must be a list")
        boxes = []
        for i, b in enumerate(boxes_doc):
            if not (isinstance(b, list) and len(b) == 3):
                raise _Invalid(f"box {i} of {key!r} must be [offsets, shape, writer]")
            offsets, box = _dims(b[0], f"box {i}", key), _dims(b[1], f"box {i}", key)
            if not len(offsets) == len(box) == len(shape):
                raise _Invalid(f"box {i} of {key!r} has the wrong rank")
            for o, n, size in zip(offsets, box, shape):
                if o + n > size:
                    raise _Invalid(f"box {i} of {key!r} lies outside the tensor's shape "
                                   f"{list(shape)}")
            writer = b[2]
            if type(writer) is not int or not 0 <= writer <= world - 1:
                raise _Invalid(f"writer of box {i} of {key!r} must be an integer in "
                               f"[0, {world - 1}]")
            boxes.append((offsets, box, writer))
        if not (len(boxes) == 1 and boxes[0][1] == shape and not any(boxes[0][0])):
            # (one box that is the whole tensor, such as a rank's RNG state, tiles it)
            _check_tiling(key, shape, [(o, s) for o, s, _ in boxes])
        return TensorEntry(dtype, shape, None, BoxLayout(tuple(boxes)))
    mesh = layout.get("mesh")
    if not (type(mesh) is int and 0 <= mesh < len(meshes)):
        raise _Invalid(f"tensor {key!r} names mesh {mesh!r}")
    placements_doc = layout.get("placements")
    if not (isinstance(placements_doc, list) and len(placements_doc) == len(meshes[mesh].shape)):
        raise _Invalid(f"tensor {key!r} needs one placement per dimension of mesh {mesh}")
    placements = []
    for p in placements_doc:
        if not (p == "R" or (isinstance(p, str) and _SHARD.fullmatch(p) is not None
                             and int(p[1:]) < len(shape))):
            raise _Invalid(f"tensor {key!r} has placement {p!r} (\"R\" or \"S<dim>\" of its "
                           f"{len(shape)} dims)")
        placements.append(None if p == "R" else int(p[1:]))
    return TensorEntry(dtype, shape, None, MeshLayout(meshes[mesh], tuple(placements)))


def _parse_tables(doc: Any, world: int, files: dict[str, int]) -> list[tuple[str, int, str]]:
    _check(isinstance(doc, list) and len(doc) == world,
           f"tables must list one table per rank ({world})")
    tables = []
    for r, t in enumerate(doc):
        _check(isinstance(t, list) and len(t) == 3, f"table of rank {r} must be [file, size, digest]")
        name = file_name(t[0], f"table of rank {r}")
        size = _int(t[1], f"size of rank {r}'s table", hi=MAX_TABLE_BYTES)
        _check(isinstance(t[2], str) and _DIGEST.match(t[2]) is not None,
               f"table of rank {r} has a malformed digest")
        _check(name not in files, f"table of rank {r} is also listed as a data file")
        tables.append((name, size, t[2]))
    _check(len({t[0] for t in tables}) == len(tables), "two ranks name the same table")
    return tables


def _parse_refs(doc: Any, step: int) -> dict[tuple[int, str], int]:
    _check(isinstance(doc, dict), "refs must be an object")
    refs = {}
    for s, names in doc.items():
        _check(is_decimal(s) and int(s) < step,
               f"refs names step {s!r}, which is not an earlier step")
        _check(isinstance(names, dict), f"refs of step {s} must be an object")
        for name, size in names.items():
            refs[(int(s), file_name(name))] = _int(size, f"size of {name}")
    return refs


def _parse_tensor(key: str, doc: Any, step: int, files: dict[str, int]) -> TensorEntry:
    # Messages are built only on failure: this runs once per tensor of a manifest.
    if not isinstance(doc, dict):
        raise _Invalid(f"tensor {key!r} must be an object")
    dtype = doc.get("dtype")
    if not (isinstance(dtype, str) and dtype in DTYPES):
        raise _Invalid(f"tensor {key!r} has unknown dtype {dtype!r}")
    shape = _dims(doc.get("shape"), "shape", key)
    itemsize = DTYPES[dtype].itemsize
    if math.prod(shape) * itemsize > MAX_BYTES:
        raise _Invalid(f"tensor {key!r} is absurdly large")
    chunks_doc = doc.get("chunks")
    if not isinstance(chunks_doc, list):
        raise _Invalid(f"chunks of {key!r} must be a list")
    chunks = []
    for i, c in enumerate(chunks_doc):
        try:
            chunks.append(_parse_chunk(c, shape, itemsize, step, files))
        except _Invalid as e:
            raise _Invalid(f"chunk {i} of {key!r} {e}") from None
    if not (len(chunks) == 1 and chunks[0].shape == shape and not any(chunks[0].offsets)):
        _check_tiling(key, shape, chunks)  # (one chunk that is the whole tensor tiles it)
    return TensorEntry(dtype, shape, tuple(chunks))


def _parse_chunk(c: Any, shape: tuple[int, ...], itemsize: int, step: int,
                 files: dict[str, int]) -> Chunk:
    """One chunk of a tensor; messages are built only on failure (manifests of large jobs
    hold millions of chunks) and are prefixed with the chunk by the caller."""
    if not isinstance(c, dict):
        raise _Invalid("must be an object")
    offsets = _dims(c.get("offsets"), "offsets")
    box = _dims(c.get("shape"), "shape")
    if box != shape or any(offsets):  # (a chunk that is the whole tensor lies inside it)
        if not len(offsets) == len(shape) == len(box):
            raise _Invalid("has the wrong rank")
        for o, b, s in zip(offsets, box, shape):
            if o + b > s:
                raise _Invalid(f"lies outside the tensor's shape {list(shape)}")
    elif len(offsets) != len(shape):
        raise _Invalid("has the wrong rank")
    codec = c.get("codec", "raw")
    if not (isinstance(codec, str) and codec in CODECS):
        raise _Invalid(f"has unknown codec {codec!r}")
    length = c.get("length")
    if type(length) is not int or not 0 <= length <= MAX_BYTES:
        raise _Invalid(f"length must be an integer in [0, {MAX_BYTES}]")
    raw_len = math.prod(box) * itemsize
    if codec == "raw":
        if length != raw_len:
            raise _Invalid(f"has length {length} but its box holds {raw_len} bytes")
    elif not (length <= raw_len + 1024 and raw_len <= (length + 64) * MAX_ZSTD_RATIO):
        raise _Invalid(f"claims {raw_len} bytes compressed into {length}: no zstd frame "
                       "expands that much")
    start = c.get("start")
    if type(start) is not int or not 0 <= start <= MAX_BYTES:
        raise _Invalid(f"start must be an integer in [0, {MAX_BYTES}]")
    ref = c.get("step")
    fname = c.get("file")
    if ref is None:
        # The keys of `files` are validated file names: one of them needs no second check.
        if not (isinstance(fname, str) and fname in files):
            raise _Invalid(f"names {file_name(fname, 'file')!r}, which is not among files")
        if start + length > files[fname]:
            raise _Invalid(f"ends at byte {start + length}, past the end of {fname!r}")
    else:
        fname = file_name(fname, "file")
        if not (type(ref) is int and 0 <= ref < step):
            raise _Invalid(f"refers to step {ref!r}, which is not an earlier step")
    digest = c.get("digest")
    if not (isinstance(digest, str) and _DIGEST.match(digest)):
        raise _Invalid("has a malformed digest")
    return Chunk(offsets, box, fname, start, length, digest, codec, ref)


def _check_tiling(key: str, shape: tuple[int, ...], items: list) -> None:
    """The boxes (chunks, or (offsets, shape) pairs) cover the tensor exactly: every element
    lies in exactly one.

    Linear in the number of chunks: the sum of the boxes' indicator functions equals the
    tensor's indicator iff their mixed finite differences are equal, and the difference of a
    box's indicator is +-1 at its 2^d corners (sign: -1 per upper bound) and 0 elsewhere. So
    the chunks tile the tensor iff their corner weights, summed per point, cancel everywhere
    except at the tensor's own corners. Dimensions no chunk splits are left out (each chunk
    spans them whole), which keeps d at the one to three dimensions real layouts split.
    """
    all_boxes = [(c.offsets, c.shape) if isinstance(c, Chunk) else c for c in items]
    if len(all_boxes) == 1 and all_boxes[0][1] == shape and not any(all_boxes[0][0]):
        return  # one box that is the whole tensor (most tensors): it tiles it exactly
    total = math.prod(shape)
    covered = sum(math.prod(b) for _, b in all_boxes)
    _check(covered == total, f"the chunks of {key!r} cover {covered} of {total} elements"
           + (" (some overlap)" if covered > total else " (a gap)"))
    boxes = [(o, b) for o, b in all_boxes if math.prod(b)]
    split = [d for d, size in enumerate(shape)
             if any(o[d] != 0 or b[d] != size for o, b in boxes)]
    _check(len(boxes) << len(split) <= MAX_TILING_CORNERS,
           f"the chunks of {key!r} split {len(split)} dimensions into {len(boxes)} boxes, "
           "more than ckpt ever writes")
    weights: Counter = Counter()
    for offsets, box in boxes:
        corners = [((), 1)]
        for d in split:
            lo, hi = offsets[d], offsets[d] + box[d]
            corners = [(p + (lo,), w) for p, w in corners] + [(p + (hi,), -w) for p, w in corners]
        for point, w in corners:
            weights[point] += w
    expected = {}
    if boxes:
        corners = [((), 1)]
        for d in split:
            corners = [(p + (0,), w) for p, w in corners] + [(p + (shape[d],), -w)
                                                            for p, w in corners]
        expected = dict(corners)
    wrong = next((p for p, w in weights.items() if w != expected.get(p, 0)), None)
    _check(wrong is None, f"chunks of {key!r} overlap near {_at(wrong, split, shape)} (and "
           "leave a gap elsewhere)")


def _at(point: tuple[int, ...] | None, split: list[int], shape: tuple[int, ...]) -> list[int]:
    full = [0] * len(shape)
    for d, v in zip(split, point or ()):
        full[d] = v
    return full


def _depth(doc: Any) -> int:
    """How deeply ``doc`` (parsed JSON) nests lists and objects, without recursing."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (list, dict)):
            deepest = max(deepest, depth)
            if depth > MAX_DEPTH:
                break
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict)
                                                  else node))
    return deepest


def _check_item(name: Any, item: Any, tensors: dict[str, TensorEntry],
                aliases: dict[str, str], in_tables: bool = False) -> None:
    """An item is ``{"kind", "tree"}`` or ``{"kind", "per_rank": {rank: tree}}``, and its
    trees are well formed (see :func:`check_tree`)."""
    what = f"item {name!r}"
    _check(isinstance(item, dict), f"{what} must be an object")
    kind = item.get("kind")
    _check(isinstance(kind, str) and kind in ITEM_KINDS,
           f"{what} has kind {kind!r}, not one of {list(ITEM_KINDS)}")
    if in_tables and item.get("per_rank") == PER_RANK_IN_TABLES:
        return  # each rank's tree is in its rank table, checked when the table is read
    if "per_rank" in item:
        per_rank = item["per_rank"]
        _check(isinstance(per_rank, dict) and bool(per_rank)
               and all(is_decimal(r) for r in per_rank),
               f"{what}: per_rank must map rank numbers to trees")
        trees = list(per_rank.values())
    else:
        _check("tree" in item, f"{what} has neither a tree nor per_rank trees")
        trees = [item["tree"]]
    for tree in trees:
        check_item_tree(what, kind, tree, tensors, aliases)


def check_item_tree(what: str, kind: str, tree: Any, tensors: dict[str, TensorEntry],
                    aliases: dict[str, str]) -> None:
    """One tree of an item of ``kind`` is well formed (raises _Invalid naming ``what``)."""
    check_tree(tree, tensors, aliases, what)
    if kind == "tensor":
        _check(isinstance(tree, dict) and len(tree) == 1 and "__tensor__" in tree,
               f"{what} is a tensor item, but its tree is not a tensor")
    if kind == "module":
        _check(isinstance(tree, dict), f"{what}: a module's state must be an object")


_TAGGED = ("__tensor__", "__ndarray__", "__tuple__", "__dict__", "__float__", "__bytes__",
           "__pickle__")
_NON_FINITE = ("inf", "-inf", "nan")


def check_tree(tree: Any, tensors: dict[str, TensorEntry], aliases: dict[str, str],
               what: str = "tree") -> None:
    """A JSON tree of ckpt._shared.state's encoding is well formed: bounded depth, tags with bodies
    of the right type, every tensor it names stored. Iterative: a hostile tree cannot
    exhaust the stack. Raises _Invalid (parse) for the caller to turn into corruption."""
    # Messages are built only on failure: a state's tree has a leaf per tensor.
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, list):
            if depth > MAX_DEPTH:
                raise _Invalid(f"{what} nests deeper than {MAX_DEPTH} levels")
            stack.extend((v, depth + 1) for v in node)
            continue
        if not isinstance(node, dict):
            continue
        if depth > MAX_DEPTH:
            raise _Invalid(f"{what} nests deeper than {MAX_DEPTH} levels")
        if len(node) != 1 or next(iter(node)) not in _TAGGED:
            stack.extend((v, depth + 1) for v in node.values())
            continue
        (tag, body), = node.items()
        if tag == "__tensor__" or tag == "__ndarray__":
            if not (isinstance(body, str) and (body in tensors or body in aliases)):
                raise _Invalid(f"{what} refers to tensor {body!r}, which the manifest does "
                               "not hold")
            if tag == "__ndarray__":
                entry = tensors[aliases.get(body, body)]
                _check(entry.dtype in _NUMPY_DTYPES,
                       f"{what}: array {body!r} has dtype {entry.dtype}, which numpy lacks")
        elif tag == "__tuple__":
            _check(isinstance(body, list), f"{what}: a tuple's body must be a list")
            stack.extend((v, depth + 1) for v in body)
        elif tag == "__dict__":
            _check(isinstance(body, list) and all(isinstance(p, list) and len(p) == 2
                                                  for p in body),
                   f"{what}: a dict's body must be a list of [key, value] pairs")
            stack.extend((v, depth + 2) for p in body for v in p)
            for k, _ in body:
                if not (k is None or isinstance(k, (bool, int, float, str))
                        or _is_hashable_tag(k)):
                    raise _Invalid(f"{what}: dict key {str(k)[:40]!r} cannot be a key")
        elif tag == "__float__":
            _check(body in _NON_FINITE, f"{what}: {str(body)[:40]!r} is not a non-finite float")
        elif tag == "__bytes__":
            _check(isinstance(body, str) and _is_base64(body),
                   f"{what}: a bytes value must be base64 text")
        else:  # __pickle__: loaded only with allow_pickle (checked when loading)
            _check(isinstance(body, str) and _is_base64(body),
                   f"{what}: a pickled value must be base64 text")


_NUMPY_DTYPES = {"float64", "float32", "float16", "complex128", "complex64", "int64", "int32",
                 "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool"}


def _is_hashable_tag(key: Any, depth: int = 0) -> bool:
    """A dict key saved as a tagged value: a tuple (of hashables), bytes or a float tag."""
    if not (isinstance(key, dict) and len(key) == 1) or depth > MAX_DEPTH:
        return False
    (tag, body), = key.items()
    if tag == "__tuple__":
        return isinstance(body, list) and all(
            k is None or isinstance(k, (bool, int, float, str)) or _is_hashable_tag(k, depth + 1)
            for k in body)
    return tag in ("__bytes__", "__float__")


def _is_base64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True
