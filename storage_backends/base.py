"""The byte-level contract every storage backend implements.

ckpt calls these methods in this order for a save (each rank writes its own files):

1. ``begin(name, token)`` -> a staging location for step ``name`` (invisible to readers);
   every rank of one save passes the same ``token`` and gets the same location;
2. ``write(staging/file, buffers)`` for every data file, each durable when it returns;
3. (coordinator) ``commit(staging, name, manifest)`` publishes the step: after it returns the
   step is visible and complete, before it nothing of it is visible;
4. on failure, ``abort(staging)`` removes what was written.

Readers use ``list``, ``exists``, ``size``, ``read``, ``read_into``, ``read_blocks`` and
``open_reader`` on committed steps only.
Paths are relative to the root and use ``/``. Nothing here knows about torch.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence, Union

Buffer = Union[bytes, bytearray, memoryview]


class LockHeldError(BlockingIOError):
    """Another live writer holds the root's lock; ``holder`` is what it recorded (host, pid,
    since: a hand-edited or torn record may hold anything), ``who`` that for people."""

    def __init__(self, path: str, holder: dict) -> None:
        self.path = path
        self.holder = holder
        self.who = describe_holder(holder)
        super().__init__(f"{path} is locked by {self.who}")

    def __reduce__(self):
        return (type(self), (self.path, self.holder))


class NotAFileError(OSError):
    """A directory, FIFO, socket or device lies where a checkpoint file is read: damage in the
    checkpoint, not a file that is absent (``filename`` names it)."""


def describe_holder(holder: Any) -> str:
    """A lock holder for people: "host H, pid P, since 2026-12-01 10:00:00" (local time), or
    "an unknown process" when the record names none of them."""
    if not isinstance(holder, dict) or not holder.keys() & {"host", "pid", "since"}:
        return "an unknown process"
    since = holder.get("since")
    try:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
    except (TypeError, ValueError, OverflowError, OSError):
        when = "an unknown time"
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {when}"


class WriterLock(Protocol):
    """A held writer lock. ``release`` is idempotent."""

    def release(self) -> None: ...


@dataclass(frozen=True)
class Entry:
    """One name directly under a listed directory."""

    name: str
    is_dir: bool


class Reader(Protocol):
    """Reads of one file (:meth:`Storage.open_reader`)."""

    def read_into(self, start: int, out: memoryview) -> None: ...

    def close(self) -> None: ...


class Storage(abc.ABC):
    """A root under which checkpoints live. See the module docstring for the call order."""

    url: str
    # POSIX commits a re-saved step by moving the new data files into its directory and
    # renaming the new manifest over the old one; object stores refuse (their commit is a
    # create-only manifest), so the caller must retire the old step first.
    replaces_committed_steps: bool = True

    @abc.abstractmethod
    def list(self, path: str = "") -> list[Entry]:
        """Entries directly under ``path`` (empty when it does not exist)."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a file or directory exists at ``path``."""

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size in bytes of the file at ``path``; raises FileNotFoundError."""

    @abc.abstractmethod
    def write(self, path: str, buffers: Sequence[Buffer]) -> int:
        """Write the concatenation of ``buffers`` as the whole file ``path``; durable on return."""

    @abc.abstractmethod
    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        """Read ``length`` bytes (to the end when None) of ``path`` from ``start``."""

    @abc.abstractmethod
    def read_into(self, path: str, start: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``path`` from ``start``; raises EOFError when short."""

    def read_range_into(self, path: str, start: int, out: memoryview) -> None:
        """:meth:`read_into` for a reader that wants exactly these bytes: a storage that
        reads ahead or caches whole blocks (an object store) fetches this range alone."""
        self.read_into(path, start, out)

    # Bytes per read when a reader streams through a file to check it (``read_blocks``):
    # small enough to stay in the CPU cache where a file system's page cache serves the
    # reads; None where every read is a request of its own (object stores): read whole chunks.
    stream_block: int | None = None

    def read_blocks(self, path: str, start: int, length: int,
                    buffer: memoryview) -> Iterator[memoryview]:
        """Read bytes ``start..start+length`` of ``path`` into ``buffer``, one buffer-full at
        a time, yielding each filled part (valid until the next is read); raises EOFError
        when the file is short."""
        buffer = memoryview(buffer).cast("B")
        end = start + length
        while start < end:
            part = buffer[:min(len(buffer), end - start)]
            self.read_into(path, start, part)
            yield part
            start += len(part)

    def open_reader(self, path: str) -> Reader:
        """A handle for many reads of one file: ``reader.read_into(start, out)`` as
        :meth:`read_into`, then ``reader.close()``. A file system keeps the file open between
        the reads (one open per file, not per read); by default each read stands alone."""
        return PathReader(self, path)

    @abc.abstractmethod
    def delete(self, path: str) -> None:
        """Remove a file or a whole directory; missing paths are not an error."""

    @abc.abstractmethod
    def begin(self, name: str, token: str) -> str:
        """Create (idempotently: every rank calls it) and return an invisible staging location
        for the step directory ``name``; ``token`` is unique to this save attempt."""

    @abc.abstractmethod
    def commit(self, staging: str, name: str, manifest: bytes, manifest_name: str) -> None:
        """Publish ``staging`` as ``name`` with ``manifest`` written last. Atomic."""

    @abc.abstractmethod
    def abort(self, staging: str) -> None:
        """Remove an uncommitted staging location."""

    @abc.abstractmethod
    def uncommitted(self) -> list[str]:
        """Staging locations left by earlier writers (only safe to remove under the lock)."""

    @abc.abstractmethod
    def lock(self, owner: dict) -> WriterLock:
        """Take the root's writer lock now or raise :class:`LockHeldError`."""


def reads_are_requests(storage: Any) -> bool:
    """Whether every read of ``storage`` is a request of its own, with no page cache to
    stream through (an object store: no :attr:`Storage.stream_block`). ``storage`` may be
    a duck-typed source without the attribute."""
    return getattr(storage, "stream_block", None) is None


class PathReader:
    """The default :class:`Reader`: every read is a ``storage.read_into(path, ...)`` of its
    own (also for read-only sources that keep their descriptors themselves)."""

    def __init__(self, storage: Any, path: str) -> None:
        self.storage, self.path = storage, path

    def read_into(self, start: int, out: memoryview) -> None:
        self.storage.read_into(self.path, start, out)

    def close(self) -> None:
        pass
