"""The chain metadata of incremental saves.

An incremental save compares each chunk's digest with the same chunk (same tensor, same box)
of its base step and, where they are equal, records a reference to where the bytes already
live instead of writing them again. Each step records how many incremental saves it is from
the last full one, so that a manager starts a full save before the chain grows too long.
Retiring steps without losing a file a kept step refers to is the collector's
(``ckpt/_retention/collect.py``).
"""

from __future__ import annotations

from ckpt._format.manifest import Manifest

# Metadata key: incremental saves since the last full one (0 for a full save).
CHAIN_KEY = "ckpt_chain"


def chain_length(manifest: Manifest) -> int:
    """Incremental saves between ``manifest``'s step and the last full save (0: full)."""
    value = manifest.metadata.get(CHAIN_KEY, 0)
    return value if isinstance(value, int) else 0
