"""The job's memory key: binds what the memory tier holds (segments, peer replicas) to the
job, so that a restore never takes data that another job or user wrote at the job's names.

One key per checkpoint root: 32 random bytes in ``<root>/.ckpt-memory-key``, created by the
first writer (rank 0, under the root's writer lock) and read by every later one, so that a
restarted job (a new process, a new torchrun attempt) still knows the key its memory data
were signed with. Rank 0 reads it and sends it to the other ranks over the job's process
group. On a POSIX root the file is created exclusively (O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600)
and refused unless this user owns it and no one else may read or write it; on an object store
it is created once with a create-only write where the store offers one, and it is as private
as the bucket's access control. Step listings, retention, ``uncommitted()`` and the
collectors know nothing of it (they look at step directories and staging names only).

Every rank document and single-process manifest published into memory carries an
HMAC-SHA256 tag under this key (:func:`sign`); discovery and the restore check it
(:func:`verify`) before anything else is read: a step without a good tag is no candidate.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import secrets
import stat
from typing import Any

from storage_backends import Storage

KEY_NAME = ".ckpt-memory-key"
KEY_BYTES = 32
MAC_FIELD = "mac"


class MemoryKeyError(OSError):
    """The root's memory key cannot be used (named, with what to do)."""


def sign(key: bytes, data: bytes) -> str:
    """The HMAC-SHA256 tag of ``data`` under ``key``, as hex."""
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def verify(key: bytes, data: bytes, tag: Any) -> bool:
    """Whether ``tag`` is ``data``'s tag under ``key`` (compared in constant time)."""
    return isinstance(tag, str) and hmac.compare_digest(sign(key, data), tag)


def _canonical(doc: dict) -> bytes:
    """The bytes a document's tag covers: the document without its tag, keys sorted."""
    body = {k: v for k, v in doc.items() if k != MAC_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign_doc(key: bytes, doc: dict) -> dict:
    """``doc`` with its tag added (``"mac"``), covering every other field."""
    return {**doc, MAC_FIELD: sign(key, _canonical(doc))}


def verify_doc(key: bytes, doc: dict) -> bool:
    """Whether a parsed document carries a good tag over everything else in it."""
    return isinstance(doc, dict) and verify(key, _canonical(doc), doc.get(MAC_FIELD))


def job_key(storage: Storage, *, create: bool) -> bytes:
    """The root's memory key, created when missing and ``create`` (the caller holds the
    root's writer lock, so no other writer creates it at the same time).

    Raises:
        MemoryKeyError: the key file exists but cannot be trusted or read, or (without
            ``create``) it does not exist.
    """
    local = getattr(storage, "local_path", None)
    if callable(local):
        # (not local_path(KEY_NAME): it refuses a link there as if the key were missing)
        return _posix_key(os.path.join(local(""), KEY_NAME), create)
    try:
        key = storage.read(KEY_NAME)
    except FileNotFoundError:
        key = None
    if key is None and create:
        fresh = secrets.token_bytes(KEY_BYTES)
        create_only = getattr(storage, "create_only", None)
        if callable(create_only):
            if create_only(KEY_NAME, fresh) is None:  # created meanwhile: use that one
                key = storage.read(KEY_NAME)
            else:
                key = fresh
        else:
            storage.write(KEY_NAME, [fresh])
            key = fresh
    return _checked(key, f"{storage.url}/{KEY_NAME}")


def _posix_key(path: str, create: bool) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        if not create:
            raise MemoryKeyError(errno.ENOENT, "no memory key (a writer creates it)",
                                 path) from None
        return _create_posix_key(path)
    except OSError as e:  # a link (ELOOP) or no permission
        raise MemoryKeyError(e.errno, f"the memory key cannot be opened ({e.strerror}); "
                             "remove it, a writer creates a new one", path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise MemoryKeyError(errno.EPERM, f"the memory key must be a file of uid "
                                 f"{os.geteuid()} that no one else can read or write (it is "
                                 f"uid {st.st_uid}, mode {stat.filemode(st.st_mode)}); remove "
                                 "it, a writer creates a new one", path)
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES and create:  # a creation cut short by a crash: ours, replace it
        os.unlink(path)
        return _create_posix_key(path)
    return _checked(key, path)


def _create_posix_key(path: str) -> bytes:
    key = secrets.token_bytes(KEY_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return key


def _checked(key: bytes | None, where: str) -> bytes:
    if key is None:
        raise MemoryKeyError(errno.ENOENT, "no memory key (a writer creates it)", where)
    if len(key) != KEY_BYTES:
        raise MemoryKeyError(errno.EINVAL, f"the memory key is {len(key)} bytes, not "
                             f"{KEY_BYTES}; remove it, a writer creates a new one", where)
    return bytes(key)
