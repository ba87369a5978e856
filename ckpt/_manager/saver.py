"""The saver: writes the saves the schedule found due, one in flight at a time: the snapshot,
the incremental base, the memory tier first, the root's commit and the retention after it."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from typing import Any, Callable, MutableMapping

from storage_backends import Storage

from ckpt._format.manifest import Manifest
from ckpt._format.names import MANIFEST_NAME, step_dir
from ckpt._load.probe import PROBE_ITEM
from ckpt._manager.metrics import CheckpointMetrics
from ckpt._manager.publisher import MemoryPublisher
from ckpt._retention.apply import steps_to_keep
from ckpt._retention.collect import collect
from ckpt._retention.policy import RetentionPolicy
from ckpt._save.handle import SaveHandle
from ckpt._save.snapshot import snapshot
from ckpt._save.staging import Stager
from ckpt._save.writer import BackgroundWriter, CallerThread
from ckpt._shared.distributed import Group
from ckpt._step.incremental import chain_length
from ckpt._step.integrity import read_manifest
from ckpt.errors import StorageError

log = logging.getLogger("ckpt")

#: Seconds between two ``ckpt.save_slow`` warnings while a save waits for the one before it.
REPORT_EVERY = 10.0


class Saver:
    """A writable manager's saves.

    Args:
        storage: the root.
        group: the ranks that save together (all call :meth:`save` and :meth:`prepare`).
        steps: the root's committed steps, oldest first.
        options: how saves are written.
        retention: applied by rank 0 after each commit.
        memory: the memory tier every save is published to first, or None.
        metrics: counts saves, or None.
        copy: copy the state to host memory and write in the background (async saves).
    """

    def __init__(self, storage: Storage, group: Group, steps: Callable[[], list[int]], *,
                 options: Any, retention: RetentionPolicy, memory: MemoryPublisher | None,
                 metrics: CheckpointMetrics | None, copy: bool) -> None:
        self.storage, self.group, self.steps = storage, group, steps
        self.options, self.retention, self.memory = options, retention, memory
        self.metrics, self.copy = metrics, copy
        self.stager = Stager()
        self.writer = BackgroundWriter(options, group, options.commit_timeout)
        self.base: Manifest | None = None  # the newest step known good, for incremental saves
        self.inflight: SaveHandle | None = None
        # The retention after the newest commit: on the writer thread once that save's
        # handle is done (the step is durable then; retiring older ones is housekeeping).
        self._retiring: cf.Future | None = None
        self.backpressure_waits = 0
        self.report_every: float | None = REPORT_EVERY  # save's wait for the one before it

    def save(self, step: int, state: MutableMapping[str, Any], metadata: dict | None, *,
             to_root: bool) -> SaveHandle:
        """Write ``state`` as ``step``: into the memory tier (if any), and to the root when
        ``to_root`` (always without a memory tier). Blocks until the state is copied."""
        self.wait_for_previous(step, report_every=self.report_every)
        if (self.group.is_coordinator
                and not self.storage.replaces_committed_steps
                and self._committed(step)):
            # Saving a step that exists (after falling back past it): an object store cannot
            # replace it at commit as POSIX does, so retire it now; files that kept steps
            # still reference stay.
            collect(self.storage, set(self.steps()) - {step})
        t0 = time.perf_counter()
        base = self.base if self.options.incremental else None
        if base is not None and (chain_length(base) + 1 >= self.options.full_every
                                 or base.step >= step):
            base = None
        if self.options.probe is not None:
            state = {**state, PROBE_ITEM: self.options.probe.record(state)}
        payload = snapshot(state, step=step, name=step_dir(step), group=self.group,
                           stager=self.stager, options=self.options, copy=self.copy,
                           metadata=metadata, previous=base, hold_all=self.hold_all,
                           destinations=self._destinations)
        blocking = time.perf_counter() - t0
        handle = None
        if self.memory is not None:  # published first; the same writer thread, in order
            # A save to memory alone of host-staged state (no device copy to wait for) is
            # published here: what is left after the copy is a few milliseconds of Python
            # (chunk table, manifest, renames), which on the niced writer thread holds the
            # GIL that training's thread then waits for behind the threads the scheduler
            # runs first, and takes a core training uses: it cost training more there.
            inline = not to_root and payload.ready is None
            handle = self.memory.publish(payload, blocking,
                                         CallerThread() if inline else self.writer,
                                         self.options)
            if inline:
                blocking = handle.blocking_seconds = time.perf_counter() - t0
        if handle is None or to_root:
            handle = self.writer.submit(self.storage, payload, blocking, self._after_commit)
            handle.add_done_callback(self._record)
        else:  # to memory alone
            handle.add_done_callback(self._record_memory)
        log.info("ckpt.save step=%d blocking_s=%.4f async=%s incremental=%s", step, blocking,
                 self.copy, base is not None)
        self.inflight = handle
        return handle

    def _committed(self, step: int) -> bool:
        try:
            return self.storage.exists(f"{step_dir(step)}/{MANIFEST_NAME}")
        except OSError as e:
            raise StorageError(f"saving step {step} to {self.storage.url} failed: {e}; "
                               "nothing was written and earlier steps are intact",
                               path=self.storage.url) from e

    @property
    def _destinations(self) -> Callable | None:
        """With a memory tier, a save is staged straight into its shared memory."""
        if self.memory is None:
            return None
        return lambda boxes: self.memory.destinations(boxes, self.options.chunk_bytes)

    @property
    def hold_all(self) -> bool:
        """A rank step in memory holds every box this rank has, also those another rank
        writes to the root (a process group's memory tier; ckpt/_memory/tier.py)."""
        return self.memory is not None and self.memory.ranked

    def prepare(self, state: MutableMapping[str, Any]) -> None:
        """Allocate the staging buffers for ``state`` (collective, like a save)."""
        self.wait()
        snapshot(state, step=0, name="prepare", group=self.group, stager=self.stager,
                 options=self.options, copy=self.copy, hold_all=self.hold_all,
                 destinations=self._destinations)
        if self.memory is not None:  # its slab is the spare the first save is staged into
            self.memory.discard_staged()

    def wait_for_previous(self, step: int, *, report_every: float | None) -> float:
        """Before saving ``step``: wait for the save in flight and the retention after it
        (one at a time: a retention never runs beside the next save), counted as
        backpressure once; a ``ckpt.save_slow`` warning every ``report_every`` seconds while
        it lasts. Raises the previous save's error. Returns the seconds waited."""
        h, retiring = self.inflight, self._retiring
        if h is not None and h.done():
            self.raise_failed()  # once: an error already raised is not raised again
            h = None
        if h is None and (retiring is None or retiring.done()):
            return 0.0
        self.backpressure_waits += 1
        if self.metrics:
            self.metrics.backpressure()
        t = time.monotonic()
        while h is not None:
            try:
                h.wait(report_every)
                break
            except TimeoutError:
                if h.done():  # it ended meanwhile, or failed with a TimeoutError of its own
                    h.wait()
                    break
                log.warning("ckpt.save_slow step=%d waiting_for=%d waited_s=%.1f: the save "
                            "before it is still being written (the storage is slower than "
                            "the save interval: save less often or to faster storage)",
                            step, h.step, time.monotonic() - t)
        while True:
            try:
                self.settle(report_every)
                break
            except TimeoutError:
                log.warning("ckpt.save_slow step=%d waiting_for=retention waited_s=%.1f: the "
                            "retention after the newest commit is still deleting older steps "
                            "(the storage is slow to delete: keep more steps, or save less "
                            "often)", step, time.monotonic() - t)
        waited = time.monotonic() - t
        log.info("ckpt.backpressure step=%d waited_s=%.3f", step, waited)
        return waited

    def raise_failed(self) -> None:
        """Raise the error of the save in flight, if it failed and was not raised yet."""
        h = self.inflight
        if h is not None and h.failed() and not h.error_reported:
            h.wait()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the save in flight and the retention after it; raise the save's error
        if it failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        h = self.inflight
        if h is not None and (not h.failed() or not h.error_reported):
            h.wait(timeout)
        self.settle(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def settle(self, timeout: float | None = None) -> None:
        """Wait for the retention after the newest commit (it logs its own failures)."""
        retiring = self._retiring
        if retiring is not None:
            try:
                retiring.result(timeout)
            except cf.TimeoutError:
                raise TimeoutError(f"the retention after the newest commit did not finish "
                                   f"within {timeout} s") from None

    def writing(self, step: int) -> bool:
        """Whether ``step`` is being written in the background now."""
        h = self.inflight
        return h is not None and h.step == step and not h.done()

    def close(self) -> None:
        """Finish the save in flight and stop the writer; raise the save's error if any."""
        self.writer.close()
        self.raise_failed()

    def _record(self, handle: SaveHandle) -> None:
        """Metrics and a structured log line for every finished save (runs in the writer)."""
        error = handle.exception()
        if error is not None:
            log.error("ckpt.save_failed step=%d error=%s", handle.step, error)
            if self.metrics:
                self.metrics.failed()
            return
        r = handle.outcome()
        log.info("ckpt.saved step=%d bytes_written=%d bytes_reused=%d write_s=%.3f "
                 "blocking_s=%.4f", r.step, r.bytes_written, r.bytes_reused, r.write_seconds,
                 r.blocking_seconds)
        if self.metrics:
            self.metrics.saved(step=r.step, blocking=r.blocking_seconds, write=r.write_seconds,
                               written=r.bytes_written, reused=r.bytes_reused)

    def _record_memory(self, handle: SaveHandle) -> None:
        """Metrics and a log line for a save published into the memory tier alone."""
        error = handle.exception()
        if error is not None:  # (the publisher logs the error itself)
            if self.metrics:
                self.metrics.failed()
            return
        r = handle.outcome()
        log.info("ckpt.saved_to_memory step=%d bytes=%d publish_s=%.3f blocking_s=%.4f",
                 r.step, r.bytes_written, r.write_seconds, r.blocking_seconds)
        if self.metrics:
            self.metrics.saved_to_memory(step=r.step, blocking=r.blocking_seconds)

    def _after_commit(self, manifest: Manifest | None) -> None:
        """On the writer thread after the commit: the new base, then the retention."""
        if manifest is None:  # another rank committed: learn the new base from storage
            if self.options.incremental:
                steps = self.steps()
                self.base = read_manifest(self.storage, step_dir(steps[-1]), steps[-1]) \
                    if steps else None
            return
        self.base = manifest
        log.info("ckpt.commit step=%d root=%s", manifest.step, self.storage.url)
        if not self.retention.keeps_all:
            # Queued behind this save on the writer thread, so that its handle is done when
            # the step is durable, not once the older steps are deleted too (half a second
            # per GiB on ext4). The next save waits for it (``settle``).
            self._retiring = self.writer.defer(self._retire, manifest.step)

    def _retire(self, newest: int) -> None:
        """Apply the retention after ``newest`` was committed (on the writer thread). The
        step is committed: a failure while retiring older steps is not its save's failure.
        The files stay, and the next save's retention retires them."""
        try:
            keep = steps_to_keep(self.storage, self.retention, self.steps(), newest=newest)
            report = collect(self.storage, keep)
        except Exception as e:  # logged: nothing waits on this task to raise it
            log.warning("ckpt.retention failed after step %d was committed (%s): the older "
                        "steps stay until the next save's retention retires them", newest, e)
            return
        if report.retired_steps:
            log.info("ckpt.retention retired=%s freed_bytes=%d kept_files=%d",
                     report.retired_steps, report.freed_bytes, len(report.kept_files))
