"""Byte storage for checkpoints: one contract, one module per backend (knows nothing of torch)."""

from .base import Entry, LockHeldError, Storage, WriterLock
from .posix import PosixStorage
from .registry import open_storage

__all__ = ["Entry", "LockHeldError", "PosixStorage", "Storage", "WriterLock", "open_storage"]
