"""The rule a restore and ``ckpt verify`` share for a data file's safetensors header: it must
name each of the manifest's chunks in that file at the byte range, dtype and shape the
manifest gives it.

ckpt reads by the manifest, not by the header; but the header is written with the data, in
the same file, and is a second record of which box of which tensor each byte range holds. A
manifest that disagrees with it is damage, even when every digest matches: two same-shaped
chunks whose boxes were swapped would load the tensor permuted. So a restore refuses the
step (and falls back past it) exactly where ``ckpt verify`` reports it FAILED: both ask
:func:`header_disagreement`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from storage_backends import Storage, reads_are_requests

from ckpt._format.datafile import SAFETENSORS_DTYPES
from ckpt._format.entries import Chunk
from ckpt._format.manifest import Manifest
from ckpt._step.integrity import chunk_path, each_file
from ckpt.errors import CorruptCheckpointError

MAX_HEADER_BYTES = 100 << 20  # what the safetensors library itself accepts
#: The bytes an object store's first read of a file's header asks for: the length and,
#: in one request, the header of up to about a thousand tensors.
HEADER_PREFIX = 64 << 10
PROBLEMS_LISTED = 5  # disagreeing entries named before "and N more"


def expected_entry(key: str, chunk: Chunk, dtype: torch.dtype, data_start: int
                   ) -> tuple[str, dict[str, Any]]:
    """The header entry ckpt writes for ``chunk`` of ``key`` (ckpt/_format/datafile.py)."""
    code = SAFETENSORS_DTYPES.get(dtype) if chunk.codec == "raw" else None
    begin = chunk.start - data_start
    return f"{key}#{list(chunk.offsets)}", {
        "dtype": code or "U8", "shape": list(chunk.shape) if code else [chunk.length],
        "data_offsets": [begin, begin + chunk.length]}


def header_disagreement(read: Callable[[int, int], bytes], file_size: int | None,
                        chunks: Iterable[tuple[str, Chunk]], dtypes: Mapping[str, torch.dtype],
                        *, exact: bool) -> str | None:
    """How one data file's header disagrees with the manifest, as the rest of the sentence
    "safetensors header ...", or None when it agrees.

    Args:
        read: ``read(start, length)`` -> bytes of the file (fewer at its end).
        file_size: the file's size, when known.
        chunks: (tensor key, chunk) of the manifest's chunks in this file.
        dtypes: each key's dtype.
        exact: the header must list exactly these chunks (the file belongs to the step and
            every chunk of it is given); else other entries may be there too.
    """
    if file_size is not None and file_size < 8:
        return f"missing: the file has {file_size} bytes"
    prefix = read(0, 8)
    if len(prefix) < 8:
        return f"missing: the file has {len(prefix)} bytes"
    length = int.from_bytes(prefix, "little")
    room = MAX_HEADER_BYTES if file_size is None else min(MAX_HEADER_BYTES, file_size - 8)
    body = read(8, length) if length <= room else b""
    if length > room or len(body) < length:
        return f"length {length} does not fit the file" + (
            f" ({file_size} bytes)" if file_size is not None else "")
    try:
        header = json.loads(body.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nesting
        return f"is not valid JSON ({type(e).__name__}: {e})"
    if not isinstance(header, dict):
        return "is not a JSON object"
    data_start = 8 + length
    mismatches, names = [], set()
    for key, chunk in chunks:
        name, want = expected_entry(key, chunk, dtypes[key], data_start)
        names.add(name)
        got = header.get(name)
        if got != want:
            mismatches.append(f"entry {name!r} is {json.dumps(got)}, the manifest implies "
                              f"{json.dumps(want)}")
    if exact:
        extra = sorted(set(header) - names - {"__metadata__"})
        mismatches += [f"has entry {n!r}, which the manifest does not list" for n in extra]
    if not mismatches:
        return None
    more = len(mismatches) - PROBLEMS_LISTED
    return "disagrees with the manifest: " + "; ".join(mismatches[:PROBLEMS_LISTED]) + (
        f"; and {more} more" if more > 0 else "")


def check_headers(storage: Storage, location: str, manifest: Manifest,
                  reads: Iterable[tuple[str, Chunk]]) -> None:
    """A restore's check, before any tensor is written: the header of every file it reads
    agrees with the manifest on the chunks it reads there.

    Raises:
        CorruptCheckpointError: naming the file and how its header disagrees.
    """
    by_path: dict[str, list[tuple[str, Chunk]]] = {}
    for key, chunk in reads:
        by_path.setdefault(chunk_path(location, chunk), []).append((key, chunk))
    dtypes = {key: manifest.tensors[key].torch_dtype for key in
              {key for pairs in by_path.values() for key, _ in pairs}}

    def check(path: str) -> None:
        read, close = _bytes_of(storage, path)
        try:
            why = header_disagreement(read, None, by_path[path], dtypes, exact=False)
        finally:
            close()
        if why is not None:
            where = f"{storage.url}/{path}"
            raise CorruptCheckpointError(
                f"{where}: safetensors header {why}; the step's manifest does not describe "
                "this file's data, so the step is not loaded", path=where)
    each_file(storage, by_path, check)


def _bytes_of(storage: Storage, path: str
              ) -> tuple[Callable[[int, int], bytes], Callable[[], None]]:
    """``read(start, n)`` of one file (fewer bytes, none, past its end) and its ``close``:
    through one open file where the storage keeps files open (a file system: one open per
    file, not per read), as exact ranged reads elsewhere (an object store: the first
    asks for :data:`HEADER_PREFIX` bytes, which usually hold the whole header, so that
    the length and the header cost one request, not two)."""
    if reads_are_requests(storage):
        prefix: list[tuple[bytes, int]] = []  # (the bytes, how many were asked for)

        def ranged(start: int, n: int) -> bytes:
            if not prefix:
                asked = max(HEADER_PREFIX, start + n)
                prefix.append((storage.read(path, 0, asked), asked))
            held, asked = prefix[0]
            if start + n <= len(held) or len(held) < asked:  # there, or the file ends there
                return held[start:start + n]
            return storage.read(path, start, n)

        return ranged, (lambda: None)
    reader = storage.open_reader(path)

    def read(start: int, n: int) -> bytes:
        out = bytearray(n)
        try:
            reader.read_into(start, memoryview(out))
        except EOFError:
            return b""
        return bytes(out)

    return read, reader.close


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for k, v in pairs:
        if k in doc:
            raise ValueError(f"duplicate key {k!r}")
        doc[k] = v
    return doc
