"""Local and Lustre file systems.

A step is written into ``ROOT/.tmp-<name>-<uuid>/`` and published by renaming that directory
to ``ROOT/<name>``: rename is atomic on POSIX and on Lustre, so readers see either nothing or
the whole step. Every file is fsynced before the manifest is written, the manifest before the
staging directory, the staging directory before the rename, and the root after it, so a power
loss at any instant leaves either the old state or the new one.

Symbolic links are never followed: a root is a tree of plain files and directories that ckpt
made, and a link planted in it (a step directory, a data file, a staging directory) could
otherwise make a read, a write or a collection reach outside the root. A path that passes
through a link is treated as absent and logged once (when listing a root, only links named
as ckpt names its entries are logged).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import uuid
from typing import Iterator, Sequence

from .base import Buffer, Entry, NotAFileError, Storage, WriterLock
from .files import fsync_dir  # here too: the storage's durability step, as callers know it
from .locks import FlockWriterLock

STAGING_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
# What ckpt names the entries of a root (steps, staging and trash directories, the lock): a
# link listed there under another name is none of ckpt's business, and not worth a warning
# (`ckpt ls /` would warn about /bin). Inside a step directory every name is ckpt's.
ROOT_NAMES = ("step-", STAGING_PREFIX, TRASH_PREFIX, ".lock")

log = logging.getLogger("ckpt")


class SymlinkRefusedError(FileNotFoundError):
    """A path inside a root passes through a symbolic link; ckpt treats it as absent."""

    def __init__(self, path: str) -> None:
        super().__init__(errno.ELOOP, "a symbolic link: ckpt never follows links in a "
                         "checkpoint root (they could lead outside it); remove the link", path)

    def __reduce__(self):
        return (type(self), (self.filename,))


class PosixStorage(Storage):
    """A checkpoint root on a POSIX (or Lustre) file system."""

    # Modes of the files and staging directories a save creates (before the umask); a
    # private root (the memory tier's segments) narrows them.
    file_mode, dir_mode = 0o644, 0o777

    def __init__(self, root: str, *, create: bool = True) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root
        self._reported: set[str] = set()
        if create:
            os.makedirs(self.root, exist_ok=True)

    def _report(self, path: str) -> None:
        if path not in self._reported:
            self._reported.add(path)
            # ascii(): a link's name is anyone's bytes; terminal escapes stay escaped in logs
            log.warning("ckpt.symlink ignored=%s: symbolic links in a checkpoint root are never "
                        "followed; remove it", ascii(path))

    def local_path(self, path: str) -> str:
        """The absolute path of ``path``; raises SymlinkRefusedError when it (or a directory
        on the way to it) is a symbolic link. Missing components are left to the caller."""
        if not path:
            return self.root
        full = self.root
        for part in path.split("/"):
            if part in ("", ".", ".."):
                raise ValueError(f"{path!r} is not a plain path inside the root")
            full = os.path.join(full, part)
            try:
                mode = os.lstat(full).st_mode
            except (FileNotFoundError, NotADirectoryError):
                return os.path.join(self.root, path)
            if stat.S_ISLNK(mode):
                self._report(full)
                raise SymlinkRefusedError(full)
        return full

    def list(self, path: str = "") -> list[Entry]:
        try:
            with os.scandir(self.local_path(path)) as it:
                entries = []
                for e in it:
                    if e.is_symlink():
                        if path or e.name.startswith(ROOT_NAMES):
                            self._report(e.path)
                        continue
                    entries.append(Entry(e.name, e.is_dir(follow_symlinks=False)))
                return entries
        except (FileNotFoundError, NotADirectoryError):
            return []

    def exists(self, path: str) -> bool:
        try:
            return os.path.lexists(self.local_path(path))
        except SymlinkRefusedError:
            return False

    def size(self, path: str) -> int:
        return os.stat(self.local_path(path), follow_symlinks=False).st_size

    def write(self, path: str, buffers: Sequence[Buffer]) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.local_path(path), flags, self.file_mode)
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

    def _open_read(self, path: str) -> tuple[int, str]:
        """A descriptor of a regular file under the root, and the file's absolute path (for
        messages). Opened without blocking, so a FIFO planted in a checkpoint cannot hang a
        reader; refused unless the open descriptor is a regular file (a directory, FIFO,
        socket or device there is damage, not data)."""
        target = self.local_path(path)
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise NotAFileError(errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL,
                          f"{kind} where a checkpoint file was expected", target)
        return fd, target

    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        with open(self._open_read(path)[0], "rb") as f:
            f.seek(start)
            return f.read() if length is None else f.read(length)

    def read_into(self, path: str, start: int, out: memoryview) -> None:
        reader = self.open_reader(path)
        try:
            reader.read_into(start, out)
        finally:
            reader.close()

    def open_reader(self, path: str) -> _FileReader:
        return _FileReader(*self._open_read(path))

    # 512 KiB: a block read from the page cache is still in the CPU's cache when it is digested.
    stream_block = 512 << 10

    def read_blocks(self, path: str, start: int, length: int,
                    buffer: memoryview) -> Iterator[memoryview]:
        fd, target = self._open_read(path)  # once for the whole range
        try:
            yield from pread_blocks(fd, start, length, buffer, target)
        finally:
            os.close(fd)

    def delete(self, path: str) -> None:
        try:
            target = self.local_path(path)
        except SymlinkRefusedError:
            return  # ignored (and reported): never delete through, or a planted, link
        if stat.S_ISDIR(_lmode(target)):
            # Rename first so a crash mid-delete never leaves a half-deleted visible step.
            trash = self.local_path(f"{TRASH_PREFIX}{uuid.uuid4().hex}")
            try:
                os.rename(target, trash)
            except FileNotFoundError:
                return  # another process deleted it first (ranks collecting one root)
            # Durable before its files go: else a crash could keep the name, lose the files.
            fsync_dir(os.path.dirname(target))
            shutil.rmtree(trash, ignore_errors=True)  # rmtree unlinks links, never follows
        else:
            try:
                os.unlink(target)
                # A retired step's manifest must be gone for good before its files are
                # deleted: otherwise a crash can leave a torn step visible
                # (tests/e2e/test_crash_states.py).
                fsync_dir(os.path.dirname(target))
            except FileNotFoundError:
                return  # gone already, or its directory too (deleted by another process)

    def begin(self, name: str, token: str) -> str:
        staging = f"{STAGING_PREFIX}{name}-{token}"
        try:
            os.mkdir(self.local_path(staging), self.dir_mode)
        except FileExistsError:  # another rank of this save made it
            if not stat.S_ISDIR(_lmode(self.local_path(staging))):
                raise
        return staging

    def commit(self, staging: str, name: str, manifest: bytes, manifest_name: str) -> None:
        self.write(f"{staging}/{manifest_name}", [manifest])
        fsync_dir(self.local_path(staging))
        final = self.local_path(name)
        if os.path.lexists(final):
            self._commit_over(staging, final, manifest_name)
            return
        # The commit point: after this rename (and the root's fsync) the step exists.
        os.rename(self.local_path(staging), final)
        fsync_dir(self.root)

    def _commit_over(self, staging: str, final: str, manifest_name: str) -> None:
        """Re-save a step whose directory exists (a rollback re-saving its number, or a step
        that retention retired but whose files later steps still use). The old directory
        stays: its files may be referenced by later steps, and moving it aside would leave
        them broken (and the step absent) between two renames. The new data files (uniquely
        named per save) move in first; then renaming the new manifest over the old one
        switches the step in one atomic step. Files of the old save that nothing references
        any more are removed by the next collection."""
        if not stat.S_ISDIR(_lmode(final)):
            raise FileExistsError(f"{final} exists and is not a step directory; remove it")
        source = self.local_path(staging)
        for entry in os.listdir(source):
            if entry != manifest_name:
                os.rename(os.path.join(source, entry), os.path.join(final, entry))
        # A rename is durable once both of its directories are.
        fsync_dir(final)
        fsync_dir(source)
        # The commit point of a re-saved step: the manifest names only the new files.
        os.rename(os.path.join(source, manifest_name), os.path.join(final, manifest_name))
        fsync_dir(final)
        fsync_dir(source)
        shutil.rmtree(source, ignore_errors=True)

    def abort(self, staging: str) -> None:
        try:
            path = self.local_path(staging)
        except SymlinkRefusedError:
            return
        shutil.rmtree(path, ignore_errors=True)

    def uncommitted(self) -> list[str]:
        return [
            e.name
            for e in self.list()
            if e.name.startswith((STAGING_PREFIX, TRASH_PREFIX)) and e.is_dir
        ]

    def lock(self, owner: dict) -> WriterLock:
        return FlockWriterLock(self.root, owner)


def pread_into(fd: int, start: int, out: memoryview, name: str) -> None:
    """Fill ``out`` from byte ``start`` of the open file ``fd`` (``pread``: no shared file
    position); EOFError naming ``name`` if the file ends first."""
    view = memoryview(out).cast("B")
    while view:
        n = os.preadv(fd, [view], start)
        if n == 0:
            raise EOFError(f"{name} ends before byte {start + len(view)}")
        start += n
        view = view[n:]


def pread_blocks(fd: int, start: int, length: int, buffer: memoryview,
                 name: str) -> Iterator[memoryview]:
    """``length`` bytes of ``fd`` from ``start``, read through ``buffer`` and yielded as the
    filled part of it, block by block; EOFError naming ``name`` if the file ends first."""
    buffer = memoryview(buffer).cast("B")
    end = start + length
    while start < end:
        part = buffer[:min(len(buffer), end - start)]
        n = os.preadv(fd, [part], start)
        if n == 0:
            raise EOFError(f"{name} ends before byte {end}")
        yield part[:n]
        start += n


class _FileReader:
    """One open file read at many offsets (``pread``: no shared file position, so threads
    may share it)."""

    def __init__(self, fd: int, name: str) -> None:
        self.fd, self.name = fd, name

    def read_into(self, start: int, out: memoryview) -> None:
        pread_into(self.fd, start, out, self.name)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _lmode(path: str) -> int:
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return 0
