"""One committed step on storage, checked: reading and validating its manifest (with its rank
tables attached), and the structure check (files present, byte ranges inside them).
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Iterable

from storage_backends import NotAFileError, Storage, reads_are_requests

from ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckpt._format.entries import Chunk
from ckpt._format.manifest import Manifest
from ckpt._format.names import MANIFEST_NAME, step_dir
from ckpt._step.tables import bind_tables


#: Files checked at once where each check is a request (a root without a page cache: an
#: object store), so that a rank reading many files does not wait for their round trips
#: one after another before its first byte of data.
FILE_CHECKERS = 16


def each_file(storage: Storage, paths: Iterable[str], check: Callable[[str], None]) -> None:
    """``check(path)`` for every path: at once on a root without a page cache, in turn on
    a file system (no round trips to save). The first failure in path order is raised."""
    ordered = sorted(paths)
    if len(ordered) < 2 or not reads_are_requests(storage):
        for path in ordered:
            check(path)
        return
    with cf.ThreadPoolExecutor(min(FILE_CHECKERS, len(ordered)),
                               thread_name_prefix="ckpt-check") as pool:
        for _ in pool.map(check, ordered):  # raises the first failure, in path order
            pass


def chunk_path(location: str, chunk: Chunk) -> str:
    """Where a chunk's file lives relative to the root: in the step at ``location``, or in
    the earlier step it reuses the chunk from."""
    return f"{location if chunk.step is None else step_dir(chunk.step)}/{chunk.file}"


def read_manifest(storage: Storage, location: str, step: int | None = None) -> Manifest:
    """Read and validate the manifest of the checkpoint at ``location`` (relative to root).

    When ``step`` is given the manifest must say that step (it lies in that step's directory).
    """
    where = f"{storage.url}/{location}/{MANIFEST_NAME}"
    try:
        raw = storage.read(f"{location}/{MANIFEST_NAME}")
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointNotFoundError(
            f"no committed checkpoint at {storage.url}/{location} (no {MANIFEST_NAME}); "
            "list a root's steps with `ckpt ls ROOT`", path=where) from None
    except NotAFileError as e:  # damage: a restore falls back past it, gc names the step
        raise CorruptCheckpointError(f"{where}: {e.strerror}; the step cannot be loaded",
                                     path=where) from None
    manifest = bind_tables(Manifest.from_json(raw, where=where),
                           lambda name: storage.read(f"{location}/{name}"),
                           f"{storage.url}/{location}")
    if step is not None and manifest.step != step:
        raise CorruptCheckpointError(
            f"{where}: manifest says step {manifest.step}, but lies in {location}", path=where)
    return manifest


def check_structure(storage: Storage, location: str, manifest: Manifest,
                    chunks: Iterable[Chunk] | None = None) -> None:
    """Every file the manifest names exists with its recorded size, and holds its chunks.

    With ``chunks`` (what one rank of a restore is about to read), only the files those
    chunks live in are checked: a restore on N ranks that sized every file on every rank
    would send N^2 size requests to an object store. ``ckpt verify`` checks everything.
    """
    if chunks is not None:
        _check_files(storage, location, manifest, chunks)
        return
    sizes: dict[str, int] = {}
    own = manifest.own_files()

    def size_of(name: str) -> None:
        path = f"{location}/{name}"
        sizes[path] = _size_or_raise(storage, path, own[name])
    each_file(storage, own, size_of)
    if manifest.tables:
        # Format 2: each chunk is checked against these sizes when its rank table is read.
        for (step, name), needed in manifest.refs.items():
            path = f"{step_dir(step)}/{name}"
            if _size_or_raise(storage, path, None) < needed:
                raise CorruptCheckpointError(
                    f"{storage.url}/{path}: shorter than the {needed} bytes step "
                    f"{manifest.step} uses; the file is truncated", path=f"{storage.url}/{path}")
        return
    for key, entry in manifest.tensors.items():
        for chunk in entry.chunks:
            path = chunk_path(location, chunk)
            if path not in sizes:
                sizes[path] = _size_or_raise(storage, path, None)
            if chunk.start + chunk.length > sizes[path]:
                raise CorruptCheckpointError(
                    f"{storage.url}/{path}: {sizes[path]} bytes, but {key} needs bytes "
                    f"{chunk.start}..{chunk.start + chunk.length}; the file is truncated",
                    path=f"{storage.url}/{path}")


def _check_files(storage: Storage, location: str, manifest: Manifest,
                 chunks: Iterable[Chunk]) -> None:
    needed: dict[str, tuple[int, int | None]] = {}  # path -> (bytes needed, recorded size)
    for c in chunks:
        path = chunk_path(location, c)
        end = c.start + c.length
        if path not in needed or needed[path][0] < end:
            needed[path] = (end, manifest.files.get(c.file) if c.step is None else None)

    def check(path: str) -> None:
        end, expected = needed[path]
        size = _size_or_raise(storage, path, expected)
        if end > size:
            raise CorruptCheckpointError(
                f"{storage.url}/{path}: {size} bytes, but step {manifest.step} needs bytes up "
                f"to {end}; the file is truncated", path=f"{storage.url}/{path}")
    each_file(storage, needed, check)


def _size_or_raise(storage: Storage, path: str, expected: int | None) -> int:
    try:
        size = storage.size(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{storage.url}/{path} is missing", path=path) from None
    if expected is not None and size != expected:
        raise CorruptCheckpointError(
            f"{storage.url}/{path} is {size} bytes, the manifest recorded {expected}: "
            "the file was truncated or changed", path=f"{storage.url}/{path}")
    return size

