"""Verified steps: a committed step that the training after it confirmed healthy.

A step's manifest is immutable once committed, so "verified" is a marker of its own beside
it, ``step-XXXXXXXX/verified.json``, written once (create-only) by the root's one writer (the
lock holder, rank 0). It records what was checked (the caller's evidence: the window of
healthy steps, the step it was confirmed at, ...), when, and the SHA-256 of the manifest it
vouches for: a step saved again under the same number (a rollback's new timeline) keeps no
verdict about the old save. Every marker is validated on read like any other metadata: a
damaged, hand-edited or stale one is reported (``problem``) and never trusted, and only the
markers of committed steps are ever read (a marker left in a retired step's folder means
nothing).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import secrets
import time
from collections.abc import Iterable, Mapping
from typing import Any

from storage_backends import NotAFileError, PosixStorage, Storage
from storage_backends.lease import ConditionalStorage
from storage_backends.posix import SymlinkRefusedError, fsync_dir

from ckpt._format.names import MANIFEST_NAME, step_dir

log = logging.getLogger("ckpt")

VERIFIED_NAME = "verified.json"
VERIFIED_FORMAT = "ckpt-verified"
MAX_MARKER_BYTES = 16 << 10
MAX_EVIDENCE_BYTES = 8 << 10
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
_FIELDS = frozenset({"format", "step", "manifest_sha256", "time", "evidence"})


@dataclasses.dataclass(frozen=True)
class Verification:
    """A trusted marker: ``step`` was verified at ``time`` (seconds since the epoch), with
    the writer's ``evidence`` (what was checked)."""

    step: int
    time: float
    evidence: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class MarkerState:
    """What a committed step's marker says: ``verification`` when it is trusted; ``problem``
    when a marker is there but is not (damaged, hand-edited, or written for another save
    of the step number); both None when the step has no marker."""

    step: int
    verification: Verification | None = None
    problem: str | None = None

    @property
    def status(self) -> str:
        """``"verified"``, ``"unverified"`` or ``"untrusted"``."""
        if self.verification is not None:
            return "verified"
        return "unverified" if self.problem is None else "untrusted"


def marker_path(step: int) -> str:
    """Where ``step``'s marker lies, relative to the root."""
    return f"{step_dir(step)}/{VERIFIED_NAME}"


def _manifest_sha256(storage: Storage, location: str) -> str:
    """The SHA-256 of the manifest at ``location`` (FileNotFoundError: not committed)."""
    return hashlib.sha256(storage.read(f"{location}/{MANIFEST_NAME}")).hexdigest()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_marker(raw: bytes, step: int, manifest_sha256: str) -> Verification:
    """Validate a marker's bytes for ``step`` whose manifest hashes to ``manifest_sha256``;
    ValueError says what is wrong with it."""
    if len(raw) > MAX_MARKER_BYTES:
        raise ValueError(f"larger than {MAX_MARKER_BYTES} bytes")
    try:
        doc = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise ValueError(f"not JSON ({type(e).__name__})") from None
    if not isinstance(doc, dict) or doc.get("format") != VERIFIED_FORMAT:
        raise ValueError(f"not a {VERIFIED_FORMAT} document")
    if set(doc) != _FIELDS:
        missing, unknown = sorted(_FIELDS - set(doc)), sorted(set(doc) - _FIELDS)
        raise ValueError(f"missing fields {missing}, unknown fields {unknown[:5]}"
                         f"{' ...' if len(unknown) > 5 else ''}")
    if type(doc["step"]) is not int or doc["step"] != step:
        raise ValueError(f"names step {doc['step']!r}, not step {step} beside whose "
                         "manifest it lies (copied from another step?)")
    digest = doc["manifest_sha256"]
    if not isinstance(digest, str) or not _SHA256.match(digest):
        raise ValueError("manifest_sha256 is not a SHA-256 in hex")
    if digest != manifest_sha256:
        raise ValueError("written for another save of this step number (its manifest "
                         "differs), e.g. the timeline a rollback replaced")
    when = doc["time"]
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when):
        raise ValueError(f"time is not a number: {when!r}")
    if not isinstance(doc["evidence"], dict):
        raise ValueError("evidence is not an object")
    return Verification(step, float(when), doc["evidence"])


def read_marker(storage: Storage, step: int, location: str | None = None) -> MarkerState:
    """The marker of the committed ``step`` (one the caller listed), validated against its
    manifest; never raises for a bad marker: that is its ``problem``. Raises
    FileNotFoundError when a marker is there but the step's manifest is not (retired since
    the listing), OSError when the storage fails. ``location``: the step's directory
    (default: its name in a root)."""
    location = location or step_dir(step)
    try:
        raw = storage.read(f"{location}/{VERIFIED_NAME}", 0, MAX_MARKER_BYTES + 1)
    except SymlinkRefusedError:  # (a FileNotFoundError) planted: never followed
        return MarkerState(step, problem=f"{VERIFIED_NAME} is a symbolic link (never "
                                         "followed); remove it")
    except (FileNotFoundError, NotADirectoryError):
        return MarkerState(step)  # (most steps: one request, the manifest is not read)
    except NotAFileError as e:  # a directory, FIFO or link planted under the marker's name
        return MarkerState(step, problem=f"{VERIFIED_NAME} is not a file ({e.strerror})")
    try:
        return MarkerState(step, parse_marker(raw, step, _manifest_sha256(storage, location)))
    except ValueError as e:
        return MarkerState(step, problem=f"{VERIFIED_NAME} is not trusted: {e}")


def marker_states(storage: Storage, steps: Iterable[int]) -> dict[int, MarkerState]:
    """The marker of each of the committed ``steps`` (a step retired meanwhile is left out);
    an untrusted marker is logged."""
    out = {}
    for step in steps:
        try:
            state = read_marker(storage, step)
        except (FileNotFoundError, NotADirectoryError, NotAFileError):
            continue  # retired since the listing, or a damaged manifest: never verified
        if state.problem is not None:
            log.warning("ckpt.verified step=%d untrusted: %s", step, state.problem)
        out[step] = state
    return out


def verified_steps(storage: Storage, steps: Iterable[int]) -> dict[int, Verification]:
    """The trusted verifications among the committed ``steps``."""
    return {s: m.verification for s, m in marker_states(storage, steps).items()
            if m.verification is not None}


def newest_verified(storage: Storage, steps: Iterable[int]) -> int | None:
    """The newest of the committed ``steps`` with a trusted marker (read newest first, up to
    the first one), or None."""
    for step in sorted(steps, reverse=True):
        if verified_steps(storage, [step]):
            return step
    return None


def checked_evidence(evidence: Mapping[str, Any] | None) -> dict[str, Any]:
    """``evidence`` as a small JSON object (TypeError/ValueError otherwise)."""
    evidence = dict(evidence or {})
    if not all(isinstance(k, str) for k in evidence):
        raise TypeError("evidence must be a mapping with str keys")
    try:
        size = len(json.dumps(evidence, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"evidence must be plain JSON values (finite numbers, str, lists, "
                         f"dicts): {e}") from None
    if size > MAX_EVIDENCE_BYTES:
        raise ValueError(f"evidence is {size} bytes as JSON, more than {MAX_EVIDENCE_BYTES}")
    return evidence


def write_marker(storage: Storage, step: int,
                 evidence: Mapping[str, Any] | None = None) -> Verification:
    """Mark the committed ``step`` verified (the caller holds the root's writer lock).

    Idempotent: a trusted marker already there is kept and returned. An untrusted one (a
    stale marker of an earlier save of this step number, or a damaged one) is replaced.

    Raises:
        FileNotFoundError: ``step`` is not committed.
        TypeError, ValueError: ``evidence`` is not a small JSON object.
        OSError: the storage failed.
    """
    evidence = checked_evidence(evidence)
    manifest = _manifest_sha256(storage, step_dir(step))
    current = read_marker(storage, step)
    if current.verification is not None:
        return current.verification
    if current.problem is not None:
        log.warning("ckpt.verified step=%d replacing its marker: %s", step, current.problem)
        storage.delete(marker_path(step))
    now = time.time()
    doc = {"format": VERIFIED_FORMAT, "step": step, "manifest_sha256": manifest,
           "time": now, "evidence": evidence}
    if not _create_only(storage, marker_path(step), json.dumps(doc).encode()):
        # Another write got there first (a retried request): trust it only if it is valid.
        again = read_marker(storage, step)
        if again.verification is None:
            raise FileExistsError(f"{storage.url}/{marker_path(step)} appeared meanwhile "
                                  f"and is not trusted: {again.problem}")
        return again.verification
    return Verification(step, now, evidence)


def _create_only(storage: Storage, path: str, data: bytes) -> bool:
    """Write ``data`` at ``path`` unless something is there already; whether it was written.

    The write appears whole or not at all: an object store's conditional create; on POSIX a
    complete temp file linked into place (``link`` fails if the name exists)."""
    if isinstance(storage, ConditionalStorage):
        return storage.create_only(path, data) is not None
    if isinstance(storage, PosixStorage):
        try:
            final = storage.local_path(path)
        except SymlinkRefusedError as e:  # never written through, nor removed by us
            raise OSError(f"{e.filename or path} is a symbolic link; remove it to mark "
                          "the step verified") from None
        tmp = f"{path}.{secrets.token_hex(8)}.part"
        storage.write(tmp, [data])  # created without following links, fsynced
        try:
            os.link(storage.local_path(tmp), final)
        except FileExistsError:
            return False
        finally:
            storage.delete(tmp)
        fsync_dir(os.path.dirname(final))
        return True
    if storage.exists(path):  # other backends: the writer lock makes this the one writer
        return False
    storage.write(path, [data])
    return True
