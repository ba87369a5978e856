"""The reference-aware collector: retires steps and deletes files no kept step uses.

A step that retention removes is *retired* first: its manifest goes (so it is no longer a
step), its files stay while a kept step still refers to them (an incremental step's chunks
point into the step that first wrote their bytes), and only unreferenced files are deleted.
Deleting the manifest first makes a crash at any point safe: a kept step never loses a file
it uses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from storage_backends import Storage
from storage_backends.faults import fault_point

from ckpt.errors import CheckpointError
from ckpt._format.names import MANIFEST_NAME, step_dir
from ckpt._step.integrity import read_manifest
from ckpt._step.listing import step_dirs
from ckpt._step.verified import VERIFIED_NAME

log = logging.getLogger("ckpt")


@dataclass
class GcReport:
    """What a collection removed (or, in a dry run, would remove)."""

    retired_steps: list[int] = field(default_factory=list)
    deleted_files: list[str] = field(default_factory=list)
    kept_files: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    dry_run: bool = False


def collect(storage: Storage, keep: set[int] | None = None, *, dry_run: bool = False) -> GcReport:
    """Retire committed steps not in ``keep`` (None: keep all) and delete unreferenced files.

    The caller must hold the root's writer lock. A file is kept while a kept step's manifest
    lists it or one of its chunks refers to it, whichever step directory it lies in (a
    retired step's, or a kept step's from an earlier save of that step number).

    Raises:
        CheckpointError: a kept step's manifest cannot be read, so its references are
            unknown; nothing is deleted.
    """
    report = GcReport(dry_run=dry_run)
    dirs = step_dirs(storage)
    committed = sorted(s for s, has_manifest in dirs.items() if has_manifest)
    kept = [s for s in committed if keep is None or s in keep]
    referenced: set[tuple[int, str]] = set()
    own: set[tuple[int, str]] = set()
    for s in kept:
        try:
            manifest = read_manifest(storage, step_dir(s), s)
        except CheckpointError as e:
            raise CheckpointError(
                f"gc stopped before deleting anything: cannot read the references of kept "
                f"step {s} ({e}); verify or remove that step first", path=storage.url) from e
        own.update((s, name) for name in manifest.own_files())
        referenced.update(manifest.referenced_files())
    retire = [s for s in committed if s not in kept]
    for s in retire:
        report.retired_steps.append(s)
        if not dry_run:
            # The step stops existing here; its files go below, unless still referenced.
            storage.delete(f"{step_dir(s)}/{MANIFEST_NAME}")
            log.info("ckpt.gc retired step=%d", s)
            fault_point("gc_retired")
    # Kept steps' directories are swept too: a re-saved step number (a rollback) keeps the
    # old save's files there while later steps use them; once none does, they go.
    for s in sorted(dirs):
        location = step_dir(s)
        remaining = 0
        is_kept = s in kept
        for entry in storage.list(location):
            path = f"{location}/{entry.name}"
            if entry.name == MANIFEST_NAME or (is_kept and (entry.is_dir
                                                             or entry.name == VERIFIED_NAME)):
                continue  # (a kept step's verified marker stays with it)
            if (s, entry.name) in own:
                continue
            if (s, entry.name) in referenced:
                report.kept_files.append(path)
                remaining += 1
                continue
            try:
                report.freed_bytes += storage.size(path)
            except (FileNotFoundError, IsADirectoryError):
                pass
            report.deleted_files.append(path)
            if not dry_run:
                storage.delete(path)
                fault_point("gc_deleted_file")
        if not remaining and not is_kept and not dry_run:
            storage.delete(location)
    return report
