"""The memory publisher: opens a manager's memory tier, publishes each save into it (and to
the peer replicas), and closes it when the job is done with it.

Opening it also settles the job's memory key (``ckpt/_memory/auth.py``): rank 0, which holds
the root's writer lock, reads it from the root or creates it there, and sends it to the other
ranks over the job's own process group; every rank signs what it publishes and checks what
it restores with it, and the replicator authenticates its peers with it. When the tier cannot
be used safely on some rank (this user's private directory under ``/dev/shm`` was made by
someone else, the key file is not this user's alone), every rank turns it off with a warning
that says why and what to do, and saves go on to the root only."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

from storage_backends import Storage

from ckpt._manager.metrics import CheckpointMetrics
from ckpt._memory.auth import job_key
from ckpt._memory.discovery import local_holdings
from ckpt._memory.retired import RetiredSaves, exchange, record_retired, root_saves
from ckpt._memory.replication import Replicator, ring_targets
from ckpt._memory.tier import MemoryTier, UnsafeSegmentError
from ckpt._retention.collect import collect
from ckpt._save.handle import SaveHandle, SaveResult
from ckpt._save.writer import BackgroundWriter, CallerThread
from ckpt._shared.distributed import Group
from ckpt._step.listing import step_dirs
from ckpt.errors import CheckpointError, StorageError
from ckpt.options import MemoryTierOptions, SaveOptions

log = logging.getLogger("ckpt")


class MemoryPublisher:
    """This rank's memory tier and, under a process group, its replicator.

    Opening it under a process group is collective (every rank, in the same order): the ranks
    create the gloo group they restore through (``pg``), exchange their replicators'
    addresses and receive rank 0's memory key; they agree on whether the tier is usable
    (``enabled``: False when it is off for this manager, see the module docstring).

    Args:
        storage: the manager's root (it holds the memory key, and names the segment when no
            job is given); rank 0 holds its writer lock.
        group: the ranks that save together.
        options: the memory tier's options.
        metrics: counts the replicas sent, failed and superseded, or None.

    Raises:
        CheckpointError: (on every rank) some rank's segment is owned by another live process.
    """

    def __init__(self, storage: Storage, group: Group, options: MemoryTierOptions,
                 metrics: CheckpointMetrics | None) -> None:
        self.storage, self.group, self.metrics = storage, group, metrics
        self._staged: Any = None  # the slab of the save being staged
        self.replicator: Replicator | None = None
        self.pg: Any = None  # the gloo group of a multi-rank memory tier
        self.tier: MemoryTier = None  # type: ignore[assignment]  # set below unless disabled
        self.enabled = True
        # The whole saves (step, token) the last restore found in the live nodes' memory:
        # what a retire records when this node lost its copies (_record_retired).
        self.found: frozenset[tuple[int, str]] = frozenset()
        root = storage.url
        if not group.enabled:
            try:
                key = job_key(storage, create=True)
                self.tier = MemoryTier(root, group.rank, job=options.job, keep=options.keep,
                                       budget=options.budget, shm_dir=options.shm_dir,
                                       node=options.node, key=key)
            except (UnsafeSegmentError, OSError) as e:
                self._disable(str(e))
            return
        import torch.distributed as dist

        ranks = None if group.pg is None else dist.get_process_group_ranks(group.pg)
        self.pg = dist.new_group(ranks=ranks, backend="gloo")
        node = options.node  # else the node's identity in its shared memory (tier.node_name)
        key, unusable, failure = None, None, None
        if group.is_coordinator:  # it holds the root's writer lock: it may create the key
            try:
                key = job_key(storage, create=True).hex()
            except OSError as e:
                unusable = f"the job's memory key cannot be used: {e}"
        try:
            self.tier = MemoryTier(root, group.rank, job=options.job, keep=options.keep,
                                   budget=options.budget, shm_dir=options.shm_dir, node=node,
                                   ranked=True)
            if options.replicas:
                self.replicator = Replicator(shm_dir=self.tier.shm_dir, job=self.tier.job,
                                             node=self.tier.node, keep=self.tier.keep,
                                             budget=self.tier.budget, count=self._count)
        except (UnsafeSegmentError, OSError) as e:
            unusable = unusable or str(e)
        except CheckpointError as e:  # e.g. the segment is in use by another live process
            failure = f"rank {group.rank}: {e}"
        me = (self.tier.node if self.tier else None, int(os.environ.get("LOCAL_RANK", "0")),
              self.replicator.address if self.replicator else None, key, unusable, failure)
        everyone: list[Any] = [None] * group.world_size
        dist.all_gather_object(everyone, me, group=self.pg)
        failures = [e[5] for e in everyone if e[5]]
        unusables = [f"rank {r}: {e[4]}" for r, e in enumerate(everyone) if e[4]]
        if failures or unusables:
            self.release()
        if failures:
            raise CheckpointError(f"the memory tier cannot be opened: {failures[0]}")
        if unusables:
            self._disable(unusables[0])
            return
        key = everyone[0][3]  # rank 0's (the group's coordinator)
        self.tier.set_key(bytes.fromhex(key))
        if self.replicator is not None:
            targets = ring_targets(group.rank, [e[0] for e in everyone],
                                   [e[1] for e in everyone], options.replicas)
            # The job's key authenticates the peers (replication.py).
            self.replicator.connect([everyone[t][2] for t in targets], key)
            # A step being sent keeps its slab until it is gone (ckpt/_memory/slabs.py).
            self.tier.slabs.reading = self.replicator.reading
            log.info("ckpt._memory.tier node=%s replicas to ranks %s", self.tier.node, targets)

    def _disable(self, why: str) -> None:
        self.enabled = False
        log.warning("ckpt._memory.tier is off for this manager: %s. Saves go to the root "
                    "only.", why)

    def release(self) -> None:
        """Let go of the segment and the replicator without waiting or removing anything (a
        manager that failed to open, or a tier turned off)."""
        if self.replicator is not None:
            self.replicator.close()
            self.replicator = None
        if self.tier is not None:
            self.tier.close()

    def _count(self, what: str) -> None:
        """A replica "replicated", "failed" or "superseded" (on the replicator's threads)."""
        if self.metrics:
            self.metrics.replication(what)

    @property
    def ranked(self) -> bool:
        """Whether each rank publishes its own share (a process group's memory tier): such a
        rank step holds every box this rank has, also those another rank writes to the root."""
        return self.tier.ranked

    def destinations(self, boxes: list[tuple[str, tuple[int, ...], Any]],
                     chunk_bytes: int) -> Any:
        """Where a save copies the boxes it stages (``snapshot(destinations=)``): a slab of
        the segment (``ckpt/_memory/slabs.py``), its boxes cut into chunks of about
        ``chunk_bytes`` and digested as they are copied in, checked against the budget when
        a new slab is needed. On the caller's thread; one save is staged at a time."""
        self.discard_staged()  # a snapshot that failed after staging
        self._staged = self.tier.slabs.acquire(boxes, chunk_bytes, self.tier.check_space)
        return self._staged

    def discard_staged(self) -> None:
        """The slab of a snapshot that will not be published goes back to the spare."""
        slab, self._staged = self._staged, None
        if slab is not None:
            self.tier.slabs.release(slab)

    def publish(self, payload: Any, blocking: float, writer: BackgroundWriter,
                options: SaveOptions) -> SaveHandle:
        """Queue the publish of the step staged in shared memory (``destinations``)."""
        slab, self._staged = self._staged, None
        if slab is None:
            raise CheckpointError(f"step {payload.step} was not staged into the memory tier")
        publish = self._publish_rank if self.tier.ranked else self._publish_step
        # Published on the caller's thread (CallerThread), the publish is blocking too.
        inline, queued = isinstance(writer, CallerThread), time.perf_counter()

        def run(pool: Any) -> SaveResult:
            try:
                result = publish(payload, slab)
                spent = time.perf_counter() - queued if inline else 0.0
                return dataclasses.replace(result, blocking_seconds=blocking + spent)
            except CheckpointError:
                raise
            except Exception as e:  # named as the save's error, as the root writer's are
                raise CheckpointError(
                    f"publishing step {payload.step} into the memory tier ({self.tier.path}) "
                    f"failed: {e}; the steps it held before are intact, and the next save "
                    "publishes again", path=self.tier.path) from e

        handle = writer.submit_call(payload.step, blocking, run)
        handle.add_done_callback(_log_failure)
        return handle

    def _publish_step(self, payload: Any, slab: Any) -> SaveResult:
        """On the writer thread: a single process's step committed into its segment, then
        the generations beyond the tier's keep retired, and those above ``step`` (a line of
        training the job went back from)."""
        t0 = time.perf_counter()
        resaved = os.path.lexists(os.path.join(self.tier.path, payload.name))
        self.tier.publish_step(payload, slab)
        kept, dirs = self.tier.retire(payload.step)
        # The collector reads every kept step's manifest (a third of a publish's work):
        # only when something besides the kept steps is left, or a step number was saved
        # again over its directory (the old save's files stay there until collected).
        if resaved or self.tier.strays(kept, dirs):
            collect(self.tier.storage, kept)
            self.tier.prune_tags()
        else:  # what is left is the kept steps
            self.tier.prune_tags(kept)
        return SaveResult(payload.step, f"{self.tier.path}/{payload.name}", slab.size, 0, 1,
                          0.0, time.perf_counter() - t0)

    def _publish_rank(self, payload: Any, slab: Any) -> SaveResult:
        """On the writer thread: this rank's share into its segment, then to its peers."""
        t0 = time.perf_counter()
        table = self.tier.publish_rank(payload, slab)
        if self.replicator is not None:
            self.replicator.submit(payload.step, os.path.join(self.tier.path, payload.name),
                                   self.group.rank)
        return SaveResult(payload.step, f"{self.tier.path}/{payload.name}",
                          table.bytes_written, 0, len(table.files), 0.0,
                          time.perf_counter() - t0)

    def drain(self, timeout: float | None) -> bool:
        """Wait until the peers acknowledged the newest step's replicas (True without any)."""
        return self.replicator is None or self.replicator.drain(timeout)

    def went_back(self, step: int) -> None:
        """A restore that preferred the verified steps went back to ``step`` (a rollback):
        the steps above it belong to the line of training the job undid, and go now, from
        this rank's segment and from the replicas this rank holds, not at the next save (a
        restart before it would resume from them). (A restore that fell back past steps that
        failed to load keeps them: another copy of them may serve a later restart.)
        Collective under a process group (every rank restores): every rank first stops
        sending those steps and waits for what it is sending, so that none arrives after the
        replicas are cleared."""
        if self.replicator is not None:
            self.replicator.went_back(step)
            import torch.distributed as dist

            dist.barrier(group=self.pg)
            self.replicator.receiver.drop_above(step)
        gone = self.tier.drop(s for s in self.tier.steps() if s > step)
        if gone:
            log.info("ckpt._memory.tier went back to step %d: removed steps %s from %s", step,
                     gone, self.tier.path)

    def retire(self, steps: set[int]) -> None:
        """``steps`` were retired from the root (``CheckpointManager.retire``): they go from
        this rank's segment too, so that no restart resumes from them. Not collective: under
        a process group the other ranks' shares and the replicas of them stay in memory until
        those ranks save again, so every save of ``steps`` is first recorded as retired in
        the root (``ckpt/_memory/retired.py``: those this node holds, those the last restore
        found in memory, the root's), and every rank's restore passes over them.

        Raises:
            StorageError: the record could not be written (the steps still leave this
                rank's segment; another rank's copy may serve a restart: retire again).
        """
        try:
            if self.tier.ranked:
                self._record_retired(steps)
        finally:
            gone = self.tier.drop(steps)
            if gone:
                log.info("ckpt._memory.tier retired steps %s from %s", gone, self.tier.path)

    def _record_retired(self, steps: set[int]) -> None:
        """Record every save of ``steps`` as retired in the root: those held on this node
        (this rank's shares and the replicas it holds: one save's shares all carry its
        token), those the last restore found in the live nodes' memory, and, for a step
        still without one, the root's (``ckpt/_memory/retired.py``)."""
        held = local_holdings(self.tier.shm_dir, self.tier.job, self.tier.node,
                              key=self.tier.key)
        saves = {(h.step, h.token) for h in held if h.step in steps}
        saves |= {(s, t) for s, t in self.found if s in steps}
        unknown = self._from_root(steps - {s for s, _ in saves}, saves)
        if unknown:
            log.warning(
                "ckpt._memory.tier retired steps %s are neither in this node's memory nor in "
                "the root, and no restore of this manager found them: if other nodes hold "
                "them in memory (memory-only steps of a node this one replaced), they are not "
                "recorded as retired, and a restart before those ranks save again may resume "
                "from them. Restore first (on every rank), then retire them again; or save a "
                "step on every rank before the job may restart", sorted(unknown))
        if not saves:
            return  # none in memory (older than the tier keeps, or never there)
        # Earlier entries below the oldest step this node holds before the retire go: every
        # segment of the job holds the same newest steps, none of them any more.
        try:
            record_retired(self.storage, saves, min((h.step for h in held), default=None))
        except OSError as e:
            raise StorageError(
                f"recording the retired steps {sorted({s for s, _ in saves})} in "
                f"{self.storage.url} failed: {e}; the other ranks' memory may still hold them "
                "and a restart before their next save may resume from them: call retire() "
                "again",
                path=self.storage.url) from e
        log.info("ckpt._memory.tier recorded as retired in %s: %s", self.storage.url,
                 ", ".join(f"step {s} (save {t})" for s, t in sorted(saves)))

    def _from_root(self, missing: set[int], saves: set[tuple[int, str]]) -> set[int]:
        """Add to ``saves`` the root's saves of the ``missing`` steps that may still be in
        memory; returns the steps of those without one (a memory-only step on other nodes
        only, or a step no one saved)."""
        if not missing:
            return set()
        try:
            committed = sorted(s for s, done in step_dirs(self.storage).items() if done)
        except OSError as e:
            raise StorageError(f"listing the steps of {self.storage.url} failed: {e}; the "
                               "retired steps were not recorded: call retire() again",
                               path=self.storage.url) from e
        # Every save goes through memory, which keeps the newest `keep`: a step below the
        # root's newest `keep` is in no segment any more (not worth a manifest read).
        if len(committed) >= self.tier.keep:
            missing = {s for s in missing if s >= committed[-self.tier.keep]}
        saves |= root_saves(self.storage, sorted(missing & set(committed)))
        return missing - {s for s, _ in saves}

    def retired_saves(self) -> RetiredSaves:
        """The saves retired from memory, as the root records them (read by rank 0, the same
        on every rank). Collective under a process group; a single process's retire drops
        its steps from its one segment at once, so it has nothing to read."""
        if not self.tier.ranked:
            return RetiredSaves()
        return exchange(self.storage, self.pg, self.group.is_coordinator)

    def close(self, persisted: int | None, *, finished: bool = True) -> None:
        """Let go of the segment. At the end of training (``finished``) it is removed when its
        newest step is persisted (``persisted``: the root's newest step), as the job is done
        with it, and kept otherwise, so a restarted worker finds the newest step. Closing
        before the end (``finished`` False: SIGTERM, a preemption, an error) keeps it
        whatever was persisted: the restart that follows restores from memory, not from the
        root. A kept segment whose owner does not come back is collected once the owner has
        been dead for ``AUTO_GC_AGE`` (``ckpt/_memory/tier.py``)."""
        mem = self.tier.steps()
        if self.replicator is not None:
            # The newest step's replica is worth a short wait; a dead peer is not.
            self.replicator.close(drain=10.0, remove_upto=persisted if finished else None)
        if not mem or (finished and persisted is not None and persisted >= mem[-1]):
            self.tier.remove()
        elif not finished:
            log.info("ckpt._memory.tier kept %s (step %d) for the restart: closed before the "
                     "end of training", self.tier.path, mem[-1])
            self.tier.close()
        else:
            log.warning("ckpt._memory.tier kept %s: step %d is in memory only", self.tier.path,
                        mem[-1])
            self.tier.close()


def _log_failure(handle: SaveHandle) -> None:
    error = handle.exception()
    if error is not None:
        log.error("ckpt._memory.tier publish of step %d failed: %s", handle.step, error)
