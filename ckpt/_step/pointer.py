"""Pointer files: the step a framework's checkpoint path stands for.

A framework integration (``trainer.integrations``) names checkpoints by the framework's paths
(Lightning's ``last.ckpt``, HF's ``checkpoint-500/``); ckpt keeps steps. A pointer (a small JSON
document: a format tag and the step, no paths) at such a path names the step. The integrations
write pointers; ``ckpt``'s command line follows them. It lives here, not in ``trainer``, so that
``ckpt`` never imports ``trainer``.
"""

from __future__ import annotations

import json
import os
import stat

from storage_backends.files import atomic_write

POINTER_FORMAT = "ckpt-pointer"
POINTER_NAME = "ckpt-step.json"  # the pointer inside an HF or Accelerate checkpoint folder
MAX_POINTER_BYTES = 4096


def write_pointer(path: str, step: int) -> None:
    """Atomically and durably (temp file, fsync, rename, fsync of the folder) write a
    pointer to ``step`` at ``path``, readable as the umask allows (as ``open`` creates
    files). The temp file has an unguessable name and is created exclusively, never through
    a link (:func:`storage_backends.files.atomic_write`): an entry planted in a shared
    folder cannot redirect the write."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, json.dumps({"format": POINTER_FORMAT, "step": step}), durable=True,
                 umask=True)


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
