"""The content digest of chunks and rank tables: xxh3-64 of the raw bytes, 16 hex digits."""

from __future__ import annotations

import xxhash


def digest(data) -> str:
    """The chunk digest: xxh3-64 of the raw (uncompressed) bytes, 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


# The same digest over parts: ``d = Digest(); d.update(part)...; d.hexdigest() == digest(whole)``.
Digest = xxhash.xxh3_64
