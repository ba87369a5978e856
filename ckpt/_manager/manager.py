"""CheckpointManager: saves on a schedule, keeps what the retention policy says, restores the
newest good step (falling back past bad ones), and owns the root's writer lock."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import math
import os
import signal
import threading
import time
from typing import Any, Iterable, Iterator, MutableMapping

import torch

from storage_backends import LockHeldError, Storage, open_storage
from storage_backends.locks import describe_owner

from ckpt._shared.distributed import Group
from ckpt._save.engine import BackgroundWriter, SaveHandle, Stager
from ckpt.errors import (CheckpointError, CheckpointLockedError, CheckpointNotFoundError,
                     CorruptCheckpointError, PartialLoadError, StorageError)
from ckpt._format.manifest import MANIFEST_NAME, Manifest, step_dir
from ckpt._load.gate import Gate, verify_level
from ckpt._step.incremental import GcReport, chain_length, collect, step_dirs
from ckpt._step.integrity import read_manifest
from ckpt._memory.tier import MemoryTier
from ckpt._memory.replication import Replicator
from ckpt._manager.metrics import CheckpointMetrics, default_labels
from ckpt.options import KeepBest, SaveOptions
from ckpt._load.probe import PROBE_ITEM, Probe
from ckpt._load.reader import few_keys, load_step
from ckpt._save.snapshot import snapshot
from ckpt._load.structure import MapLocation, read_structure

log = logging.getLogger("ckpt")


def list_steps(storage: Storage) -> list[int]:
    """Committed steps under a root, oldest first (a step directory with its manifest)."""
    return sorted(step for step, committed in step_dirs(storage).items() if committed)


class CheckpointManager:
    """Checkpoints a training loop's state under ``root``.

    Args:
        root: a directory (created if missing) holding ``step-XXXXXXXX`` checkpoints.
        every_steps: ``save(step, ...)`` writes when ``step % every_steps == 0`` (default 1,
            or only by time when ``every_seconds`` is given alone).
        every_seconds: ``save(step, ...)`` also writes when this many seconds (wall clock)
            passed since the last save. Rank 0 decides and tells the other ranks (one small
            broadcast per ``save`` call), so every rank saves the same steps.
        keep_last: keep only the newest N steps (None: keep all, unless ``keep_best``).
        keep_every: also keep every step divisible by K, forever.
        keep_best, best_metric, best_mode: also keep the N steps with the best value of the
            metric ``best_metric`` passed as ``save(..., metrics={best_metric: value})``,
            lowest (``"min"``) or highest (``"max"``). Alone (no ``keep_last``) it keeps the
            best N and the newest step. The newest committed step is always kept.
        async_save: return from ``save`` once the state is copied to host memory and write
            in the background (errors surface on the next save/wait/close).
        read_only: take no lock and refuse saves (to inspect or restore another job's root).
        allow_pickle: save and load values that are neither tensors nor JSON by pickling
            (unsafe with checkpoints from untrusted sources).
        incremental: write only the chunks whose bytes changed since the base step (the step
            this manager last saved or restored); unchanged chunks are referenced.
        full_every: with ``incremental``, every K-th save is a full one (short chains).
        compression: None or "zstd" (shortcut for ``options.compression``).
        save_on_preemption: on SIGTERM, the next ``save`` call saves the current step
            whatever the schedule, waits for it, and exits with status 143. With a process
            group, ranks receive SIGTERM at different steps: agree on it in the loop (an
            all-reduce) and call ``save(step, state, force=True)`` on every rank, as
            ``trainer.ElasticTrainer`` does; a per-rank forced save mismatches the save's
            collective.
        handle_sigterm: install the SIGTERM handler (finishes the in-flight save first).
        options: layout and write tunables (:class:`ckpt.SaveOptions`).
        process_group: the ranks that save together (default: the default group when
            torch.distributed is initialized). Every rank writes its share; rank 0 holds
            the lock and commits. Call ``save``/``restore`` on every rank.
        probe: a :class:`ckpt.Probe` recorded with every save (for ``ckpt verify --level
            forward`` and ``restore(state, verify="forward")``).
        metrics, metrics_port, metrics_textfile: counters and timings of saves, kept in
            ``mgr.metrics`` (in memory) and, with prometheus_client installed, served on a
            port or written to a node_exporter textfile.
        storage_options: for object-store roots (``s3://``, ``tensorstore+…``): passed to
            fsspec / tensorstore, plus ``lease_ttl``, ``retries``, ``retry_delay``,
            ``block_size``, ``allow_unsafe_commit`` (docs/storage.md).
        memory_tier: also publish every save into node-local shared memory (``/dev/shm``),
            so a restarted worker restores from RAM (docs/elastic.md, "Memory tier").
            Under a process group each rank publishes its share, and the ranks restore the
            newest step their nodes hold completely in memory (own segments and peer
            replicas), resharded onto the current world. Not with ``incremental``.
        replicas: under a process group with ``memory_tier``, how many other nodes (a ring by
            node) receive a copy of each rank's newest step in their shared memory, in the
            background (0: none).
        persist_every: with ``memory_tier``, a save also goes to ``root`` when its step is a
            multiple of ``persist_every * every_steps`` (``every_steps`` 1 without a step
            schedule): every K-th scheduled save, the same steps after any restart. A
            preempted save, and one called with ``persist=True``, always does.
        memory_keep, memory_budget, memory_job: generations kept in memory, the most bytes the
            segment may hold, and the job id in the segment's name (default:
            TORCHELASTIC_RUN_ID, else a hash of ``root``).
        memory_dir, memory_node: where segments live (default ``/dev/shm``) and this node's
            name in them (default: env CKPT_NODE, else the hostname, followed by torchrun's
            GROUP_RANK where several nodes share a host; ckpt/_memory/tier.py).
        commit_timeout: how long rank 0 waits for the other ranks' reports before it gives
            up on a step (a rank died or hangs): the step is not committed and every rank's
            save raises.

    Raises:
        CheckpointLockedError: another live writer holds the root.
        CheckpointNotFoundError: ``read_only`` and the root does not exist.

    Example::

        with ckpt.CheckpointManager("/ckpt/run1", every_steps=100, keep_last=3) as mgr:
            start = mgr.restore(state) or 0
            for step in range(start + 1, total + 1):
                train_step()
                mgr.save(step, state)
    """

    def __init__(self, root: str | os.PathLike | Storage, *, every_steps: int | None = None,
                 every_seconds: float | None = None,
                 keep_last: int | None = None, keep_every: int | None = None,
                 keep_best: int | None = None, best_metric: str | None = None,
                 best_mode: str = "min",
                 async_save: bool = True, read_only: bool = False, allow_pickle: bool = False,
                 incremental: bool = False, full_every: int = 10,
                 compression: str | None = None, save_on_preemption: bool = False,
                 handle_sigterm: bool = True, options: SaveOptions | None = None,
                 process_group: Any = None, commit_timeout: float = 600.0,
                 probe: Probe | None = None, metrics: bool = True,
                 metrics_port: int | None = None,
                 metrics_textfile: str | None = None,
                 storage_options: dict | None = None, memory_tier: bool = False,
                 persist_every: int = 1, memory_keep: int = 2, memory_budget: int | None = None,
                 memory_job: str | None = None, replicas: int = 1,
                 memory_dir: str | None = None, memory_node: str | None = None) -> None:
        for name, value in (("every_steps", every_steps), ("keep_last", keep_last),
                            ("keep_every", keep_every), ("full_every", full_every),
                            ("persist_every", persist_every)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, not {value!r}")
        if every_seconds is not None and not (isinstance(every_seconds, (int, float))
                                              and every_seconds > 0):
            raise ValueError(f"every_seconds must be a positive number or None, not "
                             f"{every_seconds!r}")
        self.every_steps = every_steps if every_steps or every_seconds else 1
        self.every_seconds = every_seconds
        self._clock = time.monotonic  # rank 0's clock decides every_seconds
        self._last_save_time = self._clock()
        if best_metric is not None and keep_best is None:
            raise ValueError("best_metric= needs keep_best=N (how many best steps to keep)")
        self.keep_best = KeepBest(keep_best, best_metric or "", best_mode) \
            if keep_best is not None else None
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.read_only = read_only
        self.allow_pickle = allow_pickle
        self.save_on_preemption = save_on_preemption
        self.probe = probe
        self.metrics = CheckpointMetrics(port=metrics_port, textfile=metrics_textfile,
                                         labels=default_labels()) if (
            metrics or metrics_port or metrics_textfile) else None
        self.incremental = incremental
        self.full_every = full_every
        self.options = options or SaveOptions(allow_pickle=allow_pickle, compression=compression)
        if compression is not None and self.options.compression != compression:
            self.options = dataclasses.replace(self.options, compression=compression)
        self._base: Manifest | None = None  # the newest step known good, for incremental saves
        self.backpressure_waits = 0
        self.skipped: list[tuple[int, str]] = []
        self.loaded_step: int | None = None  # the step the last load() returned
        self.persist_every = persist_every
        self.last_restore: RestoreInfo | None = None
        self._memory: MemoryTier | None = None
        self._replicator: Replicator | None = None
        self._memory_pg: Any = None  # the gloo group of a multi-rank memory tier
        self._memory_plan: dict[int, Any] = {}  # step -> the agreed in-memory save to restore
        self._inflight: SaveHandle | None = None
        self._preempted: int | None = None
        self._closed = False
        self._lock = None
        self._prev_sigterm = None
        if read_only and isinstance(root, (str, os.PathLike)) and not _root_exists(root):
            raise CheckpointNotFoundError(f"checkpoint root {os.fspath(root)} does not exist",
                                          path=os.fspath(root))
        self.group = Group(process_group)
        try:
            self.storage = open_storage(
                os.fspath(root) if isinstance(root, os.PathLike) else root,
                create=not read_only, storage_options=storage_options)
        except OSError as e:  # e.g. a root that cannot be created (read-only parent, full disk)
            raise _unwritable(os.fspath(root) if not isinstance(root, Storage) else root.url,
                              e) from e
        self.root = self.storage.url
        if not read_only:
            self._take_lock_everywhere()
            self._stager = Stager()
            self._writer = BackgroundWriter(self.options, self.group, commit_timeout)
            if memory_tier:
                self._memory = self._open_memory_tier(memory_keep, memory_budget, memory_job,
                                                      memory_dir, memory_node, replicas)
            if handle_sigterm and threading.current_thread() is threading.main_thread():
                self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    # -- lock and leftovers ---------------------------------------------------------------
    def _take_lock_everywhere(self) -> None:
        """Rank 0 takes the lock and cleans up; every rank learns the outcome."""
        error = None
        if self.group.is_coordinator:
            try:
                self._take_lock()
                self._remove_leftovers()
            except CheckpointError as e:
                error = e
        message = self.group.broadcast(None if error is None else str(error))
        if error is not None:
            raise error
        if message is not None:
            raise CheckpointLockedError(f"rank 0 could not open {self.root}: {message}",
                                        path=self.root)

    def _take_lock(self) -> None:
        try:
            self._lock = self.storage.lock(describe_owner())
        except LockHeldError as e:
            raise CheckpointLockedError(
                f"{self.root} is locked by another writer ({e.who}); stop that job, point this "
                "one at another root, or open it with read_only=True to only read",
                path=self.root) from None
        except OSError as e:
            raise _unwritable(self.root, e) from e

    def _remove_leftovers(self) -> None:
        """Remove what crashed saves and GCs left behind: we hold the lock, no one writes."""
        for name in self.storage.uncommitted():
            log.info("ckpt.cleanup removing=%s reason=uncommitted", name)
            self.storage.delete(name)
        try:
            collect(self.storage)  # unreferenced files of retired steps
        except CheckpointError as e:
            log.warning("ckpt.cleanup skipped: %s", e)

    # -- queries ----------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return list_steps(self.storage)

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int) -> Manifest:
        """The validated manifest of a committed step (a step saved in the background is
        committed once :meth:`wait` returns)."""
        try:
            return read_manifest(self.storage, step_dir(step), step)
        except CheckpointNotFoundError as e:
            writing = self._inflight
            if writing is None or writing.step != step or writing.done():
                raise
            raise CheckpointNotFoundError(
                f"step {step} is still being written in the background, so it has no "
                "committed manifest yet: call mgr.wait() first", path=e.path) from e

    @property
    def preempted(self) -> bool:
        """True once SIGTERM arrived: a loop may finish its step, save and stop."""
        return self._preempted is not None

    # -- saving -------------------------------------------------------------------------------
    def save(self, step: int, state: MutableMapping[str, Any], *, force: bool = False,
             metadata: dict | None = None, metrics: dict[str, float] | None = None,
             persist: bool | None = None) -> SaveHandle | None:
        """Save ``state`` as ``step`` when the schedule says so (or ``force``).

        Blocks only while the state is copied to host memory (async) or until the step is
        committed (sync). Raises the error of an earlier background save, if it failed.
        ``metrics`` (name -> number, e.g. ``{"val_loss": 0.31}``) are stored in the
        manifest's metadata under ``"metrics"``; ``keep_best`` ranks steps by them.
        ``persist`` (with ``memory_tier``): True also writes this save to ``root`` whatever
        ``persist_every`` says (a job's final step), False to memory only, None the schedule.
        With a process group, pass the same value on every rank.

        Returns:
            A :class:`SaveHandle`, or None when the schedule skipped this step.
        """
        self._check_writable()
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"save(step=...): step must be an int, not {type(step).__name__} "
                            f"{step!r}")
        if step < 0:
            raise ValueError(f"save(step=...): step must be non-negative, not {step!r}")
        self._raise_failed_save()
        if persist not in (None, True, False):
            raise TypeError(f"save(persist=...) must be True, False or None, not {persist!r}")
        if persist is False and self._memory is None:
            raise ValueError("save(persist=False) keeps a save in memory only: it needs "
                             "memory_tier=True; pass persist=None")
        preempted = self._preempted is not None and self.save_on_preemption
        due = force or bool(self.every_steps and step % self.every_steps == 0)
        if not due and self.every_seconds is not None:
            due = self._time_due()
        if not (due or preempted):
            return None
        if self.group.is_coordinator:
            self._last_save_time = self._clock()
        if metrics is not None:
            metadata = {**(metadata or {}), "metrics": _checked_metrics(metrics)}
        if self._inflight is not None and not self._inflight.done():
            self.backpressure_waits += 1
            if self.metrics:
                self.metrics.backpressure()
            t = time.perf_counter()
            self._inflight.wait()
            log.info("ckpt.backpressure step=%d waited_s=%.3f", step, time.perf_counter() - t)
        self._raise_failed_save()
        if (self.group.is_coordinator
                and not self.storage.replaces_committed_steps
                and self.storage.exists(f"{step_dir(step)}/{MANIFEST_NAME}")):
            # Saving a step that exists (after falling back past it): an object store cannot
            # replace it at commit as POSIX does, so retire it now; files that kept steps
            # still reference stay.
            collect(self.storage, set(self.steps()) - {step})
        t0 = time.perf_counter()
        base = self._base if self.incremental else None
        if base is not None and (chain_length(base) + 1 >= self.full_every or base.step >= step):
            base = None
        if self.probe is not None:
            state = {**state, PROBE_ITEM: self.probe.record(state)}
        payload = snapshot(state, step=step, name=step_dir(step), group=self.group,
                           stager=self._stager, options=self.options, copy=self.async_save,
                           metadata=metadata, previous=base,
                           hold_all=self._hold_all)
        blocking = time.perf_counter() - t0
        handle = None
        if self._memory is not None:  # published first; the same writer thread, in order
            handle = self._publish_to_memory(payload, blocking)
        if handle is None or preempted or self._persist_due(step, persist):
            handle = self._writer.submit(self.storage, payload, blocking, self._after_commit)
            handle.add_done_callback(self._record)
        log.info("ckpt.save step=%d blocking_s=%.4f async=%s incremental=%s", step, blocking,
                 self.async_save, base is not None)
        self._inflight = handle
        if not self.async_save or preempted:
            handle.wait()
        if preempted:
            log.warning("ckpt.preempted step=%d saved; exiting", step)
            self.close()
            raise SystemExit(128 + self._preempted)
        return handle

    @property
    def _hold_all(self) -> bool:
        """A rank step in memory holds every box this rank has, also those another rank
        writes to the root (a process group's memory tier; ckpt/_memory/tier.py)."""
        return self._memory is not None and self._memory.ranked

    def _persist_due(self, step: int, persist: bool | None) -> bool:
        """Whether a save published to memory also goes to the root: ``persist``, else the
        schedule, by step number (not a count of this process's saves), so that restarted
        processes and every rank agree on it."""
        if persist is not None:
            return persist
        return step % (self.persist_every * self.every_steps) == 0

    def prepare(self, state: MutableMapping[str, Any]) -> None:
        """Allocate the host staging buffers for ``state`` now (pinned for CUDA tensors), so
        the first ``save`` blocks no longer than later ones. Writes nothing. With a process
        group, call it on every rank (it agrees on who writes what, like a save)."""
        self._check_writable()
        self.wait()
        snapshot(state, step=0, name="prepare", group=self.group, stager=self._stager,
                 options=self.options, copy=self.async_save,
                 hold_all=self._hold_all)

    def retire(self, steps: Iterable[int]) -> GcReport:
        """Retire committed ``steps`` now, e.g. the old timeline's after a rollback; files
        that kept steps still use stay. Waits for the save in flight first.

        Example (after ``restore(state, step=100)``, make the new timeline win)::

            mgr.retire(s for s in mgr.steps() if s > 100)
        """
        self._check_writable()
        self.wait()
        report = collect(self.storage, set(self.steps()) - set(steps))
        log.info("ckpt.retire retired=%s freed_bytes=%d", report.retired_steps,
                 report.freed_bytes)
        return report

    def _record(self, handle: SaveHandle) -> None:
        """Metrics and a structured log line for every finished save (runs in the writer)."""
        error = handle.exception()
        if error is not None:
            log.error("ckpt.save_failed step=%d error=%s", handle.step, error)
            if self.metrics:
                self.metrics.failed()
            return
        r = handle.wait()
        log.info("ckpt.saved step=%d bytes_written=%d bytes_reused=%d write_s=%.3f "
                 "blocking_s=%.4f", r.step, r.bytes_written, r.bytes_reused, r.write_seconds,
                 r.blocking_seconds)
        if self.metrics:
            self.metrics.saved(step=r.step, blocking=r.blocking_seconds, write=r.write_seconds,
                               written=r.bytes_written, reused=r.bytes_reused)

    def _after_commit(self, manifest: Manifest | None) -> None:
        if manifest is None:  # another rank committed: learn the new base from storage
            if self.incremental:
                latest = self.latest_step()
                self._base = self.manifest(latest) if latest is not None else None
            return
        self._base = manifest
        log.info("ckpt.commit step=%d root=%s", manifest.step, self.root)
        if self.keep_last is not None or self.keep_best is not None:
            report = collect(self.storage, self._retained(manifest.step))
            if report.retired_steps:
                log.info("ckpt.retention retired=%s freed_bytes=%d kept_files=%d",
                         report.retired_steps, report.freed_bytes, len(report.kept_files))

    def _time_due(self) -> bool:
        """Whether every_seconds passed since the last save: rank 0's clock decides for all."""
        due = self._clock() - self._last_save_time >= self.every_seconds
        return bool(self.group.broadcast(due))

    def _retained(self, newest: int) -> set[int]:
        """The steps the retention policy keeps once ``newest`` is committed."""
        steps = self.steps()
        best = None if self.keep_best is None else self.keep_best.select(
            {s: self._metric(s, self.keep_best.metric) for s in steps})
        return retention(steps, self.keep_last, self.keep_every, newest, best)

    def _metric(self, step: int, name: str) -> float | None:
        """A metric saved with ``step``, or None (none saved, or the manifest is bad)."""
        try:
            value = self.manifest(step).metadata.get("metrics", {}).get(name)
        except (CheckpointError, OSError, AttributeError) as e:
            log.warning("ckpt.retention step=%d has no readable metrics: %s", step, e)
            return None
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def _raise_failed_save(self) -> None:
        h = self._inflight
        if h is not None and h.failed() and not h.error_reported:
            h.wait()

    def _check_writable(self) -> None:
        if self.read_only:
            raise CheckpointError(f"{self.root} was opened read_only: saves are refused")
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed")

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the save in flight; raise its error if it failed."""
        if self._inflight is not None:
            h = self._inflight
            if not h.failed() or not h.error_reported:
                h.wait(timeout)

    def wait_replicated(self, timeout: float | None = None) -> bool:
        """Wait for the save in flight and for its memory-tier replicas to be stored by the
        peers (acknowledged); False when the replication did not finish within ``timeout``.
        Before a planned stop, so that the newest step survives losing this node."""
        self.wait(timeout)
        return self._replicator is None or self._replicator.drain(timeout)

    # -- restoring ----------------------------------------------------------------------------
    def restore(self, state: MutableMapping[str, Any], step: int | None = None, *,
                strict: bool = False, verify: str = "digest") -> int | None:
        """Load the newest good checkpoint (or ``step``) into ``state`` in place.

        A step that fails validation (a bad manifest, missing or truncated files, a digest
        mismatch) is skipped with a warning and the one before it is tried; with ``strict``
        (or an explicit ``step``) the error is raised instead.

        The newest step is read once, each block digested where it lands (``verify=
        "digest"``, no ``step``, not ``strict``). Should a chunk fail its digest there, the
        step that loads after it (the same step from another tier, or an older one) writes
        every live tensor and so repairs what the failed read touched; when none loads,
        restore raises :class:`PartialLoadError` naming those tensors. An explicit ``step``,
        ``strict`` and the forward level verify every chunk before the first live tensor is
        written instead, so a step that fails changes nothing (the bytes are read twice, the
        second time from the page cache; see docs/design.md, "Loading").

        ``verify`` chooses what a step must pass (ckpt/_load/gate.py): ``"structure"`` (manifest
        and file sizes; chunk digests not computed, so a flipped bit is loaded as it is),
        ``"digest"`` (also every chunk's digest; the default) or ``"forward"`` (also the
        probe recorded at save time, rerun through the restored model, must give finite
        outputs that agree with the recorded ones; a step without a probe passes with a
        logged warning). A step failing its forward check is skipped like a digest
        mismatch; when ``restore`` raises at that level, the state's models are put back as
        they were.

        Returns:
            The restored step, or None when the root has no checkpoint yet.

        Raises:
            StateMismatchError: the checkpoint does not fit ``state`` (nothing is changed).
            CorruptCheckpointError: every committed step failed validation (or ``strict``).
            ForwardCheckError: every step failed its forward check; the message lists each
                step's reason (and says so when the model's code changed).
            PartialLoadError: a step read in one pass failed after it had written live
                tensors, and no step after it could repair them; the message names them.
        """
        gate = Gate(verify_level(verify), state)
        one_pass = step is None and not strict and gate.level == "digest"
        dirty: frozenset[str] = frozenset()  # live tensors that failed steps left changed
        if not self.read_only and not self._closed:
            self.wait()
        try:
            candidates = [step] if step is not None else list(reversed(self.steps()))
        except OSError as e:  # the storage failed (after its retries): not a missing root
            raise StorageError(f"listing the steps of {self.root} failed: {e}",
                               path=self.root) from e
        tiers = self._restore_order(candidates, step)
        tried = _Fallback(self, "restore")
        in_memory_only: list[str] = []  # memory tiers' failures (the root may hold the step)
        root = _CountedReads(self.storage)  # what this restore reads from the root
        with cf.ThreadPoolExecutor(self.options.write_threads) as pool, gate:
            for s, tier in tiers:
                # In one pass, a step that fails leaves `dirty` tensors behind. A step that
                # loads writes every live tensor (load_step), so it repairs them; when none
                # does, the error names them (issue #15, defect 3: never silently mixed).
                wrote: frozenset[str] = frozenset()
                try:
                    storage = root if tier == "storage" else self._tier_storage(tier, s, state)
                except CorruptCheckpointError as e:  # every rank raised it: agreed
                    storage, error = None, e
                if storage is not None:
                    error, wrote = self._try_load(s, state, pool, in_place=one_pass, gate=gate,
                                                  storage=storage)
                    if storage is not root:
                        storage.close()  # a memory tier's open files
                # Every rank must restore the same step: agree on this one's outcome first.
                fatal, bad = tried.agree(error)
                if fatal and dirty:  # (also over this step's own PartialLoadError)
                    raise PartialLoadError(
                        f"{error or fatal[0]}; and a failed one-pass read of a newer step "
                        f"had already overwritten {len(dirty)} live tensors "
                        f"({few_keys(sorted(dirty))}): the live state is mixed; restore a good "
                        "step before training on",
                        path=self.root,
                        changed=dirty | getattr(error, "changed", dirty)) from error
                if fatal:
                    if isinstance(error, OSError) and not isinstance(error, CheckpointError):
                        raise StorageError(f"restoring step {s} from {self.root} failed: "
                                           f"{error}", path=self.root) from error
                    if error is not None and not isinstance(error, CorruptCheckpointError):
                        raise error
                    raise CheckpointError(f"another rank failed to restore step {s}: "
                                          f"{fatal[0]}", path=self.root)
                if not gate.forward:  # (that level puts the models back itself)
                    # A step another rank failed on: what this rank wrote needs repair too.
                    dirty |= error.changed if isinstance(error, PartialLoadError) else wrote
                if not bad:
                    log.info("ckpt.restore step=%d root=%s skipped=%d tier=%s", s, self.root,
                             len(tried.failures), tier)
                    here = (getattr(storage, "tier", tier), root.bytes_read)
                    ranks = tuple(self.group.all_gather(here))
                    self.last_restore = RestoreInfo(s, here[0], here[1], ranks)
                    if self.metrics:
                        self.metrics.restored(len(tried.failures))
                    return s
                if tier != "storage":  # other copies, or the root, may hold the step good
                    log.warning("ckpt.restore memory tier step=%d unusable, falling through: "
                                "%s", s, bad[0])
                    in_memory_only.append(f"step {s} ({tier} tier): {bad[0]}")
                    continue
                if strict or step is not None:
                    if isinstance(error, CheckpointError):
                        raise error
                    raise CorruptCheckpointError(bad[0], path=self.root)
                tried.skip(s, bad[0])
        # A step whose every copy was bad: never "no checkpoint yet" (a fresh start).
        tried.failures += in_memory_only
        if tried.failures:
            gate.all_failed(self.root, tried.failures)
            message = tried.none_loaded()
            if dirty:
                raise PartialLoadError(
                    f"{message}\nReading them in one pass overwrote {len(dirty)} live "
                    f"tensors ({few_keys(sorted(dirty))}) that no step could repair: the live "
                    "state is mixed; rebuild it before training on", path=self.root,
                    changed=dirty)
            raise CorruptCheckpointError(message, path=self.root)
        return None

    def _try_load(self, step: int, state: MutableMapping[str, Any],
                  pool: cf.ThreadPoolExecutor, *, in_place: bool,
                  gate: Gate | None = None, storage: Storage | None = None,
                  ) -> tuple[BaseException | None, frozenset[str]]:
        """Load ``step`` into ``state``: (the error, or None; the live tensors written)."""
        location = step_dir(step)
        gate = gate or Gate("digest", state)
        storage = storage or self.storage
        try:
            # A memory tier's agreed save comes with its manifest validated already.
            manifest = getattr(storage, "parsed_manifest", None) or read_manifest(
                storage, location, step)
            wrote = load_step(storage, location, manifest, gate.target(manifest),
                              rank=self.group.rank, allow_pickle=self.allow_pickle, pool=pool,
                              in_place=in_place, verify=gate.digests)
        except Exception as e:  # classified by _describe; re-raised by restore
            gate.agree(self.group, False)  # ranks run the forward check all or none
            return e, frozenset()
        forward_error = gate.check(step, manifest, self.group, f"{self.root}/{location}")
        if forward_error is not None:
            return forward_error, wrote
        self._base = manifest
        return None, wrote

    def load(self, step: int | None = None, *,
             map_location: MapLocation = None) -> dict[str, Any] | None:
        """The newest good step (or ``step``) without a template, like ``torch.load``: a
        dict of the saved items (see :func:`ckpt.load`); ``mgr.loaded_step`` says which step.

        Falls back past steps that fail validation as :meth:`restore` does (each skipped with
        a warning, recorded in ``mgr.skipped``); an explicit ``step`` raises instead.

        Returns:
            The saved items, or None when the root has no checkpoint yet.

        Raises:
            CorruptCheckpointError: every committed step failed validation.
            UnsupportedValueError: the step holds pickled values and the manager was not
                opened with ``allow_pickle``.
        """
        if not self.read_only and not self._closed:
            self.wait()
        tried = _Fallback(self, "load")
        with cf.ThreadPoolExecutor(self.options.write_threads) as pool:
            for s in [step] if step is not None else list(reversed(self.steps())):
                location, error, value = step_dir(s), None, None
                try:
                    manifest = read_manifest(self.storage, location, s)
                    value = read_structure(self.storage, location, manifest,
                                           rank=self.group.rank, allow_pickle=self.allow_pickle,
                                           pool=pool, map_location=map_location,
                                           skip=frozenset({PROBE_ITEM}))
                except Exception as e:  # classified as restore does; every rank agrees
                    error = e
                fatal, bad = tried.agree(error)
                if error is not None and (step is not None or _describe(error)[0] == "fatal"):
                    raise error
                if fatal:
                    raise CheckpointError(f"another rank failed to load step {s}: {fatal[0]}",
                                          path=self.root)
                if not bad:
                    self._base, self.loaded_step = manifest, s
                    log.info("ckpt.load step=%d root=%s skipped=%d", s, self.root,
                             len(tried.failures))
                    return value
                tried.skip(s, bad[0])
        if tried.failures:
            raise CorruptCheckpointError(tried.none_loaded(), path=self.root)
        return None

    # -- lifetime -----------------------------------------------------------------------------
    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._preempted = signum
        log.warning("ckpt.sigterm received; save_on_preemption=%s", self.save_on_preemption)
        if self.save_on_preemption:
            return  # the training loop's next save() call saves this step and exits
        try:
            self.close()
        except CheckpointError:
            log.exception("the save in flight at SIGTERM failed")
        raise SystemExit(128 + signum)

    def close(self) -> None:
        """Finish the save in flight, release the lock; raises the save's error if any."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self.read_only:
                self._writer.close()
                self._raise_failed_save()
                self._close_memory_tier()
        finally:
            if self._lock is not None:
                self._lock.release()
            if self._prev_sigterm is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, self._prev_sigterm)
                self._prev_sigterm = None

    # -- memory tier (ckpt/_memory/tier.py) --------------------------------------------------------
    def _open_memory_tier(self, keep: int, budget: int | None, job: str | None,
                          shm_dir: str | None, node: str | None, replicas: int) -> MemoryTier:
        if self.incremental:
            raise ValueError("memory_tier=True cannot be combined with incremental=True")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ValueError(f"replicas must be a non-negative integer, not {replicas!r}")
        if not self.group.enabled:
            return MemoryTier(self.root, self.group.rank, job=job, keep=keep, budget=budget,
                              shm_dir=shm_dir, node=node)
        import torch.distributed as dist

        from ckpt._memory.replication import new_secret, ring_targets

        # The gloo group the ranks restore through (collective: every rank creates it here,
        # in the same order).
        ranks = None if self.group.pg is None else dist.get_process_group_ranks(self.group.pg)
        self._memory_pg = dist.new_group(ranks=ranks, backend="gloo")
        if node is None and not os.environ.get("CKPT_NODE"):
            node = self._stable_node_name()
        tier = MemoryTier(self.root, self.group.rank, job=job, keep=keep, budget=budget,
                          shm_dir=shm_dir, node=node, ranked=True)
        if replicas:
            self._replicator = Replicator(shm_dir=tier.shm_dir, job=tier.job, node=tier.node,
                                          keep=tier.keep, budget=tier.budget,
                                          count=self._count_replication)
        me = (tier.node, int(os.environ.get("LOCAL_RANK", "0")),
              self._replicator.address if self._replicator else None, new_secret())
        everyone: list[Any] = [None] * self.group.world_size
        dist.all_gather_object(everyone, me, group=self._memory_pg)
        if self._replicator is not None:
            targets = ring_targets(self.group.rank, [e[0] for e in everyone],
                                   [e[1] for e in everyone], replicas)
            self._replicator.connect([everyone[t][2] for t in targets], everyone[0][3])
            log.info("ckpt._memory.tier node=%s replicas to ranks %s", tier.node, targets)
        return tier

    def _stable_node_name(self) -> str | None:
        """The hostname alone when every node has its own host: torchrun may renumber nodes
        (GROUP_RANK) after losing one, and a host's segments must keep their name. Only
        nodes sharing a host (one machine) need the node rank in the name. Collective."""
        import socket

        import torch.distributed as dist

        hosts: list[Any] = [None] * self.group.world_size
        dist.all_gather_object(hosts, (socket.gethostname(), os.environ.get("GROUP_RANK")),
                               group=self._memory_pg)
        ranks_of: dict[str, set] = {}
        for host, group_rank in hosts:
            ranks_of.setdefault(host, set()).add(group_rank)
        return socket.gethostname() if all(len(r) == 1 for r in ranks_of.values()) else None

    def _count_replication(self, what: str) -> None:
        if self.metrics:
            self.metrics.replication(what)

    def _publish_to_memory(self, payload: Any, blocking: float) -> SaveHandle:
        """Queue the step's publish into shared memory (checked against the budget now)."""
        self._memory.check_space(sum(t.numel() * t.element_size() for _, t in
                                     [*payload.pieces.values(), *payload.held.values()]))
        if self._memory.ranked:
            handle = self._writer.submit_call(
                payload.step, blocking, lambda pool: self._publish_rank(payload, pool))
        else:
            handle = self._writer.submit(self._memory.storage, payload, blocking,
                                         self._memory.after_commit)
        handle.add_done_callback(_log_memory_failure)
        return handle

    def _publish_rank(self, payload: Any, pool: Any) -> Any:
        """On the writer thread: this rank's share into its segment, then to its peers."""
        from ckpt._save.engine import SaveResult

        t0 = time.perf_counter()
        table = self._memory.publish_rank(payload, self.options, pool)
        if self._replicator is not None:
            self._replicator.submit(payload.step, os.path.join(self._memory.path, payload.name),
                                    self.group.rank)
        return SaveResult(payload.step, f"{self._memory.path}/{payload.name}",
                          table.bytes_written, 0, len(table.files), 0.0,
                          time.perf_counter() - t0)

    def _restore_order(self, candidates: list[int], step: int | None) -> list[tuple[int, str]]:
        """(step, tier) to try, newest first; at the same step memory before storage."""
        order = [(s, "storage") for s in candidates]
        if self._memory is not None and self._memory.ranked:
            from ckpt._memory.restore import candidates as in_memory, local_holdings

            docs: dict = {}  # the rank documents read while listing, not read again
            mine = local_holdings(self._memory.shm_dir, self._memory.job, self._memory.node,
                                  docs)
            self._memory_plan = {c.step: c for c in in_memory(mine, self._memory_pg, docs)
                                 if step in (None, c.step)}
            order += [(s, "memory") for s in self._memory_plan]
            # A copy found corrupt: the same step from the other copies before the root's.
            order += [(s, "memory-second") for s, c in self._memory_plan.items()
                      if c.has_second_copies()]
        elif self._memory is not None:
            order += [(s, "memory") for s in self._memory.steps() if step in (None, s)]
        rank = {"memory": 2, "memory-second": 1, "storage": 0}
        return sorted(order, key=lambda o: (o[0], rank[o[1]]), reverse=True)

    def _tier_storage(self, tier: str, step: int = 0, state: Any = None) -> Any:
        """The storage a tier's step is read from; for a process group's memory tier, the
        agreed save's bytes gathered from this node's segments and the peers (collective)."""
        if tier == "storage":
            return self.storage
        from ckpt._memory.restore import ShmReader, open_candidate

        if not self._memory.ranked:
            return ShmReader.of_root(self._memory.path)

        plan = dataclasses.replace(self._memory_plan[step], second=tier == "memory-second")
        return open_candidate(plan, state, shm_dir=self._memory.shm_dir,
                              job=self._memory.job, node=self._memory.node,
                              rank=self.group.rank, pg=self._memory_pg)

    def _close_memory_tier(self) -> None:
        """Remove the segment when its newest step is persisted (the job is done with it);
        keep it otherwise, so a restarted worker finds the newest step."""
        if self._memory is None:
            return
        mem, persisted = self._memory.steps(), self.latest_step()
        if self._replicator is not None:
            # The newest step's replica is worth a short wait; a dead peer is not.
            self._replicator.close(drain=10.0, remove_upto=persisted)
        if not mem or (persisted is not None and persisted >= mem[-1]):
            self._memory.remove()
        else:
            log.warning("ckpt._memory.tier kept %s: step %d is in memory only", self._memory.path,
                        mem[-1])
            self._memory.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and getattr(self, "_lock", None) is not None:
            try:
                self._lock.release()
            except Exception:  # interpreter shutdown: the kernel drops the flock anyway
                pass


@dataclasses.dataclass(frozen=True)
class RestoreInfo:
    """Where the last ``restore`` came from. ``tier`` (this rank): "memory" (every byte from
    this node's own segments), "peer" (any byte from a replica or another node's memory) or
    "storage" (the persistent root). ``bytes_from_storage`` (this rank): the bytes this
    restore read from the root, every attempt and pass counted (0 from memory; a two-pass
    load of a step reads its data twice). ``ranks``: (tier, bytes_from_storage) of every
    rank, by rank, the same on all ranks (every rank restores the same step, but each from
    its own tier)."""
    step: int
    tier: str
    bytes_from_storage: int
    ranks: tuple[tuple[str, int], ...] = ()


class _CountedReads:
    """A storage whose reads are counted (``bytes_read``); everything else is passed on."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._lock = threading.Lock()
        self.bytes_read = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)

    def _count(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        data = self._storage.read(path, start, length)
        self._count(len(data))
        return data

    def read_into(self, path: str, start: int, out: memoryview) -> None:
        self._storage.read_into(path, start, out)
        self._count(memoryview(out).nbytes)

    def open_reader(self, path: str) -> Any:
        return _CountedReader(self._storage.open_reader(path), self._count)

    def read_blocks(self, path: str, start: int, length: int,
                    buffer: memoryview) -> Iterator[memoryview]:
        blocks = self._storage.read_blocks(path, start, length, buffer)
        try:
            for part in blocks:
                self._count(len(part))
                yield part
        finally:
            blocks.close()


class _CountedReader:
    """A counted ``Storage.open_reader`` handle."""

    def __init__(self, reader: Any, count: Any) -> None:
        self._reader, self._count = reader, count

    def read_into(self, start: int, out: memoryview) -> None:
        self._reader.read_into(start, out)
        self._count(memoryview(out).nbytes)

    def close(self) -> None:
        self._reader.close()


def _log_memory_failure(handle: SaveHandle) -> None:
    error = handle.exception()
    if error is not None:
        log.error("ckpt._memory.tier publish of step %d failed: %s", handle.step, error)


class _Fallback:
    """The steps a restore or load tried, newest first: every rank's verdict on each (all
    ranks must load the same step) and the reasons of those skipped."""

    def __init__(self, manager: CheckpointManager, verb: str) -> None:
        self.manager, self.verb = manager, verb
        self.failures: list[str] = []

    def agree(self, error: BaseException | None) -> tuple[list[str], list[str]]:
        """(why ranks failed for good, why ranks failed at all) for this step (collective)."""
        group, mine = self.manager.group, _describe(error)
        outcomes = group.all_gather(mine) if group.enabled else [mine]
        return [o[1] for o in outcomes if o and o[0] == "fatal"], [o[1] for o in outcomes if o]

    def skip(self, step: int, reason: str) -> None:
        log.warning("ckpt.%s skipping step=%d reason=%s", self.verb, step, reason)
        self.manager.skipped.append((step, reason))
        self.failures.append(f"step {step}: {reason}")

    def none_loaded(self) -> str:
        root = self.manager.root
        return (f"no committed step under {root} could be loaded; `ckpt verify --all {root}` "
                "gives details:\n  " + "\n  ".join(self.failures))


def _describe(error: BaseException | None) -> tuple[str, str] | None:
    """A picklable verdict on one rank's load attempt: None, ("bad", why) or ("fatal", why)."""
    if error is None:
        return None
    if isinstance(error, PartialLoadError) and error.corrupt:  # another step repairs
        # Its cause, not its advice ("load a good step again"): the fallback does just that,
        # and if no step can, restore's own error names the overwritten tensors.
        return ("bad", f"{error.__cause__ or error} (read in one pass: the tensors it "
                       "overwrote are reloaded from the next step tried)")
    if isinstance(error, (CorruptCheckpointError, CheckpointNotFoundError)):
        return ("bad", str(error))
    return ("fatal", f"{type(error).__name__}: {error}")


def _checked_metrics(metrics: dict[str, float]) -> dict[str, float | str]:
    """Metrics as JSON: real numbers by name; a non-finite one is kept as text ("nan")."""
    if not isinstance(metrics, dict):
        raise TypeError(f"metrics must be a dict of name -> number, not {type(metrics).__name__}")
    out: dict[str, float | str] = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(
                value, (int, float)):
            raise TypeError(f"metrics[{name!r}] must be a number under a str name, not "
                            f"{type(value).__name__}")
        value = float(value)
        out[name] = value if math.isfinite(value) else repr(value)
    return out


def retention(steps: list[int], keep_last: int | None, keep_every: int | None,
              newest: int | None = None, best: set[int] | None = None) -> set[int]:
    """The steps a keep_last/keep_every/keep_best policy keeps (``best``: the keep_best
    steps; the newest is always kept). Without keep_last or keep_best, every step;
    ``keep_last`` 0 (``ckpt gc --keep-last 0``) keeps none by count."""
    if keep_last is None:
        keep = set(steps) if best is None else set(best)
    else:
        keep = set(steps[max(0, len(steps) - keep_last):]) | (best or set())
    if newest is not None:
        keep.add(newest)
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return keep


def _unwritable(root: str, error: OSError) -> StorageError:
    """A root this writer cannot use (read-only, full, or a link where the lock goes)."""
    return StorageError(
        f"cannot open {root} for writing: {error}; check that it is writable, has free space "
        "and holds no symbolic link named .lock, or open it with read_only=True to only read",
        path=root)


def _root_exists(root: str | os.PathLike) -> bool:
    text = os.fspath(root)
    return "://" in text and not text.startswith("file://") or os.path.isdir(
        text.removeprefix("file://"))
