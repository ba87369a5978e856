"""The manifest: what a committed step holds, as typed dataclasses <-> JSON.

Everything read from disk is validated here, in one place, before any path, size or shape in
it is used: names are plain file names (no ``/``, no ``..``), sizes are bounded, every chunk
lies inside its tensor, and a tensor's chunks tile it exactly (no gap, no overlap).

World-size independence: a tensor is described by its global shape and each chunk by its box
(offsets and shape) in the global tensor, so any number of ranks can read any slice.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .errors import CorruptCheckpointError, UnsupportedValueError

FORMAT_NAME = "ckpt"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
STEP_PREFIX = "step-"
MAX_MANIFEST_BYTES = 1 << 30
MAX_BYTES = 1 << 50  # 1 PiB: anything larger in a manifest is corruption, not a model
MAX_DIMS = 64

_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")
_DIGEST = re.compile(r"^[0-9a-f]{16}$")
STEP_DIR = re.compile(r"^step-(\d{8,})$")

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


@dataclass(frozen=True)
class TensorEntry:
    """A tensor's global shape, dtype and the chunks that tile it."""

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize


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

    def to_json(self) -> bytes:
        # Built by hand: dataclasses.asdict deep-copies every field of millions of chunks and
        # was the slowest part of a large job's commit (benchmarks/bench_scale.py).
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        doc["tensors"] = {key: {"dtype": e.dtype, "shape": list(e.shape),
                                "chunks": [chunk_doc(c) for c in e.chunks]}
                          for key, e in self.tensors.items()}
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_json(cls, raw: bytes, *, where: str) -> Manifest:
        """Parse and validate a manifest; raises CorruptCheckpointError naming ``where``."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"{where}: manifest is {len(raw)} bytes", path=where)
        try:
            doc = json.loads(raw)
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


class _Invalid(Exception):
    pass


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise _Invalid(message)


def _int(value: Any, what: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
    _check(type(value) is int and lo <= value <= hi, f"{what} must be an integer in [{lo}, {hi}]")
    return value


def _dims(value: Any, what: str) -> tuple[int, ...]:
    _check(isinstance(value, list) and len(value) <= MAX_DIMS, f"{what} must be a list of ints")
    return tuple(_int(v, what) for v in value)


def file_name(value: Any, what: str = "file") -> str:
    """A validated plain file name: no directories, no '..', bounded length."""
    _check(isinstance(value, str) and bool(_FILE_NAME.match(value)) and ".." not in value,
           f"{what} {value!r} is not a plain file name")
    return value


def _parse(doc: Any) -> Manifest:
    _check(isinstance(doc, dict), "top level must be an object")
    _check(doc.get("format") == FORMAT_NAME, f"format must be {FORMAT_NAME!r}")
    version = doc.get("format_version")
    _check(version == FORMAT_VERSION,
           f"format_version {version!r} is not supported (this ckpt reads {FORMAT_VERSION})")
    step = _int(doc.get("step"), "step", hi=2**62)
    world = _int(doc.get("world_size"), "world_size", lo=1, hi=2**24)
    created = doc.get("created")
    _check(isinstance(created, (int, float)), "created must be a number")
    files_doc = doc.get("files")
    _check(isinstance(files_doc, dict), "files must be an object")
    files = {file_name(k): _int(v, f"size of {k}") for k, v in files_doc.items()}
    tensors_doc = doc.get("tensors")
    _check(isinstance(tensors_doc, dict), "tensors must be an object")
    tensors = {k: _parse_tensor(k, v, step, files) for k, v in tensors_doc.items()}
    aliases = doc.get("aliases", {})
    _check(isinstance(aliases, dict), "aliases must be an object")
    for k, v in aliases.items():
        _check(v in tensors and k not in tensors, f"alias {k!r} -> {v!r} is dangling")
    items = doc.get("items")
    _check(isinstance(items, dict) and all(isinstance(v, dict) for v in items.values()),
           "items must be an object of objects")
    metadata = doc.get("metadata", {})
    _check(isinstance(metadata, dict), "metadata must be an object")
    return Manifest(step=step, world_size=world, created=float(created), tensors=tensors,
                    aliases=aliases, items=items, files=files, metadata=metadata)


def _parse_tensor(key: str, doc: Any, step: int, files: dict[str, int]) -> TensorEntry:
    _check(isinstance(doc, dict), f"tensor {key!r} must be an object")
    dtype = doc.get("dtype")
    _check(dtype in DTYPES, f"tensor {key!r} has unknown dtype {dtype!r}")
    shape = _dims(doc.get("shape"), f"shape of {key!r}")
    itemsize = DTYPES[dtype].itemsize
    _check(math.prod(shape) * itemsize <= MAX_BYTES, f"tensor {key!r} is absurdly large")
    chunks_doc = doc.get("chunks")
    _check(isinstance(chunks_doc, list), f"chunks of {key!r} must be a list")
    chunks = []
    for i, c in enumerate(chunks_doc):
        what = f"chunk {i} of {key!r}"
        _check(isinstance(c, dict), f"{what} must be an object")
        offsets = _dims(c.get("offsets"), f"offsets of {what}")
        box = _dims(c.get("shape"), f"shape of {what}")
        _check(len(offsets) == len(shape) == len(box), f"{what} has the wrong rank")
        _check(all(o + b <= s for o, b, s in zip(offsets, box, shape)),
               f"{what} lies outside the tensor's shape {list(shape)}")
        codec = c.get("codec", "raw")
        _check(codec in CODECS, f"{what} has unknown codec {codec!r}")
        length = _int(c.get("length"), f"length of {what}")
        raw_len = math.prod(box) * itemsize
        _check(length == raw_len if codec == "raw" else length <= raw_len + 1024,
               f"{what} has length {length} but its box holds {raw_len} bytes")
        ref = c.get("step")
        if ref is None:
            fname = file_name(c.get("file"), f"file of {what}")
            _check(fname in files, f"{what} names {fname!r}, which is not among files")
        else:
            _check(type(ref) is int and 0 <= ref < step,
                   f"{what} refers to step {ref!r}, which is not an earlier step")
            fname = file_name(c.get("file"), f"file of {what}")
        digest = c.get("digest")
        _check(isinstance(digest, str) and bool(_DIGEST.match(digest)),
               f"{what} has a malformed digest")
        chunks.append(Chunk(offsets, box, fname, _int(c.get("start"), f"start of {what}"),
                            length, digest, codec, ref))
    _check_tiling(key, shape, chunks)
    return TensorEntry(dtype, shape, tuple(chunks))


def _check_tiling(key: str, shape: tuple[int, ...], chunks: list[Chunk]) -> None:
    """The chunks cover the tensor exactly: volumes add up and no two boxes overlap."""
    total = math.prod(shape)
    _check(sum(c.numel for c in chunks) == total,
           f"the chunks of {key!r} cover {sum(c.numel for c in chunks)} of {total} elements")
    boxes = sorted((c.offsets, c.shape) for c in chunks if c.numel)
    for i, (oa, sa) in enumerate(boxes):
        for ob, sb in boxes[i + 1:]:
            if ob and oa and ob[0] >= oa[0] + sa[0]:
                break  # sorted by the first offset: no later box can overlap this one
            overlap = all(a < b + m and b < a + n for a, n, b, m in zip(oa, sa, ob, sb))
            _check(not overlap, f"chunks of {key!r} at {list(oa)} and {list(ob)} overlap")
