"""The manifest's digest of its own bytes: written as its last member, checked on every read.

Every chunk and rank table has a digest listed in the manifest; this one covers the manifest
itself (its plain values, shapes, chunk places), so a flipped bit there is a damaged step
rather than a silently different one. The writer appends ``,"manifest_digest":"<16 hex>"}``
to the compact JSON body, the digest (xxh3-64) taken over every byte before that comma. The
reader finds the member by its exact bytes at the end and checks it before parsing.

A document without that exact tail is one written before manifests carried a digest, and
is read as such only if it has none of the member at all and nothing but the members such a
manifest has: a bit flipped in the digest member's name, value or punctuation must not turn
a new manifest into an unchecked old one. The digest detects damage, not editing: whoever
can rewrite a manifest can recompute it (the memory tier's tags authenticate).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ckpt._format.bounds import Invalid
from ckpt._format.digest import digest

DIGEST_MEMBER = "manifest_digest"
_TAIL = re.compile(rb',"manifest_digest":"([0-9a-f]{16})"\}')
_TAIL_BYTES = len(b',"manifest_digest":"') + 16 + len(b'"}')
# The top-level members of a manifest written before the digest (formats 1 and 2).
_UNSEALED_MEMBERS = frozenset({"format", "format_version", "step", "world_size", "created",
                               "tensors", "aliases", "items", "files", "metadata", "meshes",
                               "tables", "refs"})


def seal(body: bytes) -> bytes:
    """``body`` (a compact JSON object) with its digest appended as its last member."""
    if not (body.startswith(b"{") and body.endswith(b"}") and len(body) > 2):
        raise ValueError("seal needs a compact, non-empty JSON object")
    head = memoryview(body)[:-1]  # a large job's manifest is copied once, not twice
    return b"".join((head, b',"%s":"' % DIGEST_MEMBER.encode(), digest(head).encode(), b'"}'))


def is_sealed(raw: bytes) -> bool:
    """True when ``raw`` ends in its digest member and the digest matches; False when it
    ends in no digest member (see :func:`unseal`). Raises Invalid when the digest
    does not match the bytes before it."""
    tail = _TAIL.fullmatch(raw, max(len(raw) - _TAIL_BYTES, 0))
    if tail is None:
        return False
    want, got = tail.group(1).decode(), digest(memoryview(raw)[:tail.start()])
    if got != want:
        raise Invalid(f"its bytes have digest {got}, the manifest records {want}: it was "
                      "damaged after it was written")
    return True


def unseal(doc: Any, sealed: bool) -> Any:
    """The parsed manifest ``doc`` without its digest member; for a document that was not
    sealed (:func:`is_sealed` False), raises Invalid unless it looks as a manifest written
    before the digest does."""
    if sealed:
        # Valid JSON ending in the member: its closing brace is the top-level object's.
        del doc[DIGEST_MEMBER]
        return doc
    if isinstance(doc, dict):
        if DIGEST_MEMBER in doc:
            raise Invalid(f"its {DIGEST_MEMBER!r} is not the last member or not 16 hex "
                          "digits: the manifest was damaged")
        unknown = sorted(set(doc) - _UNSEALED_MEMBERS)
        if unknown:
            raise Invalid(f"it has no digest and unknown members {unknown[:3]!r}: a damaged "
                          "digest member, or a manifest of a newer ckpt")
    return doc


def sealed_json(doc: dict[str, Any]) -> bytes:
    """``doc`` as a manifest is written: compact JSON, its digest the last member (a digest
    member ``doc`` has, from the manifest it was read from, is replaced). For a tool or test
    that edits a manifest on purpose (non-finite floats pass, as ``json.dumps`` lets them)."""
    body = {k: v for k, v in doc.items() if k != DIGEST_MEMBER}
    return seal(json.dumps(body, separators=(",", ":")).encode())


def reseal(raw: bytes) -> bytes:
    """Manifest bytes edited on purpose (a tool, a test), sealed again: the digest member at
    their end, if any, replaced by the digest of the edited bytes."""
    tail = _TAIL.fullmatch(raw, max(len(raw) - _TAIL_BYTES, 0))
    return seal(raw[:tail.start()] + b"}" if tail else raw)
