"""The node-local memory tier (issue #14): every save is also published as a complete
checkpoint root in POSIX shared memory (``/dev/shm``), which outlives the worker process, so
a restarted worker restores from RAM without reading the persistent root.

A segment is the directory ``<shm>/ckpt-<job>-<node>-r<rank>``: an ordinary ckpt root (step
directories, each committed by the atomic rename of its manifest, written last, which holds
every chunk's digest), plus ``owner.lock``, flock'ed by the live process that writes it. A
segment whose lock can be taken has no live owner: ``gc_segments`` removes it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import shutil
import socket
import time

from storage_backends import Storage, open_storage

from .errors import CheckpointError
from .incremental import collect, step_dirs

log = logging.getLogger("ckpt")

SHM_DIR = "/dev/shm"
PREFIX = "ckpt-"
OWNER_FILE = "owner.lock"
AUTO_GC_AGE = 3600.0  # seconds a dead segment is left alone before a later run removes it
_SAFE = re.compile(r"[^A-Za-z0-9_.]+")


def job_id(root: str, job: str | None = None) -> str:
    """The job's name in segment names: ``job``, else torchrun's TORCHELASTIC_RUN_ID, else a
    hash of the checkpoint root (so a rerun of the same job finds its segments)."""
    job = job or os.environ.get("TORCHELASTIC_RUN_ID") or hashlib.sha256(
        root.encode()).hexdigest()[:12]
    return _SAFE.sub("_", job)


def segment_name(job: str, rank: int, node: str | None = None) -> str:
    """``ckpt-<job>-<node>-r<rank>``: the node's name is in it so that a node's segments can be
    told apart (and removed, to simulate losing the node) on a shared /dev/shm."""
    return f"{PREFIX}{job}-{_SAFE.sub('_', node or socket.gethostname())}-r{rank}"


class MemoryTier:
    """One rank's segment: publish steps into it, keep the newest ``keep`` of them.

    Args:
        root: the persistent root's url (names the job when ``job`` is None).
        rank: this process's rank.
        job: the job id (default: TORCHELASTIC_RUN_ID, else a hash of ``root``).
        keep: generations (steps) kept in memory.
        budget: the most bytes the segment may hold (None: what /dev/shm has free).
        shm_dir: where segments live (``/dev/shm``).
    """

    def __init__(self, root: str, rank: int, *, job: str | None = None, keep: int = 2,
                 budget: int | None = None, shm_dir: str = SHM_DIR) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"memory_keep must be a positive integer, not {keep!r}")
        if not os.path.isdir(shm_dir):
            raise CheckpointError(f"memory_tier=True needs a shared-memory directory, but "
                                  f"{shm_dir} does not exist; pass memory_tier=False",
                                  path=shm_dir)
        self.keep = keep
        self.budget = budget
        self.shm_dir = shm_dir
        self.job = job_id(root, job)
        self.path = os.path.join(shm_dir, segment_name(self.job, rank))
        # Dead jobs' segments, found by a later run; a grace period spares those of a job
        # whose workers torchrun is restarting right now.
        gc_segments(shm_dir, keep_job=self.job, min_age=AUTO_GC_AGE)
        os.makedirs(self.path, exist_ok=True)
        self._owner = open(os.path.join(self.path, OWNER_FILE), "a+")
        try:
            fcntl.flock(self._owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._owner.close()
            raise CheckpointError(
                f"the memory segment {self.path} is in use by another live process; give "
                "this run another job id (memory_job=...)", path=self.path) from None
        self.storage: Storage = open_storage(self.path, create=True)
        for name in self.storage.uncommitted():  # a publish cut short by a crash
            self.storage.delete(name)

    def steps(self) -> list[int]:
        """Committed steps in the segment, oldest first."""
        return sorted(s for s, committed in step_dirs(self.storage).items() if committed)

    def check_space(self, nbytes: int) -> None:
        """Raise before writing when the step does not fit the budget or /dev/shm."""
        held = _tree_bytes(self.path)
        # Until the oldest generation is retired, keep+1 steps are held at once.
        if self.budget is not None and held + nbytes > self.budget:
            raise CheckpointError(
                f"the memory tier's budget is {self.budget} bytes: {self.path} holds {held} and "
                f"this step needs {nbytes} more; raise memory_budget=, lower memory_keep= "
                f"(now {self.keep}) or pass memory_tier=False", path=self.path)
        st = os.statvfs(self.shm_dir)
        free = st.f_bavail * st.f_frsize
        if nbytes > free:
            raise CheckpointError(
                f"{self.shm_dir} has {free} bytes free, this step needs {nbytes} in the memory "
                f"tier; enlarge /dev/shm (docker: --shm-size), lower memory_keep= (now "
                f"{self.keep}) or pass memory_tier=False", path=self.shm_dir)

    def after_commit(self, manifest: object) -> None:
        """Retire generations beyond ``keep`` (runs in the writer after each publish)."""
        steps = self.steps()
        collect(self.storage, set(steps[-self.keep:]))

    def remove(self) -> None:
        """Delete the segment (the job finished and its newest step is persisted)."""
        shutil.rmtree(self.path, ignore_errors=True)
        self.close()

    def close(self) -> None:
        """Release ownership; the segment stays for a restarted worker."""
        if not self._owner.closed:
            self._owner.close()


def _tree_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                pass
    return total


def gc_segments(shm_dir: str = SHM_DIR, *, keep_job: str | None = None,
                job: str | None = None, min_age: float = 0.0,
                dry_run: bool = False) -> list[str]:
    """Remove memory segments without a live owner (their writer's flock is free).

    ``keep_job``: never touch that job's segments (the caller's own, which a restarted worker
    of this job may be about to read). ``job``: only that job's segments. ``min_age``: only
    segments whose owner file was last touched that many seconds ago. Only directories
    named ``ckpt-*`` holding an owner lock file are considered; symlinks are never followed.

    Returns:
        The removed (or, with ``dry_run``, removable) segment paths.
    """
    removed = []
    try:
        names = sorted(os.listdir(shm_dir))
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        if keep_job is not None and name.startswith(f"{PREFIX}{keep_job}-"):
            continue
        if job is not None and not name.startswith(f"{PREFIX}{_SAFE.sub('_', job)}-"):
            continue
        path = os.path.join(shm_dir, name)
        owner = os.path.join(path, OWNER_FILE)
        if os.path.islink(path) or not os.path.isdir(path) or not os.path.isfile(owner):
            continue
        try:
            if time.time() - os.lstat(owner).st_mtime < min_age:
                continue
            fd = os.open(owner, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                continue  # a live process owns it
            os.close(fd)
            raise
        try:
            if not dry_run:
                shutil.rmtree(path, ignore_errors=True)
                log.info("ckpt.memory_gc removed=%s", path)
            removed.append(path)
        finally:
            os.close(fd)
    return removed
