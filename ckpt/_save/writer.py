"""The background writer: a thread running saves in order, a pool for their files, the commit vote.

Threads started here: ``ckpt-writer`` (one: saves run one at a time, in the order submitted)
and ``ckpt-io`` (the pool that digests, compresses and writes a save's files); a compressed
save adds its ``ckpt-put`` I/O threads (:mod:`ckpt._save.rank_write`). How many of the pool's
threads one save uses, and their lower priority: :mod:`ckpt._save.concurrency`. No
collectives run on them: ranks agree through the store
(:class:`ckpt._shared.distributed.Group`), so a background save never races the training
loop's own collectives.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Any, Callable

from storage_backends import LockHeldError, Storage, reads_are_requests

from ckpt._format.manifest import Manifest
from ckpt._save.commit import abort, commit_step
from ckpt._save.concurrency import lower_priority, niced, writer_threads
from ckpt._save.handle import SaveHandle, SaveResult
from ckpt._save.payload import RankTable, StepPayload
from ckpt._save.rank_write import write_rank, write_table
from ckpt._shared.distributed import Group
from ckpt._shared.progress import ByteCounter
from ckpt.errors import CheckpointError, CheckpointLockedError, StorageError
from ckpt.options import SaveOptions


class BackgroundWriter:
    """One writer thread (saves run one at a time) plus a pool for the files of one save."""

    def __init__(self, options: SaveOptions, group: Group | None = None,
                 commit_timeout: float = 600.0) -> None:
        self.options = options
        self.group = group or Group()
        self.commit_timeout = commit_timeout
        # Each thread lowers its own priority as it starts (threads it starts inherit it).
        below = {"initializer": lower_priority, "initargs": (niced(options.writer_nice),)}
        self._thread = cf.ThreadPoolExecutor(1, thread_name_prefix="ckpt-writer", **below)
        self._pool = (cf.ThreadPoolExecutor(options.write_threads, thread_name_prefix="ckpt-io",
                                            **below)
                      if options.write_threads > 1 else None)

    def _run(self, storage: Storage, payload: StepPayload,
             progress: ByteCounter) -> tuple[Manifest | None, RankTable]:
        """Write and commit one save; returns (the manifest on the coordinator, this rank's
        table)."""
        if payload.ready is not None:
            payload.ready.synchronize()  # the staged bytes are all there before any is read
        staging = storage.begin(payload.name, payload.token)
        if not self.group.enabled:
            return self._run_alone(storage, staging, payload, progress)
        return self._run_voting(storage, staging, payload, progress)

    def _threads_for(self, storage: Storage, payload: StepPayload) -> int:
        """The policy's thread count for this save (staged from a GPU: ``ready`` is set; an
        object store streams no blocks: each read and write is a request)."""
        return writer_threads(self.options, from_gpu=payload.ready is not None,
                              requests=reads_are_requests(storage))

    def _run_alone(self, storage: Storage, staging: str, payload: StepPayload,
                   progress: ByteCounter) -> tuple[Manifest, RankTable]:
        """One process: write this rank's files and commit them."""
        try:
            table = write_rank(storage, staging, payload, self.options, self._pool, progress,
                               self._threads_for(storage, payload))
            if payload.layouts is not None:
                report = write_table(storage, staging, payload, table)
                return commit_step(storage, staging, payload, reports=[report]), table
            return commit_step(storage, staging, payload, [table]), table
        except BaseException:
            abort(storage, staging)
            raise

    def _run_voting(self, storage: Storage, staging: str, payload: StepPayload,
                    progress: ByteCounter) -> tuple[Manifest | None, RankTable]:
        """Two-phase commit: every rank reports its table (or its error) through the store;
        the coordinator commits only if all ranks succeeded, then announces the outcome."""
        group = self.group
        tables = payload.layouts is not None
        me = f"{payload.token}/rank{group.rank}"
        try:
            table = write_rank(storage, staging, payload, self.options, self._pool, progress,
                               self._threads_for(storage, payload))
            group.publish(me, {"ok": write_table(storage, staging, payload, table) if tables
                               else table.to_json()})
        except BaseException as e:
            group.publish(me, {"error": f"rank {group.rank}: {e}"})
            raise
        outcome = f"{payload.token}/outcome"
        if not group.is_coordinator:
            result = group.collect([outcome], self.commit_timeout + 30)[0]
            if "error" in result:
                raise CheckpointError(f"step {payload.step} was not committed: {result['error']}")
            return None, table
        keys = [f"{payload.token}/rank{r}" for r in range(group.world_size)]
        try:
            reports = group.collect(keys, self.commit_timeout)
            errors = [r["error"] for r in reports if "error" in r]
            if errors:
                raise CheckpointError("; ".join(errors))
            if tables:
                manifest = commit_step(storage, staging, payload,
                                       reports=[r["ok"] for r in reports])
            else:
                manifest = commit_step(storage, staging, payload,
                                       [RankTable.from_json(r["ok"]) for r in reports])
        except BaseException as e:
            abort(storage, staging)
            group.publish(outcome, {"error": str(e)})
            raise
        group.publish(outcome, {"ok": True})
        group.forget(keys)
        return manifest, table

    def submit(self, storage: Storage, payload: StepPayload, blocking_seconds: float,
               after_commit: Callable[[Manifest | None], None] | None = None) -> SaveHandle:
        progress = ByteCounter()

        def job() -> SaveResult:
            t0 = time.perf_counter()
            try:
                manifest, table = self._run(storage, payload, progress)
            except CheckpointError:
                raise
            except LockHeldError as e:  # the lease lapsed and another writer took the root
                raise CheckpointLockedError(
                    f"step {payload.step} was not committed: {e}; stop the other writer, or "
                    "open a new manager on this root once it is gone", path=storage.url) from e
            except Exception as e:
                raise StorageError(
                    f"saving step {payload.step} to {storage.url} failed: {e}; nothing was "
                    "committed and earlier steps are intact", path=storage.url) from e
            if after_commit is not None:
                after_commit(manifest)
            return SaveResult(payload.step, f"{storage.url}/{payload.name}", table.bytes_written,
                              table.bytes_reused, len(table.files), blocking_seconds,
                              time.perf_counter() - t0)

        return SaveHandle(payload.step, self._thread.submit(job), blocking_seconds, progress)

    def submit_call(self, step: int, blocking_seconds: float,
                    fn: Callable[[cf.ThreadPoolExecutor | None], SaveResult]) -> SaveHandle:
        """Run ``fn(pool)`` on the writer thread after the saves queued before it (the memory
        tier's per-rank publish, which needs no commit vote)."""
        return SaveHandle(step, self._thread.submit(fn, self._pool), blocking_seconds)

    def defer(self, fn: Callable[..., None], *args: Any) -> cf.Future:
        """Run ``fn(*args)`` on the writer thread after everything queued so far (called from
        a save's own job: after that save, before any save submitted later). While the
        writer closes, which waits for the job calling this, it runs here and now."""
        try:
            return self._thread.submit(fn, *args)
        except RuntimeError:  # shut down: nothing queues after this job any more
            done: cf.Future = cf.Future()
            try:
                done.set_result(fn(*args))
            except Exception as e:
                done.set_exception(e)
            return done

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class CallerThread:
    """Runs a call the writer would run (:meth:`BackgroundWriter.submit_call`) on the
    calling thread, at once; its handle is done on return, carrying the call's error as the
    writer's would."""

    def submit_call(self, step: int, blocking_seconds: float,
                    fn: Callable[[cf.ThreadPoolExecutor | None], SaveResult]) -> SaveHandle:
        future: cf.Future = cf.Future()
        try:
            future.set_result(fn(None))
        except Exception as e:
            future.set_exception(e)
        return SaveHandle(step, future, blocking_seconds)
