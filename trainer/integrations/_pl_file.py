"""The ``.ckpt`` file that :class:`~trainer.integrations.lightning.CkptCheckpointIO` writes: a
``torch.save`` file, as Lightning's own IO writes it, that ``torch.load`` and ``pl_load`` read,
and whose bytes ckpt's step references by digest instead of holding them a second time.

torch saves a zip archive of uncompressed ("stored") records: ``data.pkl`` (the structure) and
one record per tensor storage. The archive's comment (a standard zip field that torch's reader,
``zipfile`` and ``unzip`` all skip) carries a *claim*: JSON naming the ckpt step this file
belongs to, so a load knows which step's digests to check and where to fall back from. The
step's manifest metadata holds a *record* per file: its name, size, xxh3-64 digest, and the
offset, size and digest of each archive record, so a failing file names the tensor record whose
bytes changed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import zipfile
from typing import Any, BinaryIO, Callable

import torch

from ckpt.tools import create_beside, fsync_dir, name_beside

# The read side (claims, records, checks) is shared with `ckpt verify FILE.ckpt`.
from verify.lightning_file import (EOCD, EOCD_SIZE, CLAIM_FORMAT, FILES_KEY, claim,
                                   digests, is_reservation, problem, reservation)

__all__ = ["CLAIM_FORMAT", "FILES_KEY", "claim", "is_reservation", "link", "problem",
           "publish", "remove_leftovers", "remove_reservations", "reserve", "write"]


def write(checkpoint: Any, path: str, step: int) -> tuple[str, dict[str, Any]]:
    """``torch.save(checkpoint)`` into a hidden temporary file beside ``path``, claiming
    ``step``, flushed to disk. Returns the temporary path (``publish`` renames it) and the
    file's record for the step's manifest."""
    name = os.path.basename(path)
    # An unguessable name, created exclusively and never through a link.
    fd, tmp = create_beside(path, 0o644, umask=True)
    try:
        with os.fdopen(fd, "w+b") as f:
            torch.save(checkpoint, f)
            _append_claim(f, step)
            f.flush()
            os.fsync(f.fileno())
            record = _record(f, name)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return tmp, record


def reserve(path: str, step: int) -> None:
    """Hold ``path``'s place for step ``step``'s file written in the background, when nothing
    is there (an older file of that name stays until the new one is renamed over it):
    Lightning links ``last.ckpt`` to the file as soon as the save returns, and a link to no
    file is no last checkpoint to Lightning, which would then start from step 0."""
    try:  # created exclusively, never through a link
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
    except FileExistsError:
        return
    with os.fdopen(fd, "wb") as f:
        f.write(reservation(step))


def _append_claim(f: BinaryIO, step: int) -> None:
    comment = json.dumps({"format": CLAIM_FORMAT, "step": step}).encode()
    end = f.seek(0, os.SEEK_END)
    f.seek(max(0, end - EOCD_SIZE))
    eocd = f.read(EOCD_SIZE)
    if eocd[:4] != EOCD or eocd[20:22] != b"\0\0":
        raise RuntimeError(f"torch.save wrote {end} bytes that do not end as a zip archive "
                           "without a comment (torch's format): CkptCheckpointIO cannot record "
                           "them. Is torch.save replaced (a mock), or this torch too old?")
    f.seek(-2, os.SEEK_END)
    f.write(struct.pack("<H", len(comment)) + comment)


def _record(f: BinaryIO, name: str) -> dict[str, Any]:
    """The file's size and digest, and each archive record's (offset, size, digest)."""
    ranges = {}
    f.seek(0)
    with zipfile.ZipFile(f) as archive:
        for info in archive.infolist():
            f.seek(info.header_offset)
            header = f.read(30)  # local file header: name and extra field lengths at 26
            n, m = struct.unpack("<HH", header[26:30])
            ranges[info.filename] = (info.header_offset + 30 + n + m, info.compress_size)
    size = os.fstat(f.fileno()).st_size
    whole, parts = digests(f, size, ranges)
    return {"name": name, "bytes": size, "xxh3": whole,
            "records": {k: [off, n, parts[k]] for k, (off, n) in ranges.items()}}


# The hidden temporary names ``write`` and ``link`` use (``.<name>.<16 hex>.part``).
_PART = re.compile(r"^\..+\.[0-9a-f]{16}\.part$")


def remove_leftovers(directory: str) -> list[str]:
    """Delete the temporary files of writes that died in ``directory`` (a SIGKILL, or a
    SIGTERM past its bound, in the middle of a write: each leaves a file as large as a
    checkpoint). The caller holds the folder's root lock, so no live write owns one.
    Returns the names removed."""
    return _remove(directory, lambda entry: _PART.match(entry.name) is not None)


def remove_reservations(directory: str, keep: str) -> list[str]:
    """Delete the places (:func:`reserve`) that writes which died held in ``directory``, but
    ``keep``, the file just written: after its write, so a link Lightning moved to it (from
    a place held before) never dangles in between. The caller holds the folder's root lock.
    Returns the names removed."""
    return _remove(directory, lambda entry: entry.name.endswith(".ckpt")
                   and entry.path != keep and is_reservation(entry.path))


def _remove(directory: str, chosen: Callable[[os.DirEntry], bool]) -> list[str]:
    removed = []
    for entry in os.scandir(directory):
        if entry.is_file(follow_symlinks=False) and chosen(entry):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(entry.name)
    return removed


def publish(tmp: str, path: str) -> None:
    """Rename the written file into place, durably."""
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def link(source: str, path: str) -> None:
    """``path`` becomes a second name of ``source`` (a hard link: the same bytes, once on
    disk), replacing what was at ``path`` atomically."""
    tmp = name_beside(path)
    os.link(source, tmp)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))
