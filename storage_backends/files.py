"""Small local files (records, summaries, lock owners, metrics) written and opened safely in
directories other users may write to.

Threat: a user who can write to the directory (a shared run folder, a textfile collector's
folder, a checkpoint root) plants an entry at a name a job writes: a symbolic or hard link to
a file of the job's user (the write would truncate or overwrite it), or a FIFO (the open
would block for ever). So a file is replaced through a new file of an unguessable name,
created exclusively and never through a link, then renamed over the name (a rename replaces
a link, it never follows it); and a file opened in place is opened without following a link
or blocking, and used only when the open descriptor is a regular file.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat

__all__ = ["SpecialFileError", "atomic_write", "create_beside", "fsync_dir", "mkdir_beside",
           "name_beside", "open_regular"]


class SpecialFileError(OSError):
    """A symbolic link, FIFO, socket, device or directory where a regular file is opened.

    ``kind`` says which ("a symbolic link", "a FIFO", ...) and ``filename`` names the path,
    so that a caller can say what to do in its own terms.
    """

    def __init__(self, path: str | os.PathLike, kind: str, code: int = errno.EINVAL) -> None:
        super().__init__(code, f"{kind} where a regular file was expected", os.fspath(path))
        self.kind = kind

    def __reduce__(self):
        return (type(self), (self.filename, self.kind, self.errno))


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return kind
    return "a device"


def open_regular(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """A descriptor of the regular file at ``path``, opened with ``flags`` (``os.O_WRONLY |
    os.O_APPEND | os.O_CREAT``, say; ``mode`` for a new file, before the umask), blocking as
    usual once open.

    Raises :class:`SpecialFileError` when a link, FIFO, socket, device or directory is there;
    other OSErrors as ``os.open`` raises them.
    """
    # O_NOFOLLOW: a link is refused (ELOOP), never followed. O_NONBLOCK: a FIFO without a
    # reader is refused (ENXIO) rather than waited on; with a reader, fstat refuses it.
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SpecialFileError(path, "a symbolic link", e.errno) from None
        if e.errno in (errno.ENXIO, errno.EISDIR):
            try:
                kind = _kind(os.lstat(path).st_mode)
            except OSError:
                raise e from None
            raise SpecialFileError(path, kind, e.errno) from None
        raise
    try:
        kind_mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(kind_mode):
            raise SpecialFileError(path, _kind(kind_mode))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def name_beside(path: str | os.PathLike) -> str:
    """An unguessable name in ``path``'s folder for something that will be renamed over
    ``path``: ``.<name>.<16 hex>.part``. Create it exclusively (``O_EXCL``, ``mkdir``,
    ``link``): another user of the folder can then neither block it nor redirect it."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.{secrets.token_hex(8)}.part")


def mkdir_beside(path: str | os.PathLike) -> str:
    """A new empty folder beside ``path``, to be renamed over it (:func:`name_beside`),
    made by ``mkdir``, which fails rather than reuse or follow anything planted there.
    Returns its path; the caller renames it or removes it."""
    tmp = name_beside(path)
    os.mkdir(tmp)
    return tmp


def create_beside(path: str | os.PathLike, mode: int = 0o644, *,
                  umask: bool = False) -> tuple[int, str]:
    """A new empty file beside ``path``, to be renamed over it: ``.<name>.<16 hex>.part``,
    created exclusively (``O_EXCL``: nothing already there, a link or a hard link, is ever
    written through), opened read-write, with ``mode`` exactly (the umask does not apply),
    or with ``umask``, ``mode`` less the process's umask (as ``open`` creates files: a
    checkpoint stays private under ``umask 077``). Returns its descriptor and path; the
    caller renames it or removes it."""
    tmp = name_beside(path)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 mode if umask else 0o600)
    if umask:
        return fd, tmp
    try:
        os.fchmod(fd, mode)  # exactly: a metrics textfile must be readable by node_exporter
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    return fd, tmp


def atomic_write(path: str | os.PathLike, data: bytes | str, mode: int = 0o644, *,
                 durable: bool = False, umask: bool = False) -> None:
    """Replace ``path`` with ``data`` (str: UTF-8) at once: a reader sees the old file or the
    new one, never a part. The bytes go into :func:`create_beside`'s new file (never through
    a link or into a file planted beforehand), which is then renamed over ``path`` (a link at
    ``path`` is replaced, not followed). The file gets ``mode`` exactly, or with ``umask``
    ``mode`` less the process's umask (:func:`create_beside`).

    ``durable``: the file is fsynced before the rename and the directory after it, so that
    a power loss leaves the old file or the new one, not an empty one.
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    fd, tmp = create_beside(path, mode, umask=umask)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (a rename, a new or removed file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
