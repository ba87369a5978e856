"""What every integration shares: a checkpoint root whose retention the framework decides.

The framework names checkpoints by paths (``last.ckpt``, ``checkpoint-500``); ckpt keeps steps
(``step-00000500``). A small *pointer* (JSON: format tag and step, no paths) at the framework's
path names the step it stands for, so the framework's own lookups (newest ``last*.ckpt``,
highest ``checkpoint-N``) keep working. The pointer is written when the save is submitted,
before the background write commits; a load that finds its step missing or corrupt falls back
to the newest good step before it, with a warning.

Deleting a step is deferred until no save is in flight, and the newest committed step is never
deleted: a crash at any moment leaves a step to resume from.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import Any, Mapping

import torch

import ckpt

log = logging.getLogger("ckpt")


def solo_group() -> Any:
    """Under torch.distributed, a process group of this rank alone (created by this rank
    only), for frameworks that save from rank 0 alone; None otherwise."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.new_group([dist.get_rank()], use_local_synchronization=True)


class StepStore:
    """One writable :class:`ckpt.CheckpointManager` at ``root`` that saves when told to and
    retires steps the framework dropped (see the module docstring). With ``collective``, every
    rank of the default process group saves together; otherwise this rank saves alone."""

    def __init__(self, root: str, manager_options: Mapping[str, Any], *,
                 collective: bool = False, group: Any = None) -> None:
        """``group``: a one-rank group made before with :func:`solo_group`, to reuse."""
        self.check_options(manager_options)
        self.root = root
        # Lightning and HF save from rank 0 alone; Accelerate's save_state runs on every rank.
        group = None if collective else (group or solo_group())
        self.mgr = ckpt.CheckpointManager(root, process_group=group, **manager_options)
        self._handle: ckpt.SaveHandle | None = None
        self._doomed: set[int] = set()
        self._last: tuple[int, frozenset] | None = None

    @staticmethod
    def check_options(manager_options: Mapping[str, Any]) -> None:
        """Refuse the manager options the framework decides."""
        refused = sorted({"keep_last", "keep_every", "read_only", "process_group",
                          "every_steps"} & set(manager_options))
        if refused:
            raise ValueError(f"{', '.join(refused)}: decided by the framework here (its save "
                             "schedule and retention); leave them out")

    def save(self, step: int, state: dict[str, Any], *, metadata: dict | None = None,
             overwrite: bool = False) -> bool:
        """Save ``state`` as ``step`` (in the background). Returns False when this process
        has just saved that same step with the same items (the framework saving one step
        under two names): nothing is written again. ``overwrite``: replace a step of that
        number or go back to a lower one (a resume from an older checkpoint saving again)."""
        key = (step, frozenset(state))
        if self._last == key:
            return False
        self._doomed.discard(step)
        self._flush()
        self._handle = self.mgr.save(step, state, force=True, metadata=metadata,
                                     overwrite=overwrite)
        self._last = key
        return True

    def retire(self, steps: set[int]) -> None:
        """Delete these steps once no save is in flight (never the newest committed one)."""
        self._doomed |= steps
        self._flush()

    def _flush(self) -> None:
        """Delete the dropped steps now if no save is in flight (else at a later call): the
        training loop never waits for a write to delete."""
        if not self._doomed or (self._handle is not None and not self._handle.done()):
            return
        steps = self.mgr.steps()
        doomed = {s for s in self._doomed if s in steps and s != steps[-1]}
        if doomed:
            self.mgr.retire(doomed)
        self._doomed -= doomed | {s for s in self._doomed if s not in steps}

    def close(self) -> None:
        """Finish the save in flight, delete what was dropped, release the lock."""
        try:
            self.mgr.wait()
            self._flush()
        finally:
            self.mgr.close()


def pickle_allowed(manager_options: Mapping[str, Any]) -> bool:
    """Whether the manager options allow pickled values: ``options=ckpt.SaveOptions(
    allow_pickle=True)``, or the deprecated ``allow_pickle=True``."""
    saving = manager_options.get("options")
    return bool(manager_options.get("allow_pickle")) or bool(
        getattr(saving, "allow_pickle", False))


def load_newest_good(root: str, step: int | None, *, allow_pickle: bool = False,
                     map_location: Any = None) -> tuple[int, dict[str, Any]] | None:
    """The newest committed step at or before ``step`` (None: any) that loads cleanly, as
    ``(step, saved items)``; steps that fail validation are skipped with a warning. None
    when there is none. Reads only: no lock, no collectives (every rank may call it)."""
    with ckpt.CheckpointManager(root, read_only=True, metrics=False,  # no collectives
                                schedule=ckpt.Schedule(handle_sigterm=False)) as ro:
        candidates = [s for s in ro.steps() if step is None or s <= step]
    if step is not None and step not in candidates:
        # The root keeps no record of retired steps: both causes are named.
        log.warning("ckpt: step %d (named by a checkpoint under %s) is not committed there: "
                    "its save never committed (the job stopped while writing it), or the step "
                    "was removed since; loading the newest step before it", step, root)
    location = map_location if isinstance(map_location, (str, torch.device)) else None
    failures = []
    for s in reversed(candidates):
        try:
            return s, ckpt.load(os.path.join(root, ckpt.inspect.step_dir(s)),
                                allow_pickle=allow_pickle, map_location=location)
        except (ckpt.CorruptCheckpointError, ckpt.CheckpointNotFoundError) as e:
            log.warning("ckpt: skipping step %d under %s: %s", s, root, e)
            failures.append(f"step {s}: {e}")
    if failures:
        raise ckpt.CorruptCheckpointError(
            f"no step under {root} could be loaded; `ckpt verify --all {root}` gives "
            "details:\n  " + "\n  ".join(failures), path=root)
    return None


def check_own_root(root: str, purpose: str, remedy: str) -> None:
    """Refuse a sibling root that is a link or not this user's own folder.

    Threat: the run's folder sits in a directory others may write (``/tmp``, a shared scratch
    space); another local user makes the hidden sibling root there first (a folder of hers,
    or a link to one), to read the states written into it or to plant steps that a resume
    would load. Cost to her: one ``mkdir``; to us: this ``lstat``, before anything is
    written or read. ``purpose`` says whose root it is, ``remedy`` what the user can do.
    """
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        what = "a link" if stat.S_ISLNK(st.st_mode) else (
            f"owned by uid {st.st_uid}" if stat.S_ISDIR(st.st_mode) else "not a folder")
        raise ckpt.CheckpointError(
            f"{root}, ckpt's root for {purpose}, is {what}, not a folder of this user's "
            f"(uid {os.geteuid()}): someone else may have made it to read or replace these "
            f"checkpoints. Remove it, or {remedy}", path=root)
