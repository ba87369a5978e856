"""Choose a backend from a root's URL."""

from __future__ import annotations

from urllib.parse import urlparse

from .base import Storage
from .posix import PosixStorage


def open_storage(root: str, *, create: bool = True, **options) -> Storage:
    """Open the storage behind ``root``: a path or ``file://`` URL is the POSIX backend.

    Raises:
        ValueError: for a URL scheme no installed backend serves.
    """
    if isinstance(root, Storage):
        return root
    root = str(root)
    scheme = urlparse(root).scheme
    if scheme in ("", "file"):
        path = root[len("file://"):] if scheme == "file" else root
        return PosixStorage(path, create=create, **options)
    raise ValueError(
        f"no storage backend for {root!r}: use a local path (object storage comes with "
        "the fsspec backend)"
    )
