"""Record the file-system operations of ``storage_backends.posix``.

:func:`recording` puts a :class:`RecordingOS` (and a recording ``shutil``) in place of the
module's ``os`` and ``shutil``: every call goes to the real function, and the operations that
change the file system are appended to a :class:`Trace` with paths relative to the root. The
library itself is unchanged; only that module's view of ``os`` is.

An operation is a tuple whose first item names it:

* ``("mkdir", path)``, ``("creat", path, fid)`` (a new file, ``fid`` names it for later ops),
  ``("write", fid, offset, data)``, ``("fsync_file", fid)``, ``("fsync_dir", path)``,
  ``("rename", src, dst)``, ``("unlink", path)``, ``("rmdir", path)``.

Each is stamped with ``time.monotonic_ns()`` (one clock for every process of the machine), so
the traces of several ranks merge into one order that respects what they told each other.
"""

from __future__ import annotations

import contextlib
import os as _os
import shutil as _shutil
import stat
import threading
import time
from typing import Iterator

from storage_backends import posix as _posix


class Trace:
    """Operations in the order they happened (thread-safe: each runs under one lock)."""

    def __init__(self, root: str, tag: object = 0) -> None:
        self.root = _os.path.abspath(root)
        self.tag = tag  # makes file ids unique across the traces of several ranks
        self.ops: list[tuple] = []
        self.stamps: list[int] = []
        self.lock = threading.RLock()
        self._fids = 0

    def __getstate__(self) -> dict:  # to send a rank's trace back to the test
        return {k: v for k, v in self.__dict__.items() if k != "lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, lock=threading.RLock())

    def rel(self, path: str | bytes) -> str:
        full = _os.path.abspath(_os.fsdecode(path))
        if full != self.root and not full.startswith(self.root + "/"):
            # A path read back from /proc (dir_fd calls) has the root's symlinks resolved.
            real = _os.path.realpath(self.root)
            if full == real or full.startswith(real + "/"):
                full = self.root + full[len(real):]
        if full == self.root:
            return ""
        if not full.startswith(self.root + "/"):
            raise AssertionError(f"the storage touched {full}, outside the root {self.root}")
        return full[len(self.root) + 1:]

    def add(self, *op: object) -> None:
        self.ops.append(op)
        self.stamps.append(time.monotonic_ns())

    def new_fid(self) -> tuple:
        self._fids += 1
        return (self.tag, self._fids)


class RecordingOS:
    """The ``os`` module, with the calls that change the file system recorded."""

    def __init__(self, trace: Trace) -> None:
        self._t = trace
        self._files: dict[int, list] = {}  # fd -> [fid, offset]
        self._dirs: dict[int, str] = {}    # fd -> relative path

    def __getattr__(self, name: str):
        return getattr(_os, name)

    @staticmethod
    def _at(path, dir_fd) -> str:
        """The path a call with ``dir_fd`` means (what the descriptor names, then ``path``)."""
        if dir_fd is None:
            return _os.fsdecode(path)
        return _os.path.join(_os.readlink(f"/proc/self/fd/{dir_fd}"), _os.fsdecode(path))

    def open(self, path, flags, mode=0o777, *, dir_fd=None):
        with self._t.lock:
            fd = _os.open(path, flags, mode, dir_fd=dir_fd)
            full = self._at(path, dir_fd)
            if stat.S_ISDIR(_os.fstat(fd).st_mode):
                self._dirs[fd] = self._t.rel(full)
            elif flags & _os.O_CREAT:
                if not flags & _os.O_TRUNC:
                    raise AssertionError("the model only knows files created with O_TRUNC")
                fid = self._t.new_fid()
                self._t.add("creat", self._t.rel(full), fid)
                self._files[fd] = [fid, 0]
            return fd

    def write(self, fd, data):
        with self._t.lock:
            n = _os.write(fd, data)
            f = self._files.get(fd)
            if f is not None:
                self._t.add("write", f[0], f[1], bytes(memoryview(data).cast("B")[:n]))
                f[1] += n
            return n

    def fsync(self, fd):
        with self._t.lock:
            _os.fsync(fd)
            if fd in self._dirs:
                self._t.add("fsync_dir", self._dirs[fd])
            elif fd in self._files:
                self._t.add("fsync_file", self._files[fd][0])

    def close(self, fd):
        with self._t.lock:
            self._files.pop(fd, None)
            self._dirs.pop(fd, None)
            _os.close(fd)

    def rename(self, src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        with self._t.lock:
            _os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            self._t.add("rename", self._t.rel(self._at(src, src_dir_fd)),
                        self._t.rel(self._at(dst, dst_dir_fd)))

    replace = rename

    def unlink(self, path, *, dir_fd=None):
        with self._t.lock:
            full = self._at(path, dir_fd)
            _os.unlink(path, dir_fd=dir_fd)
            self._t.add("unlink", self._t.rel(full))

    remove = unlink

    def rmdir(self, path, *, dir_fd=None):
        with self._t.lock:
            full = self._at(path, dir_fd)
            _os.rmdir(path, dir_fd=dir_fd)
            self._t.add("rmdir", self._t.rel(full))

    def mkdir(self, path, mode=0o777, *, dir_fd=None):
        with self._t.lock:
            _os.mkdir(path, mode, dir_fd=dir_fd)
            self._t.add("mkdir", self._t.rel(self._at(path, dir_fd)))

    def makedirs(self, path, mode=0o777, exist_ok=False):
        with self._t.lock:
            missing = []
            p = _os.path.abspath(path)
            while not _os.path.isdir(p):
                missing.append(p)
                p = _os.path.dirname(p)
            _os.makedirs(path, mode, exist_ok=exist_ok)
            for p in reversed(missing):
                self._t.add("mkdir", self._t.rel(p))


class RecordingShutil:
    """``shutil`` with ``rmtree`` recorded as the unlinks and rmdirs it made."""

    def __init__(self, trace: Trace) -> None:
        self._t = trace

    def __getattr__(self, name: str):
        return getattr(_shutil, name)

    def rmtree(self, path, ignore_errors=False, onerror=None):
        with self._t.lock:
            before = []
            for dirpath, dirnames, filenames in _os.walk(path, topdown=False):
                before += [("unlink", _os.path.join(dirpath, f)) for f in filenames]
                before.append(("rmdir", dirpath))
            _shutil.rmtree(path, ignore_errors=ignore_errors)
            for kind, p in before:
                if not _os.path.lexists(p):
                    self._t.add(kind, self._t.rel(p))


@contextlib.contextmanager
def recording(root: str, tag: object = 0) -> Iterator[Trace]:
    """Record what ``storage_backends.posix`` does under ``root`` inside the block."""
    trace = Trace(root, tag)
    saved = _posix.os, _posix.shutil, _posix.fsync_dir
    recorder = RecordingOS(trace)

    def fsync_dir(path: str) -> None:  # the storage's (from storage_backends.files), recorded
        fd = recorder.open(path, _os.O_RDONLY | _os.O_DIRECTORY | _os.O_CLOEXEC)
        try:
            recorder.fsync(fd)
        finally:
            recorder.close(fd)

    _posix.os, _posix.shutil, _posix.fsync_dir = recorder, RecordingShutil(trace), fsync_dir
    try:
        yield trace
    finally:
        _posix.os, _posix.shutil, _posix.fsync_dir = saved


def merge(traces: list[Trace]) -> list[tuple]:
    """One order for the traces of several processes (by their monotonic stamps)."""
    stamped = [(s, i, k, op) for i, t in enumerate(traces)
               for k, (s, op) in enumerate(zip(t.stamps, t.ops))]
    return [op for *_, op in sorted(stamped)]


def snapshot_tree(root: str) -> dict[str, bytes | None]:
    """Every directory (None) and file (its bytes) under ``root``, by relative path."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in _os.walk(root):
        rel = _os.path.relpath(dirpath, root)
        if rel != ".":
            out[rel] = None
        for f in filenames:
            p = _os.path.join(dirpath, f)
            if _os.path.islink(p):
                raise AssertionError(f"the model knows no symlinks: {p}")
            with open(p, "rb") as fh:
                out[_os.path.normpath(_os.path.join(rel, f))] = fh.read()
    return out
