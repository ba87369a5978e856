"""Byte storage for checkpoints: one contract, one module per backend (knows nothing of torch).

The object-store backends import their libraries (fsspec/s3fs, tensorstore) only when one is
opened, so importing this package stays cheap.
"""

from .base import Entry, LockHeldError, NotAFileError, Storage, WriterLock, reads_are_requests
from .fsspec_store import FsspecStorage
from .posix import PosixStorage
from .registry import open_storage
from .tensorstore_store import TensorstoreStorage

__all__ = ["Entry", "FsspecStorage", "LockHeldError", "NotAFileError", "PosixStorage", "Storage",
           "TensorstoreStorage", "WriterLock", "open_storage", "reads_are_requests"]
