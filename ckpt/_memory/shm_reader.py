"""A read-only storage front over files in this node's shared memory: the subset of the
storage contract ckpt's loader uses, read with ``pread`` on descriptors opened once."""

from __future__ import annotations

import os
import threading
from typing import Callable, Iterator

from storage_backends.base import PathReader
from storage_backends.posix import pread_blocks, pread_into

from ckpt._format.names import MANIFEST_NAME
from ckpt._memory.private import check_dir, open_checked
from ckpt._memory.tier import authenticate_manifest, plain_name


class ShmReader:
    """Read-only storage (the subset ckpt's loader uses) over files in this node's shared
    memory, for the memory tier's restores.

    Each file is opened once per restore (never through a symbolic link, and only when this
    user owns it and no one else may write it: ``ckpt/_memory/private.py``) and read with
    ``pread`` on that descriptor: no path walk or ``stat`` per chunk. The loader's verify pass
    streams each run of chunks through one small block per thread (``stream_block``, digested
    while still in the CPU cache), its apply pass reads straight into the live tensors; the
    measurements behind this (and against memory maps) are in docs/design.md, "Memory tier
    across nodes".
    ``close`` releases the descriptors.

    ``where(path)`` names the file behind a storage path, or None (not on this node).
    """

    stream_block = 512 << 10
    # Every read is a copy out of this node's memory, bound by the CPU rather than a disk:
    # the loader spreads each file's reads over the cores (``run_reads``' ``cached``).
    reads_from_memory = True

    def __init__(self, url: str, where: Callable[[str], str | None],
                 check: Callable[[str, int], None] | None = None) -> None:
        self.url = url
        self._where = where
        self._check = check  # called with (path, descriptor) before a file is first used
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def of_root(cls, root: str, key: bytes | None) -> ShmReader:
        """Over a segment that is an ordinary ckpt root (a single process's): a step's
        manifest is read only when its tag checks out under the job's memory ``key``
        (``ckpt/_memory/tier.py``), so nothing of a step this job did not publish is loaded."""
        def where(path: str) -> str:
            parts = path.split("/")
            for part in parts:
                plain_name(part)  # no "..", no absolute path, no hidden staging
            for i in range(1, len(parts)):  # directories on the way: ours, never a link
                check_dir(os.path.join(root, *parts[:i]))
            return os.path.join(root, *parts)

        def check(path: str, fd: int) -> None:
            location, _, name = path.rpartition("/")
            if name == MANIFEST_NAME:
                authenticate_manifest(root, location, key, fd)
        return cls(root, where, check)

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is not None:
            return fd
        try:
            where = self._where(path)
        except (ValueError, OSError) as e:  # not a plain path, or a directory not ours
            raise FileNotFoundError(f"{os.path.join(self.url, path)}: {e}") from e
        if where is None:
            raise FileNotFoundError(f"{os.path.join(self.url, path)} is not on this node")
        try:
            fd = open_checked(where)
        except FileNotFoundError:
            raise
        except OSError as e:  # a link, another user's file: this copy is unusable, not fatal
            raise FileNotFoundError(f"{where}: {e}") from e
        if self._check is not None:
            try:
                self._check(path, fd)
            except BaseException:
                os.close(fd)
                raise
        with self._lock:
            if path in self._fds:  # another thread opened it meanwhile
                os.close(fd)
                return self._fds[path]
            self._fds[path] = fd
        return fd

    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        fd = self._fd(path)
        if length is None:
            length = max(0, os.fstat(fd).st_size - start)
        buf = bytearray(length)
        self.read_into(path, start, memoryview(buf))
        return bytes(buf)

    def read_into(self, path: str, start: int, out: memoryview) -> None:
        pread_into(self._fd(path), start, out, os.path.join(self.url, path))

    def read_blocks(self, path: str, start: int, length: int,
                    buffer: memoryview) -> Iterator[memoryview]:
        yield from pread_blocks(self._fd(path), start, length, buffer,
                                os.path.join(self.url, path))

    def open_reader(self, path: str) -> PathReader:
        """Reads of one file (the loader's apply pass); the descriptor is kept anyway."""
        return PathReader(self, path)

    def size(self, path: str) -> int:
        return os.fstat(self._fd(path)).st_size

    def exists(self, path: str) -> bool:
        try:
            self._fd(path)
        except FileNotFoundError:
            return False
        return True

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __del__(self) -> None:
        self.close()
