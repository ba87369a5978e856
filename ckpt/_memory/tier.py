"""The node-local memory tier: every save is also published as a complete checkpoint root in
POSIX shared memory (``/dev/shm``), which outlives the worker process, so a restarted worker
restores from RAM without reading the persistent root.

A segment is the directory ``<shm>/ckpt-uid<euid>/ckpt-<job>-<node>-r<rank>``, inside this
user's private directory (``ckpt/_memory/private.py``: who may reach what, and the checks),
plus ``owner.lock``, flock'ed by the live process that writes it. A segment whose lock can be
taken has no live owner: ``gc_segments`` removes it once its owner has been dead long enough.
What a segment holds is signed with the job's memory key (``ckpt/_memory/auth.py``): a rank
step's ``rank.json`` carries its tag, a single process's step has its manifest's tag beside it
(``.mac-step-XXXXXXXX``); a step without a good tag is never restored.

* A single process's segment is an ordinary ckpt root (step directories, each committed by the
  atomic rename of its manifest, written last, which holds every chunk's digest).
* Under a process group each rank's segment holds **rank steps**: ``step-XXXXXXXX/`` with the
  data files this rank wrote and ``rank.json`` (written last, then the directory renamed into
  place): the rank's chunk table with digests and global boxes, plus the step's global layout
  (tensor shapes, items), so the union of all ranks' rank steps of one save makes a complete,
  reshardable checkpoint (``ckpt/_memory/plan.py``). Peer replicas of rank ``o``'s steps,
  held on node ``n``, live in ``ckpt-<job>-<n>-replica-r<o>`` (``ckpt/_memory/replication.py``)
  in the private directory of the user running the job there.

``<node>`` names the node: ``MemoryTierOptions(node=...)``, else the environment's
``CKPT_NODE``, else the hostname followed by the node's identity, a random id kept in
``node-id`` in the private directory (:func:`node_id`): a node is its shared memory, and
whatever reads the same /dev/shm is the same node. Characters other than letters, digits,
``_`` and ``.`` become ``_``, so a node's segments, its replicas included, are exactly the
names ``ckpt-<job>-<node>-r<N>`` and ``ckpt-<job>-<node>-replica-r<N>`` in the private
directory. A node's name must survive what torchrun changes on a restart: torchrun renumbers
the nodes (GROUP_RANK) and the ranks after losing one, so neither is part of it (a rank finds
its node's segments under any rank number: their rank steps say whose they are). A rank reads
only segments of its own node. A test simulating several nodes on one /dev/shm names each with
``CKPT_NODE``, or gives each its own /dev/shm (a mount namespace).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import time
from typing import Any, Callable, Iterable

from storage_backends.faults import fault_point
from storage_backends.posix import PosixStorage

from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt._format.bounds import Invalid
from ckpt._format.names import MANIFEST_NAME, STEP_DIR, step_dir
from ckpt._format.sealed import DIGEST_MEMBER, is_sealed, seal
from ckpt._memory.auth import sign, sign_doc, verify, verify_doc
from ckpt._memory.private import (DEAD_FILE, OWNER_FILE, SHM_DIR, STAGING, UnsafeSegmentError,
                                  check_dir, gc_segments, open_checked, own_segment,
                                  private_dir, private_path, read_checked)
from ckpt._step.listing import step_dirs

log = logging.getLogger("ckpt")

# Re-exported: the segment helpers are used through this module (replication, tests).
__all__ = ["DEAD_FILE", "OWNER_FILE", "SHM_DIR", "STAGING", "UnsafeSegmentError", "check_dir",
           "gc_segments", "open_checked", "own_segment", "private_dir", "private_path"]

PREFIX = "ckpt-"
RANK_DOC = "rank.json"
RANK_FORMAT = "ckpt-memory-rank/1"
NODE_FILE = "node-id"  # in the private directory: this node's identity (node_id)
TAG_PREFIX = ".mac-"  # beside a single process's step: its manifest's tag
AUTO_GC_AGE = 3600.0  # seconds a segment's owner is dead before a later run removes it
_SAFE = re.compile(r"[^A-Za-z0-9_.]+")


def job_id(root: str, job: str | None = None) -> str:
    """The job's name in segment names: ``job``, else torchrun's TORCHELASTIC_RUN_ID, else a
    hash of the checkpoint root (so a rerun of the same job finds its segments)."""
    job = job or os.environ.get("TORCHELASTIC_RUN_ID") or hashlib.sha256(
        root.encode()).hexdigest()[:12]
    return _SAFE.sub("_", job)


def node_name(node: str | None = None, private: str | None = None) -> str:
    """This process's node in segment names (see the module docstring): ``node``, else
    CKPT_NODE, else the hostname, followed by the node's identity (:func:`node_id`) kept in
    ``private``, this user's private directory, when one is given."""
    node = node or os.environ.get("CKPT_NODE")
    if not node:
        node = socket.gethostname()
        if private is not None:
            node = f"{node}_{node_id(private)}"
    return _SAFE.sub("_", node)


def node_id(private: str) -> str:
    """The identity of the node whose shared memory holds ``private`` (this user's private
    directory there): drawn at random by the first process that asks, read by every later
    one (the node's other ranks, its restarted workers), and gone with the shared memory
    itself. Torchrun's node rank (GROUP_RANK) cannot serve: it renumbers the nodes after
    losing one, and a node would look for its segments under another node's name."""
    path = os.path.join(private, NODE_FILE)
    while True:
        try:
            value = read_checked(path).decode("ascii", "replace")
        except FileNotFoundError:
            staged = os.path.join(private, f"{STAGING}{NODE_FILE}-{secrets.token_hex(8)}")
            write_private(staged, secrets.token_hex(4).encode())
            try:  # whole or absent, and never over the identity another process made first
                os.link(staged, path, follow_symlinks=False)
            except FileExistsError:
                pass
            finally:
                os.unlink(staged)
            continue
        if not re.fullmatch(r"[0-9a-f]{8}", value):
            raise UnsafeSegmentError(
                f"{path} holds {value[:40]!r}, not a node identity: the memory tier names this "
                "node's segments with it; remove the file (the node's segments are then "
                "named anew) or name the node with MemoryTierOptions(node=)", path=path)
        return value


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


class SegmentStorage(PosixStorage):
    """A single process's segment as a ckpt root: staging directories 0700, files 0600, and
    each manifest's tag (under ``key``) written beside its step before the step is
    committed, so a committed step without a good tag was not published by this job."""

    file_mode, dir_mode = 0o600, 0o700
    key: bytes | None = None

    def commit(self, staging: str, name: str, manifest: bytes, manifest_name: str) -> None:
        if self.key is None:  # never publish what a restore could not authenticate
            raise CheckpointError(f"{self.root}: the memory tier has no key yet", path=self.root)
        write_tag(self.root, name, sign(self.key, manifest))
        super().commit(staging, name, manifest, manifest_name)


class MemoryTier:
    """One rank's segment: publish steps into it, keep the newest ``keep`` of them.

    Args:
        root: the persistent root's url (names the job when ``job`` is None).
        rank: this process's rank.
        job: the job id (default: TORCHELASTIC_RUN_ID, else a hash of ``root``).
        keep: generations (steps) kept in memory.
        budget: the most bytes the segment may hold (None: what /dev/shm has free).
        shm_dir: the shared-memory directory (``/dev/shm``); segments live in this user's
            private directory under it, which ``self.shm_dir`` names.
        node: this node's name (see :func:`node_name`).
        ranked: the segment holds rank steps (a process group) instead of a ckpt root.
        key: the job's memory key (:mod:`ckpt._memory.auth`); publishing needs it, and only
            steps signed with it are listed as restorable. May be set later (``set_key``).

    Raises:
        UnsafeSegmentError: this user's private directory, or the segment, fails its checks
            (another user made it): the tier cannot be used.
        CheckpointError: no shared-memory directory, or another live process owns the segment.
    """

    def __init__(self, root: str, rank: int, *, job: str | None = None, keep: int = 2,
                 budget: int | None = None, shm_dir: str | None = None,
                 node: str | None = None, ranked: bool = False,
                 key: bytes | None = None) -> None:
        shm_dir = shm_dir or SHM_DIR
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer, not {keep!r}")
        if not os.path.isdir(shm_dir):
            raise CheckpointError(f"memory_tier=True needs a shared-memory directory, but "
                                  f"{shm_dir} does not exist; pass memory_tier=False",
                                  path=shm_dir)
        self.keep = keep
        self.budget = budget
        self.shm_root = shm_dir
        self.shm_dir = private_dir(shm_dir)  # where this user's segments live
        self.job = job_id(root, job)
        self.node = node_name(node, self.shm_dir)
        self.ranked = ranked
        self.path = os.path.join(self.shm_dir, segment_name(self.job, rank, self.node))
        self._unsigned: set[int] = set()  # steps already warned about
        # Dead jobs' segments, found by a later run; a grace period from the owner's death
        # spares those of a job whose workers torchrun is restarting right now.
        gc_segments(shm_dir, keep_job=self.job, min_age=AUTO_GC_AGE)
        self._owner = own_segment(self.path)
        self.storage = SegmentStorage(self.path, create=False)
        self.key: bytes | None = None
        self.set_key(key)
        for name in self.storage.uncommitted():  # a publish cut short by a crash
            self.storage.delete(name)
        from ckpt._memory.slabs import SlabPool  # imports torch; this module stays light

        # The data files saves are staged into: the ``keep`` steps' and the next save's.
        self.slabs = SlabPool(self.path, keep + 1)

    def set_key(self, key: bytes | None) -> None:
        """The job's memory key: what this tier signs with, and checks."""
        self.key = self.storage.key = key

    def steps(self) -> list[int]:
        """Restorable steps in the segment, oldest first: a single process's only when their
        tag checks out under the key (a rank step's tag is checked by discovery)."""
        if self.ranked:
            return rank_steps(self.path)
        return [s for s, committed in sorted(step_dirs(self.storage).items())
                if committed and self._signed(s)]

    def _signed(self, step: int) -> bool:
        """Whether ``step`` is listed as restorable: its tag checks out, or its manifest is
        damaged (then the restore's attempt fails it, naming the damage in ``skipped``, and
        takes the step from the root; the reader authenticates before it loads anything)."""
        try:
            authenticate_manifest(self.path, step_dir(step), self.key)
            return True
        except ManifestDamaged:
            return True
        except (OSError, CorruptCheckpointError) as e:
            if step not in self._unsigned:
                self._unsigned.add(step)
                log.warning("ckpt._memory.tier step %d in %s is not restorable: %s", step,
                            self.path, e)
            return False

    def check_space(self, nbytes: int) -> None:
        """Raise before writing when the step does not fit the budget or /dev/shm (the
        spare slab the step is written into counts as held already)."""
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
                f"{self.shm_root} has {free} bytes free, this step needs {nbytes} in the memory "
                f"tier; enlarge /dev/shm (docker: --shm-size), lower MemoryTierOptions(keep=) "
                f"(now {self.keep}) or pass memory_tier=False", path=self.shm_root)

    def publish_rank(self, payload: Any, slab: Any) -> Any:
        """Publish this rank's share of a save, staged in ``slab``, as a rank step (no
        collectives: runs on the writer thread); the newest ``keep`` rank steps are kept.
        Returns the RankTable."""
        if self.key is None:
            raise CheckpointError(f"{self.path}: the memory tier has no key yet", path=self.path)
        # Everything this rank holds, also the boxes another rank writes to the root.
        payload = dataclasses.replace(payload, pieces={**payload.pieces, **payload.held})
        staging = self.storage.begin(payload.name, payload.token)
        try:
            table = slab.table(self._fill(payload, slab, staging))
            doc = {"format": RANK_FORMAT, "step": payload.step, "rank": payload.rank,
                   "world_size": payload.world_size, "token": payload.token,
                   "created": time.time(), "node": self.node,
                   "tensors": {k: [d, list(s)] for k, (d, s) in payload.tensors.items()},
                   "items": payload.items, "aliases": payload.aliases,
                   "metadata": payload.metadata or {}, "table": table.to_json()}
            write_private(os.path.join(self.path, staging, RANK_DOC),
                          rank_doc_bytes(self.key, doc))
            fault_point("memory_commit")
            final = os.path.join(self.path, payload.name)
            commit_dir(os.path.join(self.path, staging), final,
                       lambda old: self.slabs.reclaim(old, readers_path=final))
        except BaseException:
            self.slabs.release(slab)
            shutil.rmtree(os.path.join(self.path, staging), ignore_errors=True)
            raise
        retire_rank_steps(self.path, self.keep, payload.step, self.slabs.reclaim)
        return table

    def publish_step(self, payload: Any, slab: Any) -> None:
        """Publish a single process's save, staged in ``slab``, as a step of the segment's
        ckpt root (its manifest's tag written before the commit). The caller retires the
        older generations (:meth:`retire`)."""
        from ckpt._save.commit import commit_rendered, commit_step  # (import torch)
        from ckpt._save.rank_write import write_table

        staging = self.storage.begin(payload.name, payload.token)
        try:
            name = self._fill(payload, slab, staging)
            fault_point("memory_commit")
            if payload.layouts is not None:
                report = write_table(self.storage, staging, payload, slab.table(name))
                commit_step(self.storage, staging, payload, reports=[report])
            else:
                commit_rendered(self.storage, staging, payload, {name: slab.size},
                                self._tensors_text(payload, slab, name))
        except BaseException:
            self.slabs.release(slab)
            shutil.rmtree(os.path.join(self.path, staging), ignore_errors=True)
            raise

    @staticmethod
    def _tensors_text(payload: Any, slab: Any, file: str) -> str:
        """The step's format-1 ``tensors`` member: the slab's template for the payload's
        tensors (made at the first save of this layout, as ``build_manifest`` writes the
        member), filled in with ``file`` and this save's digests."""
        from ckpt._save.commit import tensors_template

        described = list(payload.tensors.items())
        cached = slab.manifest_template
        if cached is None or cached[0] != described:
            template, order = tensors_template(payload.tensors, slab.table(file))
            cached = slab.manifest_template = (described, template, order)
        digests = slab.chunk_digests()
        return cached[1].render(file, [digests[i] for i in cached[2]])

    def _fill(self, payload: Any, slab: Any, staging: str) -> str:
        """Complete ``slab`` (the boxes staged elsewhere, CUDA's, copied in and digested once
        they have landed), move it into the step's ``staging`` directory and return the name
        of its data file there, every digest that of the shared pages (taken as they were
        copied)."""
        from ckpt._memory.slabs import staged_elsewhere
        from ckpt._save.chunking import data_file_name

        if payload.ready is not None:
            payload.ready.synchronize()
        slab.fill(staged_elsewhere(slab, payload.pieces))
        name = data_file_name(payload.token, payload.rank, 0)
        self.slabs.place(slab, os.path.join(self.path, staging), name)
        fault_point("memory_placed")
        return name

    def retire(self, newest: int) -> tuple[set[int], dict[int, bool]]:
        """After a single process's publish of ``newest``: the steps beyond the tier's keep
        (and those above ``newest``) stop existing, their slabs kept for the next saves.
        Returns the steps kept and the step directories left (one listing of the segment
        serves the whole retirement)."""
        dirs = step_dirs(self.storage)
        kept = self.kept_steps(newest, dirs)
        for s, committed in list(dirs.items()):
            if committed and s not in kept:
                self.slabs.reclaim(os.path.join(self.path, step_dir(s)))
                del dirs[s]
        return kept, dirs

    def drop(self, steps: Iterable[int]) -> list[int]:
        """Remove ``steps`` from the segment now (the job went back past them, or retired
        them), their slabs kept for the next saves; returns those that were there."""
        held = set(self.steps() if self.ranked else
                   (s for s, committed in step_dirs(self.storage).items() if committed))
        gone = sorted(held & set(steps))
        for s in gone:
            self.slabs.reclaim(os.path.join(self.path, step_dir(s)))
        if gone and not self.ranked:
            self.prune_tags()
        return gone

    def kept_steps(self, newest: int, dirs: dict[int, bool]) -> set[int]:
        """The generations of a single process's segment to keep, its step directories
        ``dirs`` as just listed (``step_dirs``): the newest ``keep`` committed steps, signed
        or not (the publisher retires the others with the collector after each publish; a
        step another job of this user wrote here under the same job id ages out like any
        other), none above ``newest``, the step just published (:func:`current_line`)."""
        steps = sorted(s for s, c in dirs.items() if c)
        return set(current_line(steps, newest)[-self.keep:])

    @staticmethod
    def strays(kept: set[int], dirs: dict[int, bool]) -> bool:
        """Whether a single process's step directories ``dirs`` (as :meth:`retire` left
        them) hold one other than the committed steps in ``kept`` (for the collector)."""
        return any(not committed or s not in kept for s, committed in dirs.items())

    def prune_tags(self, committed_steps: Iterable[int] | None = None) -> None:
        """Remove the tags of steps no longer in a single process's segment (``committed_steps``:
        those it holds, when the caller just listed them)."""
        if committed_steps is None:
            committed_steps = (s for s, c in step_dirs(self.storage).items() if c)
        committed = {step_dir(s) for s in committed_steps}
        for name in os.listdir(self.path):
            if name.startswith(TAG_PREFIX) and name[len(TAG_PREFIX):] not in committed:
                try:
                    os.unlink(os.path.join(self.path, name))
                except FileNotFoundError:
                    pass

    def remove(self) -> None:
        """Delete the segment (the job finished and its newest step is persisted)."""
        shutil.rmtree(self.path, ignore_errors=True)
        self.close()

    def close(self) -> None:
        """Release ownership; the segment stays for a restarted worker (without its spare
        slab, which holds no step)."""
        self.slabs.close()
        if not self._owner.closed:
            self._owner.close()


def write_private(path: str, data: bytes) -> None:
    """Create the file ``path`` (0600, never through a link, never over an existing file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def write_tag(segment: str, name: str, tag: str) -> None:
    """Write (or replace) the tag of step directory ``name`` of a single process's segment."""
    temp = os.path.join(segment, f"{STAGING}{TAG_PREFIX}{name}-{secrets.token_hex(6)}")
    write_private(temp, tag.encode())
    os.rename(temp, os.path.join(segment, f"{TAG_PREFIX}{name}"))


def authenticate_manifest(segment: str, location: str, key: bytes | None,
                          fd: int | None = None) -> None:
    """Raise CorruptCheckpointError unless the manifest of step directory ``location`` in a
    single process's segment (read from ``fd`` when given) carries its tag under ``key``.
    Its own digest is checked first, so that damage is reported as damage."""
    where = os.path.join(segment, location, MANIFEST_NAME)
    if fd is None:
        manifest = read_checked(where)
    else:
        size = os.fstat(fd).st_size
        manifest = os.pread(fd, size, 0)
    try:
        is_sealed(manifest)
    except Invalid as e:
        raise ManifestDamaged(damaged(where, str(e)), path=where) from None
    try:
        tag = read_checked(os.path.join(segment, f"{TAG_PREFIX}{location}")).decode("ascii")
    except FileNotFoundError:
        tag = None
    except (OSError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{where}: its tag is unreadable ({e})", path=where) from e
    if key is None or not verify(key, manifest, tag):
        raise CorruptCheckpointError(
            not_this_jobs(where, "no tag" if tag is None else "a tag that does not match"),
            path=where)


class ManifestDamaged(CorruptCheckpointError):
    """A single process's manifest in memory fails its own digest (before its tag is read)."""


def damaged(where: str, why: str) -> str:
    """The message for a step whose document fails its own digest in memory."""
    return (f"{where}: damaged in memory ({why}; a bit flipped in RAM, or the file was "
            "changed): not restored from memory. The restore tries the "
            "step's other copies (a peer's replica, the root), then older steps; nothing to "
            "do unless it recurs, then check this node's memory (ECC errors in dmesg)")


def not_this_jobs(where: str, what: str) -> str:
    """The message for a step whose tag does not check out under the job's memory key (its
    own digest did)."""
    return (f"{where}: {what} under this job's memory key, so it is not this job's step "
            "(another job with the same memory job id wrote it, or the root's memory key "
            "was replaced since), or its tag was damaged: not restored from memory. Give "
            "each job its own id (MemoryTierOptions(job=), the trainer's memory_job=)")


def rank_doc_bytes(key: bytes, doc: dict) -> bytes:
    """A rank step's ``rank.json``: ``doc`` with its tag under ``key``, then sealed with
    its own digest as its last member (``ckpt/_format/sealed.py``), so that a damaged
    document is told apart from one signed under another key."""
    return seal(json.dumps(sign_doc(key, doc), separators=(",", ":")).encode())


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
    """``path`` opened for reading, refusing a symbolic link or a file of another user, or
    one that others may write (OSError)."""
    return os.fdopen(open_checked(path), "rb")


def commit_dir(staging: str, final: str,
               remove: Callable[[str], None] | None = None) -> None:
    """Publish a finished step directory: one rename (over an older save of the step,
    moved aside first and then removed with ``remove``, by default deleted)."""
    if os.path.lexists(final):
        old = f"{os.path.dirname(final)}/{STAGING}old-{os.path.basename(final)}-{time.time_ns()}"
        os.rename(final, old)
        os.rename(staging, final)
        if remove is not None:
            remove(old)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staging, final)


def retire_rank_steps(path: str, keep: int, newest: int | None = None,
                      remove: Callable[[str], None] | None = None) -> None:
    """Delete all but the newest ``keep`` rank steps of a segment. ``newest``: the step just
    committed; steps numbered above it go first (see :func:`current_line`). ``remove``:
    how a step directory goes (the tier's takes its slab back first)."""
    steps = rank_steps(path)
    kept = current_line(steps, newest)[-keep:]
    for s in steps:
        if s not in kept:
            if remove is not None:
                remove(os.path.join(path, step_dir(s)))
            shutil.rmtree(os.path.join(path, step_dir(s)), ignore_errors=True)


def current_line(steps: list[int], newest: int | None) -> list[int]:
    """``steps`` (sorted) without those above ``newest``, the step just saved: a job saves
    a lower step only after going back to an older one (a restore of that step, a rollback,
    a newer step that failed its checks), and the steps above belong to the line of training
    it left. Kept, they would retire the new line's saves at once and win the next restore."""
    return steps if newest is None else [s for s in steps if s <= newest]


def read_rank_doc(path: str, step: int, key: bytes | None) -> dict:
    """The ``rank.json`` of a rank step, authenticated under the job's memory ``key`` and
    checked for shape (its contents are validated again as a whole manifest when the union
    of the ranks' steps is loaded). Raises CorruptCheckpointError otherwise."""
    where = os.path.join(path, step_dir(step), RANK_DOC)
    try:
        check_dir(os.path.join(path, step_dir(step)))
        with open_plain(where) as f:
            raw = f.read()
    except OSError as e:
        raise CorruptCheckpointError(f"{where}: unreadable rank step: {e}", path=where) from e
    try:
        # Its own digest first: damage is named as such, not as another job's tag. (The tag
        # is what authenticates: a document without the digest is taken when it checks out.)
        sealed = is_sealed(raw)
        doc = json.loads(raw)
    except (Invalid, ValueError) as e:
        raise CorruptCheckpointError(damaged(where, str(e)), path=where) from None
    if sealed:
        del doc[DIGEST_MEMBER]
    if key is None or not verify_doc(key, doc):
        if isinstance(doc, dict) and DIGEST_MEMBER in doc:  # its digest member is damaged
            raise CorruptCheckpointError(damaged(
                where, f"its {DIGEST_MEMBER!r} is not its last member or not 16 hex digits"),
                path=where)
        raise CorruptCheckpointError(not_this_jobs(where, "not signed"), path=where)
    doc.pop(DIGEST_MEMBER, None)
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
