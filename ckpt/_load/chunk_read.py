"""Reading one stored chunk, or a run of adjacent ones, and checking it against its digest."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from storage_backends import Storage
from storage_backends.base import PathReader, Reader

from ckpt._format.entries import Chunk
from ckpt._shared.buffers import byte_view
from ckpt._format.digest import Digest, digest
from ckpt._step.integrity import chunk_path
from ckpt.errors import CorruptCheckpointError

if TYPE_CHECKING:
    from ckpt._load.read_plan import ChunkRead


def read_chunk(storage: Storage, location: str, key: str, chunk: Chunk,
               out: torch.Tensor, verify: bool = True, files: OpenFiles | None = None) -> None:
    """Fill ``out`` (a contiguous CPU tensor of the chunk's shape) with the chunk's data
    (through ``files``' open readers when given)."""
    read_chunk_into(storage, location, key, chunk, byte_view(out), out.dtype, verify, files)


def read_chunk_into(storage: Storage, location: str, key: str, chunk: Chunk,
                    view: memoryview, dtype: torch.dtype, verify: bool = True,
                    files: OpenFiles | None = None) -> None:
    """:func:`read_chunk` into ``view``, the bytes of the chunk's destination."""
    path = chunk_path(location, chunk)
    found = None  # the digest of what was read, when taken block by block as it landed
    try:
        if chunk.codec == "raw":
            reader = PathReader(storage, path) if files is None else files.get(path)
            block = getattr(storage, "stream_block", None)
            if verify and block:  # digest each block while it is still in the CPU's cache
                hashing = Digest()
                for at in range(0, len(view), block):
                    part = view[at:at + block]
                    reader.read_into(chunk.start + at, part)
                    hashing.update(part)
                found = hashing.hexdigest()
            else:
                reader.read_into(chunk.start, view)
        else:
            from ckpt._format.codec import decode_into  # compression is optional on the read path

            decode_into(chunk.codec, storage.read(path, chunk.start, chunk.length), view, dtype)
    except (EOFError, FileNotFoundError, ValueError) as e:
        raise unreadable(storage, path, key, chunk, e) from e
    if verify and (found if found is not None else digest(view)) != chunk.digest:
        raise mismatch(storage, path, key, chunk)


class OpenFiles:
    """The files one pass reads, each opened once per reading thread (not once per chunk)
    and closed when the pass ends."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: list[Reader] = []

    def get(self, path: str) -> Reader:
        readers = getattr(self._local, "readers", None)
        if readers is None:
            readers = self._local.readers = {}
        reader = readers.get(path)
        if reader is None:
            reader = readers[path] = self.storage.open_reader(path)
            with self._lock:
                self._open.append(reader)
        return reader

    def close(self) -> None:
        with self._lock:
            for reader in self._open:
                reader.close()
            self._open.clear()


def mismatch(storage: Storage, path: str, key: str, chunk: Chunk) -> CorruptCheckpointError:
    """The error for a chunk whose bytes do not match its digest."""
    return CorruptCheckpointError(
        f"{storage.url}/{path}: digest mismatch in {key} at offsets {list(chunk.offsets)} "
        f"(bytes {chunk.start}..{chunk.start + chunk.length}): the data is corrupt",
        path=f"{storage.url}/{path}")


def unreadable(storage: Storage, path: str, key: str, chunk: Chunk,
               error: Exception) -> CorruptCheckpointError:
    """The error for a chunk that cannot be read (a file missing or too short, bad bytes)."""
    return CorruptCheckpointError(
        f"{storage.url}/{path}: cannot read {key} at {list(chunk.offsets)}: {error}",
        path=f"{storage.url}/{path}")


def verify_run(storage: Storage, path: str, run: list[ChunkRead], buffer: memoryview) -> None:
    """Digest a run of adjacent raw chunks of one file, streamed through ``buffer`` (a block
    may end one chunk and begin the next)."""
    pos = run[0].chunk.start
    end = run[-1].chunk.start + run[-1].chunk.length
    i, hashing = 0, Digest()

    def check_complete() -> None:  # every chunk that ends at `pos` is whole: check it
        nonlocal i, hashing
        while i < len(run) and run[i].chunk.start + run[i].chunk.length == pos:
            if hashing.hexdigest() != run[i].chunk.digest:
                raise mismatch(storage, path, run[i].key, run[i].chunk)
            i, hashing = i + 1, Digest()

    blocks = storage.read_blocks(path, pos, end - pos, buffer)
    try:
        check_complete()
        for part in blocks:
            while part:
                chunk = run[i].chunk
                n = min(len(part), chunk.start + chunk.length - pos)
                hashing.update(part[:n])
                part, pos = part[n:], pos + n
                check_complete()
    except CorruptCheckpointError:
        raise
    except (EOFError, FileNotFoundError, ValueError) as e:
        at = run[min(i, len(run) - 1)]
        raise unreadable(storage, path, at.key, at.chunk, e) from e
    finally:
        blocks.close()
