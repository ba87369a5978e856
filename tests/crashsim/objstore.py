"""The explorer for object storage: the request sequence of a save through the fsspec backend
(``memory://``: the same code path as S3, with its conditional writes emulated exactly).

An object store has no fsync and no rename: each request either happened or did not, whole.
So the crash states are the prefixes of the request sequence (the store's content before each
request, and at the end). And because requests fail and are retried, each request is also
made to fail once (the retry must succeed), to be performed but answered with an error (a
lost response: the retry repeats it), and to fail for good (the save must fail cleanly).
"""

from __future__ import annotations

import contextlib
import errno
import uuid
from typing import Callable, Iterator

from fsspec.implementations.memory import MemoryFileSystem

from storage_backends.fsspec_store import FsspecStorage
from storage_backends.lease import LEASE_NAME

# transient: fails once, the retry succeeds; lost: performed, but answered with a transient
# error, so the retry repeats it; fails: a non-transient error, not retried (the save fails).
MODES = ("transient", "lost", "fails")


def contents(root: str) -> dict[str, bytes]:
    """The objects under ``memory://root`` by relative key (the memory store is global),
    without the writer's lease: the crashed writer is gone, and a writer restarted on its
    machine takes a dead process's lease over at once (tested in test_storage_conformance);
    here the lease would name this very process, still alive."""
    prefix = "/" + root.strip("/") + "/"
    return {k[len(prefix):]: bytes(f.getvalue()) for k, f in list(MemoryFileSystem.store.items())
            if k.startswith(prefix) and not k[len(prefix):].startswith(LEASE_NAME)}


def materialize(objects: dict[str, bytes]) -> str:
    """A fresh ``memory://`` root holding ``objects``; returns its URL."""
    root = f"crash-{uuid.uuid4().hex}/root"
    fs = MemoryFileSystem()
    for key, data in objects.items():
        fs.pipe_file(f"/{root}/{key}", data)
    return f"memory://{root}"


@contextlib.contextmanager
def requests(on_request: Callable[[int, str, str], str | None]) -> Iterator[list[tuple]]:
    """Every attempt of every storage request inside the block: ``on_request(i, what, path)``
    runs before the i-th and may answer "fail" (raise before it), "lost" (raise after it)
    or "broken" (raise a non-transient error, before it). Yields the log of requests."""
    original = FsspecStorage._call
    log: list[tuple] = []

    def _call(self, what, path, fn, *args):
        def attempt(*a):
            i = len(log)
            log.append((what, path))
            action = on_request(i, what, path)
            if action == "fail":
                raise ConnectionResetError(errno.ECONNRESET, "injected: connection reset")
            if action == "broken":
                raise OSError(errno.EIO, "injected: the store failed")
            result = fn(*a)
            if action == "lost":
                raise ConnectionResetError(errno.ECONNRESET, "injected: response lost")
            return result

        return original(self, what, path, attempt, *args)

    FsspecStorage._call = _call
    try:
        yield log
    finally:
        FsspecStorage._call = original


def fault(mode: str, at: int) -> Callable[[int, str, str], str | None]:
    """The ``on_request`` of one fault ``mode`` at request ``at`` (counting attempts)."""
    action = {"transient": "fail", "lost": "lost", "fails": "broken"}[mode]

    def on_request(i: int, what: str, path: str) -> str | None:
        return action if i == at else None

    return on_request
