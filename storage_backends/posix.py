"""Local and Lustre file systems.

A step is written into ``ROOT/.tmp-<name>-<uuid>/`` and published by renaming that directory
to ``ROOT/<name>``: rename is atomic on POSIX and on Lustre, so readers see either nothing or
the whole step. Every file is fsynced before the manifest is written, the manifest before the
staging directory, the staging directory before the rename, and the root after it, so a power
loss at any instant leaves either the old state or the new one.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Sequence

from .base import Buffer, Entry, Storage, WriterLock
from .locks import FlockWriterLock

STAGING_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PosixStorage(Storage):
    """A checkpoint root on a POSIX (or Lustre) file system."""

    def __init__(self, root: str, *, create: bool = True) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root
        if create:
            os.makedirs(self.root, exist_ok=True)

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    def list(self, path: str = "") -> list[Entry]:
        try:
            with os.scandir(self._abs(path)) as it:
                return [Entry(e.name, e.is_dir()) for e in it]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def exists(self, path: str) -> bool:
        return os.path.exists(self._abs(path))

    def size(self, path: str) -> int:
        return os.stat(self._abs(path)).st_size

    def write(self, path: str, buffers: Sequence[Buffer]) -> int:
        fd = os.open(self._abs(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        total = 0
        try:
            for buf in buffers:
                view = memoryview(buf).cast("B")
                while view:
                    n = os.write(fd, view)
                    total += n
                    view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        return total

    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        with open(self._abs(path), "rb") as f:
            f.seek(start)
            return f.read() if length is None else f.read(length)

    def read_into(self, path: str, start: int, out: memoryview) -> None:
        view = memoryview(out).cast("B")
        fd = os.open(self._abs(path), os.O_RDONLY)
        try:
            while view:
                n = os.preadv(fd, [view], start)
                if n == 0:
                    raise EOFError(f"{self._abs(path)} ends before byte {start + len(view)}")
                start += n
                view = view[n:]
        finally:
            os.close(fd)

    def delete(self, path: str) -> None:
        target = self._abs(path)
        if os.path.isdir(target) and not os.path.islink(target):
            # Rename first so a crash mid-delete never leaves a half-deleted visible step.
            trash = self._abs(f"{TRASH_PREFIX}{uuid.uuid4().hex}")
            os.rename(target, trash)
            # Durable before its files go: else a crash could keep the name, lose the files.
            _fsync_dir(os.path.dirname(target))
            shutil.rmtree(trash, ignore_errors=True)
        else:
            try:
                os.unlink(target)
            except FileNotFoundError:
                return
            # A retired step's manifest must be gone for good before its files are deleted
            # (tests/test_crash_states.py found a torn step visible after a crash otherwise).
            _fsync_dir(os.path.dirname(target))

    def begin(self, name: str, token: str) -> str:
        staging = f"{STAGING_PREFIX}{name}-{token}"
        os.makedirs(self._abs(staging), exist_ok=True)
        return staging

    def commit(self, staging: str, name: str, manifest: bytes, manifest_name: str) -> None:
        self.write(f"{staging}/{manifest_name}", [manifest])
        _fsync_dir(self._abs(staging))
        final = self._abs(name)
        if os.path.exists(final):
            # Re-saving a step (e.g. after falling back past a bad one): move the old one aside.
            # Between the two renames this step is briefly absent; older steps stay visible.
            os.rename(final, self._abs(f"{TRASH_PREFIX}{name}-{uuid.uuid4().hex[:12]}"))
        # The commit point: after this rename (and the root's fsync) the step exists.
        os.rename(self._abs(staging), final)
        _fsync_dir(self.root)

    def abort(self, staging: str) -> None:
        shutil.rmtree(self._abs(staging), ignore_errors=True)

    def uncommitted(self) -> list[str]:
        return [
            e.name
            for e in self.list()
            if e.name.startswith((STAGING_PREFIX, TRASH_PREFIX)) and e.is_dir
        ]

    def lock(self, owner: dict) -> WriterLock:
        return FlockWriterLock(self.root, owner)
