"""Pointer files: the step a framework's checkpoint path stands for.

A framework integration (``trainer.integrations``) names checkpoints by the framework's paths
(Lightning's ``last.ckpt``, HF's ``checkpoint-500/``); ckpt keeps steps. A pointer (a small JSON
document: a format tag and the step, no paths) at such a path names the step. The integrations
write pointers; ``ckpt``'s command line follows them. It lives here, not in ``trainer``, so that
``ckpt`` never imports ``trainer``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat

from storage_backends import posix

POINTER_FORMAT = "ckpt-pointer"
POINTER_NAME = "ckpt-step.json"  # the pointer inside an HF or Accelerate checkpoint folder
MAX_POINTER_BYTES = 4096


def write_pointer(path: str, step: int) -> None:
    """Atomically and durably (temp file, fsync, rename, fsync of the folder) write a
    pointer to ``step`` at ``path``."""
    directory, name = os.path.split(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # An unguessable name, created exclusively and never through a link: a file or link
    # planted in a shared folder under the temp name cannot redirect the write elsewhere.
    tmp = os.path.join(directory, f".{name}.{secrets.token_hex(8)}.part")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"format": POINTER_FORMAT, "step": step}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    posix.fsync_dir(directory)  # else a power loss may bring back the previous pointer


def read_pointer(path: str) -> int | None:
    """The step a pointer file names, or None when ``path`` is not a pointer file (a link, a
    FIFO, a directory, a file too large to be one: each is opened without following or
    blocking, and checked on the open descriptor)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_POINTER_BYTES:
            return None
        doc = json.loads(os.read(fd, MAX_POINTER_BYTES + 1))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)
    if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT:
        return None
    step = doc.get("step")
    return step if type(step) is int and step >= 0 else None
