"""Choose a backend from a root's URL.

=============================  ====================================================
``/path``, ``file:///path``    :class:`~storage_backends.posix.PosixStorage` (also fsspec's
                               ``local:///path``: a local file system is never fsspec's)
``tensorstore+file:///path``   :class:`~storage_backends.tensorstore_store.TensorstoreStorage`
``tensorstore+s3://b/prefix``  the same, tensorstore's ``s3`` driver (``+gs://``: ``gcs``)
``s3://b/prefix``, ``memory://x``, any other fsspec protocol
                               :class:`~storage_backends.fsspec_store.FsspecStorage`
=============================  ====================================================
"""

from __future__ import annotations

from urllib.parse import urlparse

from .base import Storage
from .posix import PosixStorage

# Options that configure ckpt's object-store backends rather than fsspec or tensorstore.
BACKEND_OPTIONS = ("lease_ttl", "allow_unsafe_commit", "retries", "retry_delay", "block_size",
                   "deadline", "connect_timeout", "read_timeout")
# Of those, the ones only the fsspec backend knows (tensorstore keeps its own timeouts).
_FSSPEC_ONLY = ("block_size", "deadline", "connect_timeout", "read_timeout")


def open_storage(root: str | Storage, *, create: bool = True,
                 storage_options: dict | None = None, **options) -> Storage:
    """Open the storage behind ``root``.

    Args:
        root: a path or URL (see the module docstring), or a :class:`Storage` (returned as is).
        create: create the root if missing (object stores: check that the bucket exists).
        storage_options: for object stores, passed to fsspec (or merged into tensorstore's
            kvstore spec), except the backend's own keys (``lease_ttl``,
            ``allow_unsafe_commit``, ``retries``, ``retry_delay``; for fsspec also
            ``block_size``, ``deadline``, ``connect_timeout``, ``read_timeout``).
        **options: more options, merged into ``storage_options`` (so both
            ``open_storage(url, storage_options={...})`` and ``open_storage(url, **{...})``
            work).

    Raises:
        ValueError: a URL scheme no installed backend serves, or options for a local path.
    """
    if isinstance(root, Storage):
        return root
    root = str(root)
    merged = {**(storage_options or {}), **options}
    scheme = urlparse(root).scheme
    if scheme in ("", "file", "local"):  # fsspec's local:// would follow links, with no lock
        if merged:
            raise ValueError(f"storage options {sorted(merged)} do not apply to the local path "
                             f"{root!r}")
        return PosixStorage(root.split("://", 1)[1] if scheme else root, create=create)
    backend = {k: merged.pop(k) for k in BACKEND_OPTIONS if k in merged}
    if scheme.startswith("tensorstore+"):
        from .tensorstore_store import TensorstoreStorage

        for key in _FSSPEC_ONLY:
            backend.pop(key, None)
        return TensorstoreStorage(root, create=create, storage_options=merged, **backend)
    import fsspec

    if scheme not in fsspec.available_protocols() and scheme not in fsspec.registry:
        raise ValueError(f"no storage backend for {root!r}: {scheme}:// is neither a local "
                         "path, a tensorstore+ URL, nor an fsspec protocol")
    from .fsspec_store import FsspecStorage

    return FsspecStorage(root, create=create, storage_options=merged, **backend)
