"""Writer locks: one writer per checkpoint root.

On POSIX file systems the lock is ``flock`` through filelock. The kernel drops an flock when
its holder dies, so a crashed writer's lock is taken over without any staleness heuristics.
On Lustre this needs the ``flock`` mount option: ``localflock`` only excludes writers on the
same node, and ``noflock`` makes flock fail with ENOSYS (reported here with that advice).
The holder's host and pid go in a side file so a refused writer can say who holds the root.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time

import filelock

from .base import LockHeldError

LOCK_NAME = ".lock"
OWNER_NAME = ".lock.owner"


def describe_owner() -> dict:
    """This process as a lock holder: host, pid and when it took the lock."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}


class FlockWriterLock:
    """An flock on ``ROOT/.lock``, taken at once or refused with :class:`LockHeldError`."""

    def __init__(self, root: str, owner: dict) -> None:
        self._lock_path = os.path.join(root, LOCK_NAME)
        self._owner_path = os.path.join(root, OWNER_NAME)
        # thread_local=False: a manager may be closed from another thread than it was made in.
        self._lock = filelock.FileLock(
            self._lock_path, thread_local=False, fallback_to_soft=False
        )
        try:
            self._lock.acquire(blocking=False)
        except filelock.Timeout:
            raise LockHeldError(root, self._read_owner()) from None
        except OSError as e:
            if e.errno == errno.ENOSYS:
                raise OSError(
                    e.errno,
                    f"flock is not supported on {root}: on Lustre mount with '-o flock' "
                    "(cluster-wide locks); 'localflock' only guards one node",
                ) from e
            raise
        tmp = f"{self._owner_path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(owner, f)
        os.replace(tmp, self._owner_path)

    def _read_owner(self) -> dict:
        try:
            with open(self._owner_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def release(self) -> None:
        if self._lock.is_locked:
            try:
                os.unlink(self._owner_path)
            except FileNotFoundError:
                pass
            self._lock.release()
