"""``ckpt gc`` on a root: under the writer lock, keep the steps the policy keeps and the
newest step that verifies, remove what crashed saves left, delete files no kept step uses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from storage_backends import LockHeldError, Storage
from storage_backends.locks import describe_owner

from ckpt.errors import (CheckpointError, CheckpointLockedError, CheckpointNotFoundError,
                         StorageError)
from ckpt._retention.apply import steps_to_keep
from ckpt._retention.collect import GcReport, collect
from ckpt._retention.policy import RetentionPolicy
from ckpt._step.listing import committed_steps

# step -> None when it verifies, else why not; raises CheckpointNotFoundError for a step a
# live writer retired after the listing (a dry run holds no lock).
StepCheck = Callable[[int], "str | None"]


@dataclass
class GcResult:
    """What ``ckpt gc`` did (or, in a dry run, would do)."""

    root: str
    dry_run: bool
    retired_steps: list[int] = field(default_factory=list)
    deleted_files: list[str] = field(default_factory=list)
    kept_files: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    uncommitted: list[str] = field(default_factory=list)
    newest_good: int | None = None  # kept whatever the policy (None: not checked / none)
    failed: dict[int, str] = field(default_factory=dict)  # steps that did not verify
    note: str | None = None

    @property
    def ok(self) -> bool:
        """False when the policy would retire steps but none verifies, so none was."""
        return self.note is None or self.newest_good is not None


def collect_root(storage: Storage, policy: RetentionPolicy, *, check: StepCheck,
                 delete: bool = False) -> GcResult:
    """Retire the steps ``policy`` drops and delete unreferenced files (only with ``delete``;
    otherwise report what would go).

    Whatever the policy, the newest step that passes ``check`` is kept: steps are checked
    from the newest down, before anything is deleted, until one passes. When none does, no
    step is retired (``ok`` is False). When the policy retires no committed step (or there is
    none) nothing is checked. With ``delete`` the root's writer lock is held throughout.

    Raises:
        CheckpointLockedError: ``delete`` and a writer holds the root.
        StorageError: the root cannot be written (read-only, permissions) or listed.
        CheckpointError: a kept step's manifest cannot be read (nothing is deleted).
    """
    root = storage.url
    lock = _lock(storage) if delete else None
    result = GcResult(root, dry_run=not delete)
    try:
        steps = committed_steps(storage)
        keep = None if policy.keeps_all else steps_to_keep(storage, policy, steps,
                                                           newest=None)
        if keep is not None and set(steps) - keep:  # a step would be retired: find the newest good one first
            _newest_good(steps, check, result)
            if result.newest_good is None:
                keep = None
                result.note = ("no committed step verifies, so none was retired: "
                               "`ckpt verify --all` gives details")
            elif result.newest_good not in keep:
                keep.add(result.newest_good)
                result.note = (f"kept step {result.newest_good} too: the newest step that "
                               "verifies (gc always keeps one)")
        result.uncommitted = storage.uncommitted()
        report = collect(storage, keep, dry_run=not delete)
        for name in result.uncommitted:
            if delete:
                storage.delete(name)
    except CheckpointError:
        raise
    except OSError as e:
        raise StorageError(f"gc of {root} failed: {type(e).__name__}: {e}", path=root) from e
    finally:
        if lock is not None:
            lock.release()
    _take_report(result, report)
    return result


def _lock(storage: Storage) -> Any:
    """The root's writer lock, or the error that says why gc --yes cannot have it."""
    root = storage.url
    try:
        return storage.lock(describe_owner())
    except LockHeldError as e:
        raise CheckpointLockedError(
            f"{root} is in use by a writer ({e.who}); gc --yes needs the root to itself: "
            "stop that job first, or run gc without --yes for a dry run", path=root) from None
    except OSError as e:
        raise StorageError(f"cannot take the writer lock of {root}: {e}; gc --yes needs "
                           "write access to the root", path=root) from e


def _newest_good(steps: list[int], check: StepCheck, result: GcResult) -> None:
    """Check steps from the newest down until one passes: result.newest_good, .failed."""
    for step in reversed(steps):
        try:
            why = check(step)
        except CheckpointNotFoundError:
            continue  # a live writer retired it (a dry run holds no lock)
        if why is None:
            result.newest_good = step
            return
        result.failed[step] = why


def _take_report(result: GcResult, report: GcReport) -> None:
    result.retired_steps, result.deleted_files = report.retired_steps, report.deleted_files
    result.kept_files, result.freed_bytes = report.kept_files, report.freed_bytes
