"""Listing a root's steps: every step directory, and which of them are committed."""

from __future__ import annotations

from storage_backends import Storage

from ckpt._format.names import MANIFEST_NAME, STEP_DIR


def step_dirs(storage: Storage) -> dict[int, bool]:
    """Every step directory -> whether it is committed (has its manifest)."""
    out = {}
    for entry in storage.list():
        m = STEP_DIR.match(entry.name)
        if m and entry.is_dir:
            out[int(m.group(1))] = storage.exists(f"{entry.name}/{MANIFEST_NAME}")
    return out


def committed_steps(storage: Storage) -> list[int]:
    """Committed steps under a root, oldest first (a step directory with its manifest)."""
    return sorted(step for step, committed in step_dirs(storage).items() if committed)
