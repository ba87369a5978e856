"""The manifest: what a committed step holds, as typed dataclasses <-> JSON.

Everything read from disk is validated (``ckpt._format.parse``) before any path, size or
shape in it is used. The document carries the digest of its own bytes as its last member
(``ckpt._format.sealed``), checked before it is parsed. A format-2 manifest keeps its chunks in per-rank tables; it reads them
through the :class:`~ckpt._format.entries.RankTables` attached to it (``ckpt._step.tables``
does that for a step on storage).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from ckpt.errors import CorruptCheckpointError
from ckpt._format.bounds import MAX_MANIFEST_BYTES, Invalid
from ckpt._format.entries import Chunk, RankTables, TensorEntry
from ckpt._format.gcpause import paused_gc
from ckpt._format.layout import BoxLayout, Layout
from ckpt._format.names import (FORMAT_NAME, FORMAT_VERSION, FORMAT_VERSION_TABLES,
                                PER_RANK_IN_TABLES)
from ckpt._format.parse import parse_manifest
from ckpt._format.sealed import is_sealed, seal, unseal

# Fields that are not written as they are: rank tables and refs (format 2 only, reshaped),
# and the tables attached after reading.
_SHAPED_FIELDS = ("tables", "refs", "rank_tables")


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
    # Format 2: the rank tables, once attached (see attach).
    rank_tables: RankTables | None = field(default=None, init=False, repr=False, compare=False)

    def to_json(self, tensors_text: str | None = None) -> bytes:
        """The sealed document. ``tensors_text``: format 1's ``tensors`` member, written
        already (from a :class:`TensorsTemplate`); ``self.tensors`` is then not read."""
        with paused_gc():  # a document of many small objects (see paused_gc)
            return self._to_json(tensors_text)

    def _to_json(self, tensors_text: str | None = None) -> bytes:
        # Built by hand: dataclasses.asdict deep-copies every field of millions of chunks,
        # which would be the slowest part of a large job's commit (benchmarks/bench_scale.py).
        doc = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in _SHAPED_FIELDS}
        if self.format_version == FORMAT_VERSION:
            # Each member encoded on its own, the chunks written out as text: the bytes
            # json.dumps gives, in about two thirds of its time (no dict per chunk).
            if tensors_text is None:
                tensors_text = _tensors_text(self.tensors)
            body = ",".join(f"{_encode(k)}:{tensors_text if k == 'tensors' else _encode(v)}"
                            for k, v in doc.items())
            return seal(b"{%s}" % body.encode())
        if tensors_text is not None:
            raise ValueError("tensors_text is format 1's member; this manifest is format 2")
        meshes: dict[Any, int] = {}
        doc["tensors"] = {key: {"dtype": e.dtype, "shape": list(e.shape),
                                "layout": layout_doc(e.layout, meshes)}
                          for key, e in self.tensors.items()}
        doc["meshes"] = [{"shape": list(m.shape), "ranks": list(m.ranks)} for m in meshes]
        doc["tables"] = [list(t) for t in self.tables]
        refs: dict[str, dict[str, int]] = {}
        for (step, name), size in sorted(self.refs.items()):
            refs.setdefault(str(step), {})[name] = size
        doc["refs"] = refs
        return seal(json.dumps(doc, separators=(",", ":"), allow_nan=False).encode())

    @classmethod
    def from_json(cls, raw: bytes, *, where: str) -> Manifest:
        """Check the manifest's own digest, then parse and validate it; raises
        CorruptCheckpointError naming ``where``."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"{where}: manifest is {len(raw)} bytes", path=where)
        with paused_gc():
            return cls._from_json(raw, where)

    @classmethod
    def _from_json(cls, raw: bytes, where: str) -> Manifest:
        try:
            sealed = is_sealed(raw)  # before parsing: damage is named as such
            doc = unseal(json.loads(raw), sealed)
        except Invalid as e:
            raise CorruptCheckpointError(
                f"{where}: damaged manifest: {e}; the step cannot be loaded", path=where
            ) from None
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
            return cls(**parse_manifest(doc))
        except Invalid as e:
            raise CorruptCheckpointError(
                f"{where}: invalid manifest: {e}; the step cannot be loaded", path=where
            ) from None

    def attach(self, tables: RankTables) -> Manifest:
        """Format 2: read chunks and per-rank trees from ``tables`` from now on (rank r's
        tree of a per-rank item from rank r's table, when asked for). Returns self."""
        self.rank_tables = tables
        for key, entry in self.tensors.items():
            entry.attach(tables, key)
        for name in self.in_tables():
            self.items[name] = {**self.items[name], "per_rank": tables.values_of(name)}
        return self

    def table_problems(self) -> list[CorruptCheckpointError]:
        """Format 2: read and validate every rank table; one error per damaged table (each
        naming its file), or one saying what the tables together fail to cover. Empty when
        all is well, and for format 1. (What ``ckpt verify`` lists; a load stops at the
        first bad table it needs.)"""
        return [] if self.rank_tables is None else self.rank_tables.problems()

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


# The encoder of json.dumps(..., separators=(",", ":"), allow_nan=False).
_encode = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
_int = int.__repr__  # an int's JSON text (a float or a numpy integer raises, as json does)
# A string's JSON text, as _encode gives it (json's own C function; anything but a str
# raises TypeError, where _encode would write another JSON type).
_quote = json.encoder.encode_basestring_ascii


def _ints(values: tuple[int, ...]) -> str:
    return ",".join(map(_int, values))


def _chunk_template(c: Chunk) -> str:
    """``chunk_doc(c)`` as compact JSON, a %-format with a hole for its file's and one for
    its digest's JSON text (every other ``%`` doubled)."""
    return ('{"offsets":[%s],"shape":[%s],"file":%%s,"start":%s,"length":%s,"digest":%%s,'
            '"codec":%s%s}' % (_ints(c.offsets), _ints(c.shape), _int(c.start),
                               _int(c.length), _quote(c.codec).replace("%", "%%"),
                               "" if c.step is None else ',"step":' + _int(c.step)))


def _template(tensors: dict[str, TensorEntry]) -> str:
    """Format 1's ``tensors`` member as a %-format whose holes are each chunk's file and
    digest, in order."""
    return "{%s}" % ",".join('%s:{"dtype":%s,"shape":[%s],"chunks":[%s]}' % (
        _quote(key).replace("%", "%%"), _quote(e.dtype).replace("%", "%%"), _ints(e.shape),
        ",".join([_chunk_template(c) for c in e.chunks]))
        for key, e in tensors.items())


class TensorsTemplate:
    """Format 1's ``tensors`` member for one layout, each chunk's file and digest left as
    holes: a memory-tier slab keeps one for its layout (``ckpt/_memory/slabs.py``), and a
    step's member is then its holes filled in, without a chunk object made or compared."""

    def __init__(self, tensors: dict[str, TensorEntry]) -> None:
        """``tensors`` as the manifest holds them (their chunks' files and digests unused)."""
        self._text = _template(tensors)
        self.chunks = sum(len(e.chunks) for e in tensors.values())

    def render(self, file: str, digests: list[str]) -> str:
        """The member with every chunk in ``file`` and ``digests[i]`` the digest of the i-th
        chunk, in the manifest's order (the tensors', each tensor's chunks by offsets)."""
        if len(digests) != self.chunks:
            raise ValueError(f"{len(digests)} digests for {self.chunks} chunks")
        name = _quote(file)
        holes: list[str] = []
        for d in digests:
            holes += (name, _quote(d))
        return self._text % tuple(holes)


# The template of the last format-1 ``tensors`` member written, with its geometry: a job
# saves the same tensors, cut the same way, at every step, and only the chunks' files and
# digests change; filling the holes takes a tenth of writing the text out again. Kept for
# documents of at most this many chunks (the template is about 150 bytes a chunk).
_TEMPLATE_MAX_CHUNKS = 1 << 16
_last_template: tuple[list, str] | None = None


def _tensors_text(tensors: dict[str, TensorEntry]) -> str:
    """Format 1's ``tensors`` member as compact JSON."""
    global _last_template
    geometry: list = []
    holes: list[str] = []
    quoted: dict[str, str] = {}  # a step's chunks name a few files many times
    for key, e in tensors.items():
        geometry += (key, e.dtype, e.shape, len(e.chunks))
        for c in e.chunks:
            geometry.append((c.offsets, c.shape, c.start, c.length, c.codec, c.step))
            file = quoted.get(c.file)
            if file is None:
                file = quoted[c.file] = _quote(c.file)
            holes += (file, _quote(c.digest))
    cached = _last_template  # one read: another thread may replace it meanwhile
    if cached is not None and cached[0] == geometry:
        template = cached[1]
    else:
        template = _template(tensors)
        if len(holes) <= 2 * _TEMPLATE_MAX_CHUNKS:
            _last_template = (geometry, template)
    return template % tuple(holes)


def layout_doc(layout: Layout, meshes: dict[Any, int]) -> dict[str, Any]:
    """A format-2 tensor's layout as the manifest stores it; ``meshes`` numbers the meshes
    (each stored once, in the manifest's ``meshes``)."""
    if isinstance(layout, BoxLayout):
        return {"boxes": [[list(o), list(s), w] for o, s, w in layout.boxes]}
    index = meshes.setdefault(layout.mesh, len(meshes))
    return {"mesh": index, "placements": ["R" if d is None else f"S{d}"
                                          for d in layout.placements]}
