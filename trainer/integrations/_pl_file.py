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
import secrets
import stat
import struct
import zipfile
from typing import Any, BinaryIO

import torch
import xxhash

CLAIM_FORMAT = "ckpt-lightning/1"
FILES_KEY = "lightning_files"  # manifest metadata: [record, ...] of the step's .ckpt files
_EOCD = b"PK\x05\x06"  # end of central directory: 22 bytes, then the comment
_EOCD_SIZE = 22
_MAX_CLAIM = 256
_BLOCK = 8 << 20


def write(checkpoint: Any, path: str, step: int) -> tuple[str, dict[str, Any]]:
    """``torch.save(checkpoint)`` into a hidden temporary file beside ``path``, claiming
    ``step``, flushed to disk. Returns the temporary path (``publish`` renames it) and the
    file's record for the step's manifest."""
    directory, name = os.path.split(path)
    # An unguessable name, created exclusively and never through a link.
    tmp = os.path.join(directory, f".{name}.{secrets.token_hex(8)}.part")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
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


def _append_claim(f: BinaryIO, step: int) -> None:
    comment = json.dumps({"format": CLAIM_FORMAT, "step": step}).encode()
    end = f.seek(0, os.SEEK_END)
    f.seek(max(0, end - _EOCD_SIZE))
    eocd = f.read(_EOCD_SIZE)
    if eocd[:4] != _EOCD or eocd[20:22] != b"\0\0":
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
    whole, parts = _digests(f, size, ranges)
    return {"name": name, "bytes": size, "xxh3": whole,
            "records": {k: [off, n, parts[k]] for k, (off, n) in ranges.items()}}


def _digests(f: BinaryIO, size: int, ranges: dict[str, tuple[int, int]]
             ) -> tuple[str, dict[str, str]]:
    """One pass over the file: the digest of all of it and of each named byte range."""
    whole, parts, pos = xxhash.xxh3_64(), {}, 0
    segments = []
    for key, (off, n) in sorted(ranges.items(), key=lambda kv: kv[1][0]):
        if off < pos or off + n > size:
            continue  # a recorded range this file cannot hold: it differs
        segments += [(None, pos, off - pos), (key, off, n)]
        pos = off + n
    segments.append((None, pos, size - pos))
    f.seek(0)
    for key, _, n in segments:
        h = xxhash.xxh3_64()
        while n > 0:
            block = f.read(min(n, _BLOCK))
            if not block:
                break
            whole.update(block)
            h.update(block)
            n -= len(block)
        if key is not None:
            parts[key] = h.hexdigest()
    return whole.hexdigest(), parts


def publish(tmp: str, path: str) -> None:
    """Rename the written file into place, durably."""
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def link(source: str, path: str) -> None:
    """``path`` becomes a second name of ``source`` (a hard link: the same bytes, once on
    disk), replacing what was at ``path`` atomically."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{secrets.token_hex(8)}.part")
    os.link(source, tmp)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    """A rename is durable once its folder is flushed (else a power loss may undo it)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def claim(path: str) -> int | None:
    """The step a ``.ckpt`` written by CkptCheckpointIO claims; None for any other file
    (Lightning's own, a link, a FIFO: opened without following or blocking)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if not stat.S_ISREG(os.fstat(fd).st_mode) or size < _EOCD_SIZE:
            return None
        tail = os.pread(fd, min(size, _EOCD_SIZE + _MAX_CLAIM), max(0, size - _EOCD_SIZE
                                                                      - _MAX_CLAIM))
    except OSError:
        return None
    finally:
        os.close(fd)
    at = tail.rfind(_EOCD)
    while at >= 0:
        if at + _EOCD_SIZE + struct.unpack("<H", tail[at + 20:at + 22])[0] == len(tail) \
                and at + 22 <= len(tail):
            return _parse(tail[at + _EOCD_SIZE:])
        at = tail.rfind(_EOCD, 0, at)
    return None


def _parse(comment: bytes) -> int | None:
    try:
        doc = json.loads(comment)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != CLAIM_FORMAT:
        return None
    step = doc.get("step")
    return step if type(step) is int and step >= 0 else None


def problem(f: BinaryIO, records: list[dict[str, Any]], name: str) -> str | None:
    """What differs between the open file ``f`` (named ``name``) and the records its step
    holds (a file matches any one of them: a hard link is a second name of the same bytes);
    None when it matches one."""
    if not records:
        return f"{name}: its step records no file"
    size = os.fstat(f.fileno()).st_size
    mine = next((r for r in records if r.get("name") == name), records[0])
    ranges = {k: (v[0], v[1]) for k, v in mine.get("records", {}).items()}
    whole, parts = _digests(f, size, ranges)
    if any(r.get("bytes") == size and r.get("xxh3") == whole for r in records):
        return None
    if size != mine.get("bytes"):
        return (f"{name} fails its digest (xxh3-64): it has {size} bytes, its step "
                f"recorded {mine.get('bytes')}")
    bad = [k for k, v in mine.get("records", {}).items() if parts.get(k) != v[2]]
    where = f"record {', '.join(sorted(bad)[:3])}" if bad else "the zip headers"
    return f"{name} fails its digest (xxh3-64): {where} differ"
