"""The root's owner: opens the root, holds its writer lock (rank 0, for every rank) and removes
what crashed saves and collections left behind."""

from __future__ import annotations

import logging
import os
from typing import Any

from storage_backends import LockHeldError, Storage, open_storage
from storage_backends.locks import describe_owner

from ckpt._shared.distributed import Group
from ckpt._retention.collect import collect
from ckpt.errors import CheckpointError, CheckpointLockedError, CheckpointNotFoundError, \
    StorageError

log = logging.getLogger("ckpt")


class RootOwner:
    """One manager's hold on its root: the storage, and the writer lock unless read-only.

    Args:
        root: a path, URL or :class:`storage_backends.Storage`.
        group: the ranks that share the root; rank 0 takes the lock and cleans up.
        read_only: take no lock; the root must exist.
        storage_options: for object-store roots, passed to the storage backend.

    Raises:
        CheckpointLockedError: another live writer holds the root.
        CheckpointNotFoundError: ``read_only`` and the root does not exist.
        StorageError: the root cannot be created or written.
    """

    def __init__(self, root: str | os.PathLike | Storage, group: Group, *, read_only: bool,
                 storage_options: dict | None = None) -> None:
        self.group, self.read_only = group, read_only
        self._lock: Any = None
        if read_only and isinstance(root, (str, os.PathLike)) and not _root_exists(root):
            raise CheckpointNotFoundError(f"checkpoint root {os.fspath(root)} does not exist",
                                          path=os.fspath(root))
        where = root.url if isinstance(root, Storage) else os.fspath(root)
        try:
            self.storage: Storage = open_storage(
                os.fspath(root) if isinstance(root, os.PathLike) else root,
                create=not read_only, storage_options=storage_options)
            if read_only and not isinstance(root, Storage) and _is_url(where) \
                    and not self.storage.exists(""):
                # An object store has no directories: a root is there when something is
                # stored under it (a missing bucket has nothing), as the CLI decides.
                raise CheckpointNotFoundError(
                    f"checkpoint root {where} does not exist: nothing is stored under it; "
                    "check the bucket and prefix (and the endpoint in storage_options)",
                    path=where)
        except CheckpointError:
            raise
        except OSError as e:  # e.g. a root that cannot be created (read-only parent, full disk)
            if read_only:
                raise StorageError(f"cannot open {where} to read: {e}", path=where) from e
            raise unwritable(where, e) from e
        self.url: str = self.storage.url
        if not read_only:
            self._take_lock_everywhere()

    def _take_lock_everywhere(self) -> None:
        """Rank 0 takes the lock and cleans up; every rank learns the outcome."""
        error = None
        if self.group.is_coordinator:
            try:
                self._take_lock()
                self._remove_leftovers()
            except CheckpointError as e:
                error = e
        message = self.group.broadcast(None if error is None else str(error))
        if error is not None:
            raise error
        if message is not None:
            raise CheckpointLockedError(f"rank 0 could not open {self.url}: {message}",
                                        path=self.url)

    def _take_lock(self) -> None:
        try:
            self._lock = self.storage.lock(describe_owner())
        except LockHeldError as e:
            raise CheckpointLockedError(
                f"{self.url} is locked by another writer ({e.who}); stop that job, point this "
                "one at another root, or open it with read_only=True to only read",
                path=self.url) from None
        except OSError as e:
            raise unwritable(self.url, e) from e

    def _remove_leftovers(self) -> None:
        """Remove what crashed saves and GCs left behind: we hold the lock, no one writes."""
        for name in self.storage.uncommitted():
            log.info("ckpt.cleanup removing=%s reason=uncommitted", name)
            self.storage.delete(name)
        try:
            collect(self.storage)  # unreferenced files of retired steps
        except CheckpointError as e:
            log.warning("ckpt.cleanup skipped: %s", e)

    def release(self) -> None:
        """Release the writer lock (if held); safe to call twice."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()


def unwritable(root: str, error: OSError) -> StorageError:
    """A root this writer cannot use, with the advice that fits its kind of storage: a
    directory (read-only, full, or a link where the lock goes) or an object store (a missing
    bucket, credentials that may not write, an endpoint that does not answer)."""
    if _is_url(root):
        advice = ("check that its bucket exists, that the credentials may list, read, write "
                  "and delete objects under it, and that the endpoint answers")
    else:
        advice = "check that it is writable, has free space and holds no symbolic link named .lock"
    return StorageError(f"cannot open {root} for writing: {error}; {advice}, or open it with "
                        "read_only=True to only read", path=root)


def _is_url(root: str) -> bool:
    """Whether ``root`` names an object store (or another fsspec file system), not a path."""
    return "://" in root and not root.startswith(("file://", "local://"))


def _root_exists(root: str | os.PathLike) -> bool:
    text = os.fspath(root)
    if _is_url(text):
        return True
    return os.path.isdir(text.split("://", 1)[1] if "://" in text else text)
