"""The ``.ckpt`` files that ``trainer.integrations.lightning.CkptCheckpointIO`` writes, read:
which step a file claims, where that step lies, and whether the file's bytes are the ones the
step recorded. The plugin's load and ``ckpt verify FILE.ckpt`` check a file with these same
functions (the writer imports them from here: verify/ cannot import trainer/).

A file is a ``torch.save`` zip archive whose comment (a standard zip field that torch's
reader, ``zipfile`` and ``unzip`` skip) carries a *claim*: JSON naming its ckpt step. The
step, in the folder's hidden sibling root ``.<folder>.ckpt``, holds in its manifest metadata
a *record* per file (:data:`FILES_KEY`): its name, size, xxh3-64 digest, and the offset, size
and digest of each archive record.

Threat model: whoever can write the folder can put any file there, claiming any step (a
FIFO, a link, a huge comment, a malformed record in a manifest they wrote). Nothing here
unpickles, follows a link, blocks on a FIFO or trusts a record's shape: a claim is read from
the file's last 278 bytes, records are validated before use, and a sibling root that is a
link or belongs to another user than the file's is not used to vouch for it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import struct
from typing import Any, BinaryIO

import xxhash

from .report import count

CLAIM_FORMAT = "ckpt-lightning/1"
FILES_KEY = "lightning_files"  # manifest metadata: [record, ...] of the step's .ckpt files
EOCD = b"PK\x05\x06"  # end of central directory: 22 bytes, then the comment
EOCD_SIZE = 22
_MAX_CLAIM = 256
_BLOCK = 8 << 20
_HEX16 = frozenset("0123456789abcdef")


def claim(path: str) -> int | None:
    """The step a ``.ckpt`` written by CkptCheckpointIO claims; None for any other file
    (Lightning's own, a link, a FIFO: opened without following or blocking)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if not stat.S_ISREG(os.fstat(fd).st_mode) or size < EOCD_SIZE:
            return None
        tail = os.pread(fd, min(size, EOCD_SIZE + _MAX_CLAIM), max(0, size - EOCD_SIZE
                                                                      - _MAX_CLAIM))
    except OSError:
        return None
    finally:
        os.close(fd)
    at = tail.rfind(EOCD)
    while at >= 0:
        if at + EOCD_SIZE + struct.unpack("<H", tail[at + 20:at + 22])[0] == len(tail) \
                and at + 22 <= len(tail):
            return _parse(tail[at + EOCD_SIZE:])
        at = tail.rfind(EOCD, 0, at)
    return None


def reservation(step: int) -> bytes:
    """The file that holds the place of step ``step``'s file while it is written in the
    background: an empty zip archive whose claim names the step and says so. A link made to
    it at once (Lightning's ``save_last="link"``) names a file that exists; loading it falls
    back to an earlier step, as for any file whose step is not committed."""
    comment = json.dumps({"format": CLAIM_FORMAT, "step": step, "reserved": True}).encode()
    return EOCD + b"\0" * 16 + struct.pack("<H", len(comment)) + comment


def is_reservation(path: str) -> bool:
    """Whether ``path`` is a :func:`reservation` (opened once, without following a link or
    blocking; anything but a regular file is not one)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        raw = os.pread(fd, EOCD_SIZE + _MAX_CLAIM + 1, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    step = _parse(raw[EOCD_SIZE:])
    return step is not None and raw == reservation(step)


def _parse(comment: bytes) -> int | None:
    try:
        doc = json.loads(comment)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != CLAIM_FORMAT:
        return None
    step = doc.get("step")
    return step if type(step) is int and step >= 0 else None


def digests(f: BinaryIO, size: int, ranges: dict[str, tuple[int, int]]
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


def records_problem(records: Any) -> str | None:
    """What is wrong with a step's :data:`FILES_KEY` metadata (it came from a manifest, so
    anyone who wrote the root chose its shape); None when it is a list of file records."""
    if not isinstance(records, list) or not records:
        return "its step records no .ckpt file"
    for r in records:
        ok = isinstance(r, dict) and isinstance(r.get("name"), str) and _count(r.get("bytes")) \
            and _hex(r.get("xxh3")) and isinstance(r.get("records"), dict) and all(
                isinstance(k, str) and isinstance(v, list) and len(v) == 3 and _count(v[0])
                and _count(v[1]) and _hex(v[2]) for k, v in r["records"].items())
        if not ok:
            return "its step's record of the .ckpt files is malformed (not what ckpt writes)"
    return None


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _hex(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 16 and set(value) <= _HEX16


def problem(f: BinaryIO, records: Any, name: str) -> str | None:
    """What differs between the open file ``f`` (named ``name``) and the records its step
    holds (a file matches any one of them: a hard link is a second name of the same bytes);
    None when it matches one."""
    bad_records = records_problem(records)
    if bad_records is not None:
        return f"{name}: {bad_records}"
    size = os.fstat(f.fileno()).st_size
    mine = next((r for r in records if r["name"] == name), records[0])
    ranges = {k: (v[0], v[1]) for k, v in mine["records"].items()}
    whole, parts = digests(f, size, ranges)
    if any(r["bytes"] == size and r["xxh3"] == whole for r in records):
        return None
    if size != mine["bytes"]:
        return (f"{name} fails its digest (xxh3-64): it has {count(size, 'byte')}, its step "
                f"recorded {mine['bytes']}")
    bad = [k for k, v in mine["records"].items() if parts.get(k) != v[2]]
    where = f"record {', '.join(sorted(bad)[:3])}" if bad else "the zip headers"
    return f"{name} fails its digest (xxh3-64): {where} differ"


def sibling_root(folder: str) -> str:
    """Where the steps of the files in ``folder`` lie: its hidden sibling ``.<name>.ckpt``,
    or ``folder`` itself when it holds ``step-*`` folders (written by earlier versions) and
    has no sibling."""
    folder = os.path.abspath(folder)
    parent, name = os.path.split(folder.rstrip(os.sep)) if folder != os.sep else ("/", "")
    sibling = os.path.join(parent, f".{name or 'root'}.ckpt")
    if not os.path.lexists(sibling) and os.path.isdir(folder) and any(
            n.startswith("step-") for n in os.listdir(folder)):
        return folder
    return sibling


@dataclasses.dataclass(frozen=True)
class LightningFile:
    """A ``.ckpt`` that claims ``step`` of the root ``root``."""

    path: str
    step: int
    root: str


def locate(path: str) -> LightningFile | None:
    """The step and root of the CkptCheckpointIO file at ``path`` (a link to a file in the
    same folder, as ``save_last="link"`` makes, is read as that file); None when ``path`` is
    not such a file."""
    full = os.path.abspath(path)
    if os.path.islink(full):
        target = os.path.realpath(full)
        if os.path.dirname(target) != os.path.realpath(os.path.dirname(full)):
            return None
        full = os.path.join(os.path.dirname(full), os.path.basename(target))
    step = claim(full)
    if step is None:
        return None
    return LightningFile(full, step, sibling_root(os.path.dirname(full)))


def folder_of(root: str) -> str | None:
    """The folder whose ``.ckpt`` files the steps of the local ``root`` record: ``ckpts``
    for ``.ckpts.ckpt`` beside it; None when ``root`` is not such a sibling root."""
    parent, name = os.path.split(os.path.abspath(root).rstrip(os.sep))
    if not (name.startswith(".") and name.endswith(".ckpt") and len(name) > 6):
        return None
    folder = os.path.join(parent, name[1:-5])
    if not os.path.isdir(folder) or sibling_root(folder) != os.path.join(parent, name):
        return None
    return folder


def files_of(folder: str, step: int, root: str) -> list[LightningFile]:
    """The regular ``.ckpt`` files of ``folder`` that claim ``step`` (links are not
    followed), one name per file (a hard link is the same bytes: checked once)."""
    found, seen = [], set()
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if not entry.name.endswith(".ckpt") or not entry.is_file(follow_symlinks=False):
            continue
        inode = entry.inode()
        if inode not in seen and claim(entry.path) == step:
            seen.add(inode)
            found.append(LightningFile(entry.path, step, root))
    return found


def claims_in(folder: str, root: str) -> dict[int, list[LightningFile]]:
    """Every regular ``.ckpt`` file of ``folder`` written by CkptCheckpointIO, by the step it
    claims (links are not followed; a hard link is one file, listed under its first name)."""
    found: dict[int, list[LightningFile]] = {}
    seen = set()
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if not entry.name.endswith(".ckpt") or not entry.is_file(follow_symlinks=False):
            continue
        step = claim(entry.path)
        if step is not None and entry.inode() not in seen:
            seen.add(entry.inode())
            found.setdefault(step, []).append(LightningFile(entry.path, step, root))
    return found


def untrusted_root(found: LightningFile) -> str | None:
    """Why ``found.root`` cannot vouch for the file (a link, not a folder, or owned by
    another user than the file: someone else may have planted its digests); None if it can."""
    try:
        st, mine = os.lstat(found.root), os.lstat(found.path)
    except FileNotFoundError:
        return None  # no root: reported as a missing step
    if stat.S_ISLNK(st.st_mode):
        return "is a link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != mine.st_uid:
        return f"is owned by uid {st.st_uid}, the file by uid {mine.st_uid}"
    return None


def check(found: LightningFile, records: Any, *, digest: bool) -> tuple[str | None, int]:
    """Check the file against its step's ``records``: its size (``digest=False``), or every
    byte (the whole file's xxh3 and each archive record's). Returns (what failed or None,
    the file's size). Opened without following a link or blocking on a FIFO."""
    name = os.path.basename(found.path)
    bad_records = records_problem(records)
    if bad_records is not None:
        return f"{name}: {bad_records}", 0
    try:
        fd = os.open(found.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        return f"{name} cannot be opened: {e.strerror}", 0
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return f"{name} is not a regular file", 0
        if digest:
            return problem(f, records, name), st.st_size
        if any(r["bytes"] == st.st_size for r in records):
            return None, st.st_size
        mine = next((r for r in records if r["name"] == name), records[0])
        return (f"{name} has {count(st.st_size, 'byte')}, its step recorded {mine['bytes']}",
                st.st_size)


def describe_foreign(path: str) -> str:
    """What a file that claims no step is, for a one-line error."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        return f"cannot be opened ({e.strerror})"
    try:
        head = os.pread(fd, 4, 0) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    finally:
        os.close(fd)
    wanted = ("give a checkpoint root, a step directory, a ckpt.save directory or a .ckpt "
              "written by CkptCheckpointIO")
    if head is None:
        return f"is not a regular file (a FIFO, a socket, a device): {wanted}"
    if head == b"PK\x03\x04":
        return ("is a torch.save file that names no ckpt step (written by Lightning's own IO "
                "or another tool, or a CkptCheckpointIO file cut short or appended to: its step "
                "is named at its very end): ckpt holds no digests to check it against; load it "
                "with torch.load, or verify the folder's sibling root (ckpt verify --all)")
    return f"is not a checkpoint ckpt knows (a file that names no ckpt step): {wanted}"
