"""CheckpointManager: a training loop's checkpoints, made of policies: the save schedule, the
retention policy, the restorer, the root's owner and the memory publisher."""

from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import Any, Iterable, Mapping, MutableMapping

import torch

from storage_backends import Storage

from ckpt._format.manifest import Manifest
from ckpt._format.names import step_dir
from ckpt._load.as_saved import MapLocation
from ckpt._manager.metrics import CheckpointMetrics, default_labels
from ckpt._manager.publisher import MemoryPublisher
from ckpt._manager.restorer import PREFERENCES, RestoreInfo, Restorer
from ckpt._manager.root import RootOwner
from ckpt._manager.saver import REPORT_EVERY, Saver
from ckpt._manager.schedule import SaveSchedule
from ckpt._manager.step_order import StepOrder
from ckpt._manager.settings import resolve
from ckpt._retention.collect import GcReport, collect
from ckpt._retention.policy import RetentionPolicy
from ckpt._save.handle import SaveHandle
from ckpt._shared.distributed import Group
from ckpt._shared.progress import TerminalProgress
from ckpt._step.integrity import read_manifest
from ckpt._step.listing import committed_steps
from ckpt._step.verified import Verification, checked_evidence, verified_steps, write_marker
from ckpt.errors import CheckpointError, CheckpointNotFoundError, StorageError
from ckpt.options import MemoryTierOptions, MetricsOptions, SaveOptions, Schedule

log = logging.getLogger("ckpt")


class CheckpointManager:
    """Checkpoints a training loop's state under ``root``: a facade over the save schedule,
    the retention policy, the restorer, the root's owner and the memory publisher.

    Args:
        root: a directory (created if missing) or URL for ``step-XXXXXXXX`` checkpoints, or
            a :class:`storage_backends.Storage`.
        every_steps, keep_last: shorthands for ``schedule=ckpt.Schedule(every_steps=N)``
            (default 1) and ``retention=ckpt.RetentionPolicy(keep_last=N)`` (default: all).
        async_save: ``save`` returns once the state is in host memory; the write goes on in
            the background (its error surfaces on the next save/wait/close).
        read_only: take no lock and refuse saves (to inspect or restore another job's root).
        process_group: the ranks that save together (default: the default group when
            torch.distributed is initialized); call ``save``/``restore`` on every rank.
        storage_options: for object-store roots, passed to the backend (docs/storage.md).
        options: how saves are written (:class:`ckpt.SaveOptions`).
        schedule: when saves are written (:class:`ckpt.Schedule`).
        retention: which steps are kept (:class:`ckpt.RetentionPolicy`).
        memory_tier: True or a :class:`ckpt.MemoryTierOptions`: also publish every save
            into node-local shared memory, for restarts from RAM (docs/memory-tier.md).
        metrics: True, False or a :class:`ckpt.MetricsOptions`: counters and timings in
            ``mgr.metrics``, optionally exported to Prometheus.

    The keywords of earlier releases (``every_seconds``, ``keep_every``, ``allow_pickle``,
    ``memory_job``, ...) still work, with a DeprecationWarning naming the new spelling.

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
                 keep_last: int | None = None, async_save: bool = True,
                 read_only: bool = False, process_group: Any = None,
                 storage_options: dict | None = None, options: SaveOptions | None = None,
                 schedule: Schedule | None = None, retention: RetentionPolicy | None = None,
                 memory_tier: bool | MemoryTierOptions = False,
                 metrics: bool | MetricsOptions = True, **deprecated: Any) -> None:
        settings = resolve(every_steps=every_steps, keep_last=keep_last, options=options,
                           schedule=schedule, retention=retention, memory_tier=memory_tier,
                           metrics=metrics, deprecated=deprecated)
        self._options, self._retention = settings.options, settings.retention
        self._read_only, self._closed = read_only, False
        self._metrics = None if settings.metrics_to is None else CheckpointMetrics(
            port=settings.metrics_to.port, addr=settings.metrics_to.addr,
            textfile=settings.metrics_to.textfile, labels=default_labels())
        self._loaded_step: int | None = None
        self._last_restore: RestoreInfo | None = None
        self._publisher: MemoryPublisher | None = None
        self._saver: Saver | None = None
        self._group = Group(process_group)
        self._root = RootOwner(root, self._group, read_only=read_only,
                               storage_options=storage_options)
        memory = settings.memory
        self._schedule = SaveSchedule(settings.schedule, self._group,
                                      memory.persist_every if memory else 1)
        try:
            if not read_only:
                if memory is not None:  # None when the tier is off here (it warned why)
                    publisher = MemoryPublisher(self.storage, self._group, memory,
                                                self._metrics)
                    self._publisher = publisher if publisher.enabled else None
                self._saver = Saver(self.storage, self._group, self.steps,
                                    options=self._options, retention=self._retention,
                                    memory=self._publisher, metrics=self._metrics,
                                    copy=async_save)
                if settings.schedule.handle_sigterm:
                    self._schedule.install_sigterm(self._close_at_sigterm)
            self._restorer = Restorer(
                self.storage, self._group, self.steps, memory=self._publisher,
                metrics=self._metrics, allow_pickle=self._options.allow_pickle,
                threads=self._options.write_threads)
            # A save may reuse the numbers of the steps a restore skipped as bad, and of
            # those it passed over for an older verified step (the new timeline's).
            self._order = StepOrder(self.root, self.steps, lambda: [
                *self._restorer.skipped, *((s, "passed over for a verified step")
                                           for s in self._restorer.passed_over)],
                                    settle=self.wait)
            if self._metrics is not None:
                self._metrics.serve()  # last: a port in use fails the opening cleanly
        except BaseException:  # a manager that failed to open holds no lock or segment
            self._schedule.uninstall_sigterm()
            if self._metrics is not None:
                self._metrics.close()
            if self._publisher is not None:
                self._publisher.release()
            self._root.release()
            raise

    # -- what users read ----------------------------------------------------------------------
    root = property(lambda self: self._root.url, doc="The root's URL.")
    storage = property(lambda self: self._root.storage, doc="The root's storage.")
    group = property(lambda self: self._group, doc="The ranks that save together.")
    read_only = property(lambda self: self._read_only, doc="Whether saves are refused.")
    options = property(lambda self: self._options, doc="How saves are written.")
    retention = property(lambda self: self._retention, doc="Which steps are kept.")
    metrics = property(lambda self: self._metrics,
                       doc="Counters and timings of saves and restores, or None.")
    skipped = property(lambda self: self._restorer.skipped,
                       doc="(step, reason) of each step a restore or load skipped as bad.")
    last_restore = property(lambda self: self._last_restore,
                            doc="Where the last ``restore`` came from (a RestoreInfo), or None.")
    loaded_step = property(lambda self: self._loaded_step,
                           doc="The step the last ``load()`` returned, or None.")
    backpressure_waits = property(lambda self: self._saver.backpressure_waits if self._saver
                                  else 0, doc="Saves that waited for the save before them.")

    @property
    def preempted(self) -> bool:
        """True once SIGTERM arrived: a loop may finish its step, save and stop."""
        return self._schedule.preempted_by is not None

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return committed_steps(self.storage)

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def verified_steps(self) -> list[int]:
        """Committed steps marked verified (:meth:`mark_verified`), oldest first. A marker
        that is damaged, edited, or left by an earlier save of the step number is not
        trusted (logged; ``ckpt ls`` shows why)."""
        return sorted(verified_steps(self.storage, self.steps()))

    def mark_verified(self, step: int,
                      evidence: Mapping[str, Any] | None = None) -> Verification | None:
        """Record that the training after the committed ``step`` stayed healthy: ``step``
        becomes *verified*. ``restore(state, prefer="verified")`` then tries it before newer
        unverified steps, and retention never deletes the newest verified step.

        ``evidence`` (a small JSON object, at most 8 KiB) says what was checked, e.g.
        ``{"window": 10, "confirmed_at": 110, "checks": ["finite_loss", "loss_spike"]}``;
        it is stored in the step's marker (docs/format.md, "Verified steps") with the time.
        The marker is written once (create-only) by rank 0, the root's writer; on other
        ranks this checks ``evidence`` and returns None (no collective). Marking a verified
        step again keeps its first marker. It waits for the retention after the newest
        commit, if that is still running (it sweeps the step directories).

        Returns:
            The step's :class:`~ckpt._step.verified.Verification` (rank 0), else None.

        Raises:
            CheckpointNotFoundError: ``step`` is not committed in the root (still being
                written in the background: ``mgr.wait()`` first; a memory-only save).
            TypeError, ValueError: ``evidence`` is not a small JSON object.
            StorageError: the marker could not be written.
        """
        self._check_writable()
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"mark_verified(step=...): step must be an int, not {step!r}")
        evidence = checked_evidence(evidence)
        if not self._group.is_coordinator:
            return None
        if self._saver is not None and self._saver.writing(step):
            raise CheckpointNotFoundError(
                f"step {step} is still being written in the background: mark it verified "
                "once mgr.wait() returns (or its save handle is done)", path=self.root)
        if self._saver is not None:
            self._saver.settle()  # the retention in flight sweeps the step directories
        try:
            verification = write_marker(self.storage, step, evidence)
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointNotFoundError(
                f"step {step} is not committed in {self.root}, so it cannot be marked "
                "verified (a save kept in the memory tier only is never verified: only a "
                "step in the root has the manifest a marker vouches for; docs/guide.md, "
                "'Verified steps'); list the steps with mgr.steps()", path=self.root) from None
        except OSError as e:
            raise StorageError(f"marking step {step} verified in {self.root} failed: {e}",
                               path=self.root) from e
        log.info("ckpt.verified step=%d evidence=%s", step, evidence)
        return verification

    def manifest(self, step: int) -> Manifest:
        """The validated manifest of a committed step (a step saved in the background is
        committed once :meth:`wait` returns)."""
        try:
            return read_manifest(self.storage, step_dir(step), step)
        except CheckpointNotFoundError as e:
            if self._saver is None or not self._saver.writing(step):
                raise
            raise CheckpointNotFoundError(
                f"step {step} is still being written in the background, so it has no "
                "committed manifest yet: call mgr.wait() first", path=e.path) from e

    # -- saving -------------------------------------------------------------------------------
    def save(self, step: int, state: MutableMapping[str, Any], *, force: bool = False,
             metadata: dict | None = None, metrics: dict[str, float] | None = None,
             persist: bool | None = None, overwrite: bool = False) -> SaveHandle | None:
        """Save ``state`` as ``step`` when the schedule says so (or ``force``).

        ``step`` must come after the newest step saved in the root (a restore picks the
        newest): a lower one, or the same one, raises :class:`ckpt.StepOrderError` unless
        ``overwrite=True``; steps a restore skipped as bad and retired steps do not count
        (docs/guide.md, "Step numbers").

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
        self._saver.raise_failed()
        if persist not in (None, True, False):
            raise TypeError(f"save(persist=...) must be True, False or None, not {persist!r}")
        if persist is False and self._publisher is None:
            raise ValueError("save(persist=False) keeps a save in memory only: it needs "
                             "memory_tier=True; pass persist=None")
        preempted = self._schedule.preempted_save
        if not self._schedule.due(step, force):
            return None
        self._order.check(step, overwrite)
        if metrics is not None:
            metadata = {**(metadata or {}), "metrics": _checked_metrics(metrics)}
        metadata = self._retention.record_in(metadata)  # what `ckpt gc` applies later
        to_root = self._publisher is None or preempted or self._schedule.persist_due(step, persist)
        with self._schedule.exit_deferred():  # SIGTERM meanwhile: this save first, then exit
            handle = self._saver.save(step, state, metadata, to_root=to_root)
            self._order.saved(step, to_root)
        if not self._saver.copy or preempted:
            with self._progress(f"ckpt: saving step {step}", handle):
                handle.wait()
            self._saver.settle()  # a synchronous save returns with the retention applied
        if preempted:
            log.warning("ckpt.preempted step=%d saved; exiting", step)
            self.close()
            raise SystemExit(128 + self._schedule.preempted_by)
        return handle

    def save_due(self, step: int) -> bool:
        """Whether ``save(step)`` will write, by the step schedule (``every_steps``, the same
        on every rank) or because this rank got SIGTERM with ``save_on_preemption``. No
        collective, nothing changes. With ``every_seconds`` the steps it makes due are known
        only inside ``save`` (rank 0's clock decides there, for every rank): False here.

        Example (time the wait for the previous save apart from the save)::

            if mgr.save_due(step):
                waited = mgr.wait_for_save_in_flight(step)
            mgr.save(step, state)
        """
        return self._schedule.step_due(step) or self._schedule.preempted_save

    def wait_for_save_in_flight(self, step: int, *,
                                report_every: float | None = REPORT_EVERY) -> float:
        """Before saving ``step``: wait for the save in flight, as ``save(step)`` does itself
        when the previous save still writes (one save in flight at a time), for a loop that
        times or marks that wait on its own. The wait counts once as backpressure
        (``mgr.backpressure_waits``, ``ckpt_backpressure_waits_total``): the ``save`` after
        it finds nothing in flight and does not wait or count again. While it waits, a
        ``ckpt.save_slow step=N waiting_for=M waited_s=S`` warning every ``report_every``
        seconds (None: none) says the storage is slower than the save interval; a
        ``ckpt.backpressure`` line says how long it took.

        Returns:
            The seconds waited (0.0 when no save was in flight, or on a read-only manager).

        Raises:
            CheckpointError: the save in flight failed (its error, as ``wait`` raises it).
            TypeError, ValueError: ``step`` is not an int, ``report_every`` not a positive
                number or None.
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"wait_for_save_in_flight(step=...): step must be an int, not "
                            f"{step!r}")
        if report_every is not None and (isinstance(report_every, bool) or not isinstance(
                report_every, (int, float)) or not report_every > 0):
            raise ValueError("wait_for_save_in_flight(report_every=...) must be a positive "
                             f"number of seconds or None, not {report_every!r}")
        if self._saver is None:
            return 0.0
        return self._saver.wait_for_previous(step, report_every=report_every)

    def prepare(self, state: MutableMapping[str, Any]) -> None:
        """Allocate the host staging buffers for ``state`` now (pinned for CUDA tensors), so
        the first ``save`` blocks no longer than later ones. Writes nothing. With a process
        group, call it on every rank (it agrees on who writes what, like a save)."""
        self._check_writable()
        self._saver.prepare(state)

    def retire(self, steps: Iterable[int]) -> GcReport:
        """Retire committed ``steps`` now, e.g. the old timeline's after a rollback; files
        that kept steps still use stay. Waits for the save in flight first.

        Example (after ``restore(state, step=100)``, make the new timeline win)::

            mgr.retire(s for s in mgr.steps() if s > 100)

        With a memory tier, the steps also leave this rank's segment. Under a process group,
        their saves (those this node holds, those the last restore found on the other nodes,
        and those the root lists) are recorded as retired in the root
        (``.ckpt-memory-retired.json``) and every rank's restore passes over them
        (``last_restore.skipped``: "retired"), although the other ranks' segments and the
        replicas keep them until their next save; a step none of those names is logged as a
        warning (docs/memory-tier.md, "Limits"). A later save of the same step number is
        restored as usual. Call it on one rank (the trainer's rank 0).
        """
        self._check_writable()
        self.wait()
        steps = set(steps)
        # Memory first: a crash between the two leaves the steps in the root, as if retire
        # had not run, never gone from the root yet restorable from another rank's memory.
        if self._publisher is not None:
            self._publisher.retire(steps)
        report = collect(self.storage, set(self.steps()) - steps)
        self._order.retired(steps)
        log.info("ckpt.retire retired=%s freed_bytes=%d", report.retired_steps,
                 report.freed_bytes)
        return report

    def _check_writable(self) -> None:
        if self._read_only:
            raise CheckpointError(f"{self.root} was opened read_only: saves are refused")
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed")

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the save in flight and the retention after it; raise the save's error
        if it failed. (The save's own handle is done as soon as its step is committed.)"""
        if self._saver is not None:
            with self._progress_of_inflight():
                self._saver.wait(timeout)

    def _progress(self, label: str, handle: SaveHandle | None = None) -> Any:
        """A progress line on rank 0's terminal while the caller waits (ckpt/_shared/
        progress.py: drawn only on a terminal, after a second)."""
        if not self._group.is_coordinator:
            return contextlib.nullcontext()
        return TerminalProgress(label, getattr(handle, "progress", None))

    def _progress_of_inflight(self) -> Any:
        handle = self._saver.inflight if self._saver is not None else None
        if handle is None or handle.done():
            return contextlib.nullcontext()
        return self._progress(f"ckpt: finishing the save of step {handle.step}", handle)

    def wait_replicated(self, timeout: float | None = None) -> bool:
        """Wait for the save in flight and for its memory-tier replicas to be stored by the
        peers (acknowledged); False when the replication did not finish within ``timeout``.
        Before a planned stop, so that the newest step survives losing this node."""
        self.wait(timeout)
        return self._publisher is None or self._publisher.drain(timeout)

    # -- restoring ----------------------------------------------------------------------------
    def restore(self, state: MutableMapping[str, Any], step: int | None = None, *,
                strict: bool = False, verify: str = "digest",
                prefer: str = "newest") -> int | None:
        """Load the newest good checkpoint (or ``step``) into ``state`` in place.

        ``prefer="verified"`` tries the verified steps (:meth:`mark_verified`) first, newest
        first, then the others as usual; without any verified step it restores as
        ``"newest"`` does. The steps after the verified one it restores may be saved again
        (a new timeline) without ``overwrite``; the steps after it leave the memory tier (every
        rank's segment and the replicas), so that a restart before the next save resumes
        from the step restored (the root's stay until :meth:`retire` or saves of the same
        numbers). A restore that fell back past steps that failed to load keeps their
        memory copies (another copy may serve a later restore).

        A step that fails validation is skipped with a warning and the one before it is
        tried (recorded in ``mgr.skipped``); with ``strict`` (or an explicit ``step``) the
        error is raised instead. With a memory tier, each step is tried from this node's
        memory, then the peers' replicas, then the root; ``mgr.last_restore`` says which.
        The newest step is read once, each block digested where it lands; a step that
        loads after a failed one writes every live tensor again. ``strict``, ``step`` and
        ``verify="forward"`` check every chunk before writing any (docs/design.md,
        "Loading"). ``verify``: ``"structure"``, ``"digest"`` (default) or ``"forward"``
        (also the probe recorded at save time; ckpt/_load/levels.py).

        Returns:
            The restored step, or None when the root has no checkpoint yet.

        Raises:
            StateMismatchError: the checkpoint does not fit ``state`` (nothing is changed).
            CorruptCheckpointError: every committed step failed validation (or ``strict``).
            ForwardCheckError: every step failed its forward check.
            PartialLoadError: a step read in one pass failed after it had written live
                tensors, and no step after it could repair them; the message names them.
        """
        if prefer not in PREFERENCES:
            raise ValueError(f"restore(prefer=...) must be one of {PREFERENCES}, not "
                             f"{prefer!r}")
        if not self._read_only and not self._closed:
            self.wait()
        with self._progress(f"ckpt: restoring from {self.root}"):
            restored = self._restorer.restore(state, step, strict=strict, verify=verify,
                                              prefer=prefer)
        self._order.restored(None if restored is None else restored.step, step is None)
        if restored is None:
            return None
        if self._restorer.restored_verified and self._publisher is not None:
            # A rollback to a verified step: the steps after it leave the memory tier now, so
            # that a restart before the next save does not resume from them. (A restore that
            # fell back past steps that failed to load keeps their copies: another may serve.)
            self._publisher.went_back(restored.step)
        self._last_restore = restored.info
        if self._saver is not None:
            self._saver.base = restored.manifest
        return restored.step

    def load(self, step: int | None = None, *, map_location: MapLocation = None,
             prefer: str = "newest") -> dict[str, Any] | None:
        """The newest good step (or ``step``) without a template, like ``torch.load``: a
        dict of the saved items (see :func:`ckpt.load`); ``mgr.loaded_step`` says which step.

        Falls back past steps that fail validation as :meth:`restore` does (each skipped with
        a warning, recorded in ``mgr.skipped``); an explicit ``step`` raises instead.
        ``prefer="verified"`` tries the verified steps first, newest first, as
        :meth:`restore` does (and, as there, the steps after the one it loaded may be saved
        again without ``overwrite``). Reads the root only (never the memory tier).

        Returns:
            The saved items, or None when the root has no checkpoint yet.

        Raises:
            ValueError: ``prefer`` is neither ``"newest"`` nor ``"verified"``.
            CorruptCheckpointError: every committed step failed validation.
            UnsupportedValueError: the step holds pickled values and the manager was not
                opened with ``SaveOptions(allow_pickle=True)``.
        """
        if prefer not in PREFERENCES:
            raise ValueError(f"load(prefer=...) must be one of {PREFERENCES}, not {prefer!r}")
        if not self._read_only and not self._closed:
            self.wait()
        loaded = self._restorer.load(step, map_location=map_location, prefer=prefer)
        self._order.restored(None if loaded is None else loaded.step, step is None)
        if loaded is None:
            return None
        self._loaded_step = loaded.step
        if self._saver is not None:
            self._saver.base = loaded.manifest
        return loaded.value

    # -- lifetime -----------------------------------------------------------------------------
    def _close_at_sigterm(self) -> None:
        try:
            self.close()
        except CheckpointError:
            log.exception("the save in flight at SIGTERM failed")

    def close(self, *, finished: bool | None = None) -> None:
        """Finish the save in flight, release the lock; raises the save's error if any.

        ``finished``: whether training has ended. At the end the memory tier's segment is
        removed once its newest step is in the root; before it (False: a preemption, an
        error) it is kept, so that the restart restores from memory. None (the default):
        ended, unless SIGTERM reached the manager's handler; a ``with`` block left by an
        exception (other than ``sys.exit(0)``) closes with False."""
        if self._closed:
            return
        self._closed = True
        try:
            if finished is None:
                finished = self._schedule.preempted_by is None
            try:
                if self._saver is not None:
                    with self._progress_of_inflight():
                        self._saver.close()
            except BaseException:
                finished = False  # the last save failed: what memory holds may be newest
                raise
            finally:
                if self._publisher is not None:  # its lock and threads go whatever happened
                    self._publisher.close(persisted=self.latest_step(), finished=finished)
        finally:
            self._root.release()
            self._schedule.uninstall_sigterm()
            if self._metrics is not None:
                self._metrics.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # An exception ends the block before the end of training; sys.exit(0) does not.
        clean = exc_type is None or (isinstance(exc, SystemExit) and exc.code in (0, None))
        self.close(finished=None if clean else False)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and getattr(self, "_root", None) is not None:
            try:
                self._root.release()
            except Exception:  # interpreter shutdown: the kernel drops the flock anyway
                pass


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
