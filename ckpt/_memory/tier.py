"""The node-local memory tier: every save is also published as a complete checkpoint root in
POSIX shared memory (``/dev/shm``), which outlives the worker process, so a restarted worker
restores from RAM without reading the persistent root.

A segment is the directory ``<shm>/ckpt-<job>-<node>-r<rank>``, plus ``owner.lock``, flock'ed
by the live process that writes it. A segment whose lock can be taken has no live owner:
``gc_segments`` removes it.

* A single process's segment is an ordinary ckpt root (step directories, each committed by the
  atomic rename of its manifest, written last, which holds every chunk's digest).
* Under a process group each rank's segment holds **rank steps**: ``step-XXXXXXXX/`` with the
  data files this rank wrote and ``rank.json`` (written last, then the directory renamed into
  place): the rank's chunk table with digests and global boxes, plus the step's global layout
  (tensor shapes, items), so the union of all ranks' rank steps of one save makes a complete,
  reshardable checkpoint (``ckpt/_memory/plan.py``). Peer replicas of rank ``o``'s steps,
  held on node ``n``, live in ``ckpt-<job>-<n>-replica-r<o>`` (``ckpt/_memory/replication.py``).

``<node>`` names the node: ``MemoryTierOptions(node=...)``, else the environment's
``CKPT_NODE``, else the hostname followed by ``_n<GROUP_RANK>`` under torchrun (its node rank),
else the hostname; characters other than letters, digits, ``_`` and ``.`` become ``_``, so a
node's segments, its replicas included, are exactly ``<shm>/ckpt-<job>-<node>-*``. Under a
process group whose nodes all have hosts of their own the hostname alone names a node (the
manager checks at start-up), because torchrun may renumber the nodes (GROUP_RANK) after losing
one, and a host must find its segments under the same name. A rank reads only segments of its
own node. On one machine the node rank is all that tells nodes apart, and it may change after a
node is lost, so a test simulating nodes there names each one with ``CKPT_NODE``.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
from typing import Any

from storage_backends import Storage, open_storage

from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt._format.names import STEP_DIR, step_dir
from ckpt._step.listing import step_dirs

log = logging.getLogger("ckpt")

SHM_DIR = "/dev/shm"
PREFIX = "ckpt-"
OWNER_FILE = "owner.lock"
RANK_DOC = "rank.json"
RANK_FORMAT = "ckpt-memory-rank/1"
STAGING = ".tmp-"
AUTO_GC_AGE = 3600.0  # seconds a dead segment is left alone before a later run removes it
_SAFE = re.compile(r"[^A-Za-z0-9_.]+")


def job_id(root: str, job: str | None = None) -> str:
    """The job's name in segment names: ``job``, else torchrun's TORCHELASTIC_RUN_ID, else a
    hash of the checkpoint root (so a rerun of the same job finds its segments)."""
    job = job or os.environ.get("TORCHELASTIC_RUN_ID") or hashlib.sha256(
        root.encode()).hexdigest()[:12]
    return _SAFE.sub("_", job)


def node_name(node: str | None = None) -> str:
    """This process's node in segment names (see the module docstring)."""
    node = node or os.environ.get("CKPT_NODE")
    if not node:
        node = socket.gethostname()
        if os.environ.get("GROUP_RANK") is not None:
            node = f"{node}_n{os.environ['GROUP_RANK']}"
    return _SAFE.sub("_", node)


def segment_name(job: str, rank: int, node: str | None = None) -> str:
    """``ckpt-<job>-<node>-r<rank>``: the node's name is in it so that a node's segments can be
    told apart (and removed, to simulate losing the node) on a shared /dev/shm."""
    return f"{PREFIX}{job}-{node_name(node)}-r{rank}"


def replica_name(job: str, node: str, origin: int) -> str:
    """``ckpt-<job>-<node>-replica-r<origin>``: rank ``origin``'s steps held on ``node``."""
    return f"{PREFIX}{job}-{node_name(node)}-replica-r{origin}"


def node_prefix(job: str, node: str) -> str:
    """The start of every segment name on ``node`` (own segments and replicas)."""
    return f"{PREFIX}{job}-{node_name(node)}-"


class MemoryTier:
    """One rank's segment: publish steps into it, keep the newest ``keep`` of them.

    Args:
        root: the persistent root's url (names the job when ``job`` is None).
        rank: this process's rank.
        job: the job id (default: TORCHELASTIC_RUN_ID, else a hash of ``root``).
        keep: generations (steps) kept in memory.
        budget: the most bytes the segment may hold (None: what /dev/shm has free).
        shm_dir: where segments live (``/dev/shm``).
        node: this node's name (see :func:`node_name`).
        ranked: the segment holds rank steps (a process group) instead of a ckpt root.
    """

    def __init__(self, root: str, rank: int, *, job: str | None = None, keep: int = 2,
                 budget: int | None = None, shm_dir: str | None = None,
                 node: str | None = None, ranked: bool = False) -> None:
        shm_dir = shm_dir or SHM_DIR
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer, not {keep!r}")
        if not os.path.isdir(shm_dir):
            raise CheckpointError(f"memory_tier=True needs a shared-memory directory, but "
                                  f"{shm_dir} does not exist; pass memory_tier=False",
                                  path=shm_dir)
        self.keep = keep
        self.budget = budget
        self.shm_dir = shm_dir
        self.job = job_id(root, job)
        self.node = node_name(node)
        self.ranked = ranked
        self.path = os.path.join(shm_dir, segment_name(self.job, rank, self.node))
        # Dead jobs' segments, found by a later run; a grace period spares those of a job
        # whose workers torchrun is restarting right now.
        gc_segments(shm_dir, keep_job=self.job, min_age=AUTO_GC_AGE)
        os.makedirs(self.path, exist_ok=True)
        self._owner = own_segment(self.path)
        self.storage: Storage = open_storage(self.path, create=True)
        for name in self.storage.uncommitted():  # a publish cut short by a crash
            self.storage.delete(name)

    def steps(self) -> list[int]:
        """Committed steps in the segment, oldest first."""
        if self.ranked:
            return rank_steps(self.path)
        return sorted(s for s, committed in step_dirs(self.storage).items() if committed)

    def check_space(self, nbytes: int) -> None:
        """Raise before writing when the step does not fit the budget or /dev/shm."""
        held = tree_bytes(self.path)
        # Until the oldest generation is retired, keep+1 steps are held at once.
        if self.budget is not None and held + nbytes > self.budget:
            raise CheckpointError(
                f"the memory tier's budget is {self.budget} bytes: {self.path} holds {held} and "
                f"this step needs {nbytes} more; raise MemoryTierOptions(budget=), lower its "
                f"keep= (now {self.keep}) or pass memory_tier=False", path=self.path)
        st = os.statvfs(self.shm_dir)
        free = st.f_bavail * st.f_frsize
        if nbytes > free:
            raise CheckpointError(
                f"{self.shm_dir} has {free} bytes free, this step needs {nbytes} in the memory "
                f"tier; enlarge /dev/shm (docker: --shm-size), lower MemoryTierOptions(keep=) "
                f"(now {self.keep}) or pass memory_tier=False", path=self.shm_dir)

    def publish_rank(self, payload: Any, options: Any, pool: Any) -> Any:
        """Write this rank's share of a save as a rank step (no collectives: runs on the
        writer thread); the newest ``keep`` rank steps are kept. Returns the RankTable."""
        from ckpt._save.rank_write import write_rank  # imports torch; this module stays light

        if payload.ready is not None:
            payload.ready.synchronize()
        # Everything this rank holds, also the boxes another rank writes to the root.
        payload = dataclasses.replace(payload, pieces={**payload.pieces, **payload.held})
        staging = self.storage.begin(payload.name, payload.token)
        try:
            table = write_rank(self.storage, staging, payload, options, pool)
            doc = {"format": RANK_FORMAT, "step": payload.step, "rank": payload.rank,
                   "world_size": payload.world_size, "token": payload.token,
                   "created": time.time(), "node": self.node,
                   "tensors": {k: [d, list(s)] for k, (d, s) in payload.tensors.items()},
                   "items": payload.items, "aliases": payload.aliases,
                   "metadata": payload.metadata or {}, "table": table.to_json()}
            with open(os.path.join(self.path, staging, RANK_DOC), "wb") as f:
                f.write(json.dumps(doc).encode())
            commit_dir(os.path.join(self.path, staging), os.path.join(self.path, payload.name))
        except BaseException:
            shutil.rmtree(os.path.join(self.path, staging), ignore_errors=True)
            raise
        retire_rank_steps(self.path, self.keep)
        return table

    def kept_steps(self) -> set[int]:
        """The generations to keep: the newest ``keep`` committed steps (the publisher retires
        the others with the collector after each publish)."""
        return set(self.steps()[-self.keep:])

    def remove(self) -> None:
        """Delete the segment (the job finished and its newest step is persisted)."""
        shutil.rmtree(self.path, ignore_errors=True)
        self.close()

    def close(self) -> None:
        """Release ownership; the segment stays for a restarted worker."""
        if not self._owner.closed:
            self._owner.close()


def own_segment(path: str) -> Any:
    """Create (if missing) and flock the segment at ``path``; returns the held owner file."""
    os.makedirs(path, exist_ok=True)
    owner = open(os.path.join(path, OWNER_FILE), "a+")
    try:
        fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        owner.close()
        raise CheckpointError(
            f"the memory segment {path} is in use by another live process; give "
            "this run another job id (MemoryTierOptions(job=...))", path=path) from None
    os.utime(owner.name)  # a live owner's segment is young: the auto-gc grace period
    for name in os.listdir(path):  # a publish cut short by a crash
        if name.startswith(STAGING):
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)
    return owner


def rank_steps(path: str) -> list[int]:
    """Committed rank steps in a segment (a directory with its ``rank.json``), oldest first;
    symbolic links are not followed."""
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for m in map(STEP_DIR.match, names):
        if m and not os.path.islink(os.path.join(path, m.group(0))):
            doc = os.path.join(path, m.group(0), RANK_DOC)
            if os.path.isfile(doc) and not os.path.islink(doc):
                out.append(int(m.group(1)))
    return sorted(out)


def plain_name(name: Any) -> str:
    """``name`` if it is a plain file name (no directory part), else ValueError."""
    if not isinstance(name, str) or not name or "/" in name or "\0" in name \
            or name.startswith("."):
        raise ValueError(f"{name!r} is not a plain file name")
    return name


def open_plain(path: str) -> Any:
    """``path`` opened for reading, refusing a symbolic link (OSError)."""
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb")


def commit_dir(staging: str, final: str) -> None:
    """Publish a finished step directory: one rename (over an older save of the step)."""
    if os.path.lexists(final):
        old = f"{os.path.dirname(final)}/{STAGING}old-{os.path.basename(final)}-{time.time_ns()}"
        os.rename(final, old)
        os.rename(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staging, final)


def retire_rank_steps(path: str, keep: int) -> None:
    """Delete all but the newest ``keep`` rank steps of a segment."""
    for s in rank_steps(path)[:-keep]:
        shutil.rmtree(os.path.join(path, step_dir(s)), ignore_errors=True)


def read_rank_doc(path: str, step: int) -> dict:
    """The ``rank.json`` of a rank step, checked for shape (its contents are validated again
    as a whole manifest when the union of the ranks' steps is loaded)."""
    where = os.path.join(path, step_dir(step), RANK_DOC)
    try:
        with open_plain(where) as f:
            doc = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: unreadable rank step: {e}", path=where) from e
    ok = (isinstance(doc, dict) and doc.get("format") == RANK_FORMAT
          and doc.get("step") == step and all(
              isinstance(doc.get(k), int) and not isinstance(doc.get(k), bool)
              for k in ("rank", "world_size"))
          and 0 <= doc["rank"] < doc["world_size"] and isinstance(doc.get("token"), str)
          and isinstance(doc.get("created"), (int, float))
          and all(isinstance(doc.get(k), dict) for k in ("tensors", "items", "aliases",
                                                         "metadata", "table")))
    if not ok:
        raise CorruptCheckpointError(f"{where}: not a valid rank step of step {step}",
                                     path=where)
    return doc


def tree_bytes(path: str) -> int:
    """Bytes of the files under ``path``."""
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
