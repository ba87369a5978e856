"""Writer locks: one writer per checkpoint root.

On POSIX file systems the lock is ``flock`` on a file opened without following links. The
kernel drops an flock when its holder dies, so a crashed writer's lock is taken over without
any staleness heuristics.
On Lustre this needs the ``flock`` mount option: ``localflock`` only excludes writers on the
same node, and ``noflock`` makes flock fail with ENOSYS (reported here with that advice).
The holder's host and pid go in a side file so a refused writer can say who holds the root.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import weakref

from .base import LockHeldError
from .files import atomic_write

LOCK_NAME = ".lock"
OWNER_NAME = ".lock.owner"
# Never follow a link planted where the lock or owner file goes (it could point outside).
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


# Locks this process holds. A forked child (a DataLoader worker, say) shares the lock's open
# file description, and an flock lasts until every descriptor of it is closed: a child that
# outlives its SIGKILLed parent for a few seconds would keep the root locked against the
# restarted job. So a forked child closes its copies at once (closing, never LOCK_UN, which
# would unlock the parent's lock too).
_HELD: weakref.WeakSet = weakref.WeakSet()


def _close_in_forked_child() -> None:
    for lock in list(_HELD):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_forked_child)


def describe_owner() -> dict:
    """This process as a lock holder: host, pid and when it took the lock."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}


class FlockWriterLock:
    """An flock on ``ROOT/.lock``, taken at once or refused with :class:`LockHeldError`.

    Raises OSError when the lock or owner file cannot be made (a read-only root, a full
    disk, a symbolic link where they go: ELOOP); nothing is left behind then.
    """

    def __init__(self, root: str, owner: dict) -> None:
        self._lock_path = os.path.join(root, LOCK_NAME)
        self._owner_path = os.path.join(root, OWNER_NAME)
        self._fd: int | None = None
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise LockHeldError(root, self._read_owner()) from None
            if e.errno == errno.ENOSYS:
                raise OSError(
                    e.errno,
                    f"flock is not supported on {root}: on Lustre mount with '-o flock' "
                    "(cluster-wide locks); 'localflock' only guards one node",
                ) from e
            raise
        self._fd = fd
        _HELD.add(self)
        try:
            self._write_owner(owner)
        except BaseException:
            self.release()
            raise

    def _write_owner(self, owner: dict) -> None:
        # A new file of a random name renamed over the record: a link planted at either
        # name is never written through.
        atomic_write(self._owner_path, json.dumps(owner), 0o644)

    def _read_owner(self) -> dict:
        try:
            with open(os.open(self._owner_path, os.O_RDONLY | _NOFOLLOW)) as f:
                owner = json.load(f)
        except (OSError, ValueError):
            return {}
        return owner if isinstance(owner, dict) else {}  # (hand-edited: a holder is a dict)

    @property
    def is_locked(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.unlink(self._owner_path)
            except FileNotFoundError:
                pass
            except OSError:  # a read-only root: the owner file says who held it, harmlessly
                pass
            fd, self._fd = self._fd, None
            _HELD.discard(self)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
