"""Health-guard rollbacks of the elastic trainer, and the batches they skip.

Every rank judges a step from the same agreed loss and gradient norm
(:class:`trainer.health.HealthGuard`), so on a bad step all of them roll back to the newest
good checkpoint together: the newest *verified* one (a checkpoint whose following steps
were healthy; ``CheckpointConfig.verified_window``, on by default), else the newest good
one. The step's global batch is then marked bad (by its data offset) and passed over from
then on, in this attempt and the ones after it: the run directory's ``skips.jsonl`` and the
metadata of every checkpoint saved after the rollback (:data:`BAD_BATCHES_KEY`, so that a
restart without the run directory, as on an object-store root by default, knows them too)
carry the marks. :class:`Rollbacks` does this for :class:`trainer.elastic.ElasticTrainer`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from typing import Any

from trainer.batches import GlobalBatches, StepBatch
from trainer.checkpointing import TrainerCheckpointer
from trainer.health import HealthGuard, TrainingHealthError, Verdict
from trainer.metrics import TrainerMetrics, format_event
from trainer.progress import json_float, record_skip
from trainer.records import RunRecords
from trainer.step import StepRunner

events = logging.getLogger("ckpt.trainer")
log = logging.getLogger("trainer.elastic")

#: The checkpoint metadata's item of the batches marked bad: ``{"global_batch": samples
#: per step, "offsets": [data offsets]}`` (offsets only mean a batch at that global batch
#: size).
BAD_BATCHES_KEY = "bad_batches"


def carried_bad_batches(meta: dict[str, Any], global_batch_size: int) -> list[int]:
    """The data offsets of the batches marked bad that a restored checkpoint's ``meta``
    carries, for this global batch size (another size cuts other batches: none then).
    An item that is not well formed (a hand-edited checkpoint) is logged and ignored."""
    carried = meta.get(BAD_BATCHES_KEY)
    if carried is None:
        return []
    offsets = carried.get("offsets") if isinstance(carried, dict) else None
    size = carried.get("global_batch") if isinstance(carried, dict) else None
    if (type(size) is not int or size <= 0 or not isinstance(offsets, list)
            or not all(type(o) is int and o >= 0 for o in offsets)):
        log.warning("the checkpoint's %r item is not well formed (%r): its batches are not "
                    "passed over", BAD_BATCHES_KEY, carried)
        return []
    if size != global_batch_size:
        log.info("the checkpoint marks %d batches bad at a global batch size of %d, not %d: "
                 "they are not passed over", len(offsets), size, global_batch_size)
        return []
    return sorted(set(offsets))


class Rollbacks:
    """The health guard's verdicts, the rollbacks they call for, and the batches marked bad.

    Args:
        guard: the health guard (None: every step is accepted).
        steps: whose gradients a rollback drops (and whose GradScaler it settles).
        checkpointer: what a rollback restores.
        records, metrics: where rollbacks and skips are written down.
        known_bad: data offsets of the global batches earlier attempts marked bad.
        skipped_batches: of the bad batches, how many lie behind the restored position.
        counted: offsets already counted in ``metrics`` as skipped (shared across the
            fits of one trainer, so that a batch passed over again counts once).
    """

    def __init__(self, guard: HealthGuard | None, *, steps: StepRunner,
                 checkpointer: TrainerCheckpointer, records: RunRecords,
                 metrics: TrainerMetrics, known_bad: Iterable[int], skipped_batches: int,
                 counted: set[int]) -> None:
        self.guard = guard
        self.steps, self.checkpointer = steps, checkpointer
        self.records, self.metrics = records, metrics
        self.bad: set[int] = set(known_bad)
        self.skipped_batches = skipped_batches
        self._counted = counted

    def judge(self, step: int, loss: float, grad_norm: float) -> Verdict | None:
        """The health guard's verdict on the agreed loss and gradient norm (None: no guard);
        it also counts in the verified windows of the checkpoints before ``step``."""
        if self.guard is None:
            return None
        norm: float | None = grad_norm
        scaler = self.steps.grad_scaler
        if scaler is not None and scaler.is_enabled() and not math.isfinite(grad_norm):
            norm = None  # an overflowed scaled gradient: the scaler skips the update itself
        verdict = self.guard.observe(step, loss, norm)
        self.checkpointer.judged(verdict)
        return verdict

    def rollback(self, verdict: Verdict, batch: StepBatch) -> int:
        """A bad step, agreed by every rank: restore the newest good checkpoint (the newest
        verified one first, with a verified window), mark the step's global ``batch`` to be
        skipped, return the restored step.

        Raises TrainingHealthError past the guard's ``max_rollbacks``.
        """
        assert self.guard is not None
        rank = self.records.rank
        t0 = time.time()
        events.warning(format_event(
            "train.anomaly", rank=rank, step=verdict.step, reason=verdict.reason,
            loss=verdict.loss, grad_norm=verdict.grad_norm, median=verdict.median,
            threshold=verdict.threshold))
        try:
            count = self.guard.rollback(verdict)
        except TrainingHealthError:
            events.error(format_event(
                "train.give_up", rank=rank, step=verdict.step, reason=verdict.reason,
                rollbacks=len(self.guard.rollbacks), max_rollbacks=self.guard.max_rollbacks))
            raise
        restored = self._restore_good(verdict, batch.offset)
        retired = self.checkpointer.retire_after(restored) if self.records.rank == 0 else []
        self._note(verdict, batch, restored, count, t0, retired)
        return restored

    def _restore_good(self, verdict: Verdict, offset: int) -> int:
        """Restore the newest checkpoint before ``verdict.step`` and mark the batch at data
        ``offset`` bad; returns the restored step."""
        assert self.guard is not None
        self.steps.abandon()
        restored = self.checkpointer.restore()
        if restored is None or restored >= verdict.step:
            raise TrainingHealthError(
                f"{verdict.describe()}: no checkpoint before step {verdict.step} to roll "
                f"back to (found {restored})", [*self.guard.rollbacks])
        self.skipped_batches = int(self.checkpointer.meta.get("skipped_batches", 0))
        self.bad.add(offset)
        self.guard.rewind(restored)
        self.metrics.rolled_back(restored)
        return restored

    def _note(self, verdict: Verdict, batch: StepBatch, restored: int, count: int,
              t0: float, retired: list[int]) -> None:
        """The rollback's event, progress record, ``skips.jsonl`` entry (rank 0) and metrics;
        ``retired``: the old timeline's steps rank 0 retired."""
        assert self.guard is not None
        global_batch_size = len(batch.global_indices)
        fields = {"step": verdict.step, "reason": verdict.reason, "restored_step": restored,
                  "rollbacks": count, "max_rollbacks": self.guard.max_rollbacks,
                  "skip_offset": batch.offset, "skip_indices": batch.global_indices,
                  "retired_steps": retired}
        events.warning(format_event("train.rollback", rank=self.records.rank, **fields,
                                    seconds=round(time.time() - t0, 3)))
        self.records.record("rollback", **fields, loss=json_float(verdict.loss),
                            grad_norm=json_float(verdict.grad_norm),
                            global_batch=global_batch_size, seconds=time.time() - t0)
        run_dir = self.records.run_dir
        if self.records.rank == 0 and run_dir is not None:
            record_skip(run_dir,
                        {"offset": batch.offset, "global_batch": global_batch_size,
                         "step": verdict.step, "attempt": self.records.attempt,
                         "reason": verdict.reason, "indices": batch.global_indices})
        self.metrics.write_textfile()

    def carried(self, global_batch_size: int) -> dict[str, Any]:
        """The metadata item (:data:`BAD_BATCHES_KEY`) of the batches marked bad so far."""
        return {"global_batch": global_batch_size, "offsets": sorted(self.bad)}

    def pass_known_bad(self, step: int, batches: GlobalBatches) -> None:
        """Pass over the global batches marked bad (by a rollback of this or an earlier
        attempt) that are next in the data order; ``step`` then trains the next one."""
        while self.bad and batches.offset() in self.bad:
            skipped = batches.take()
            self.skipped_batches += 1
            if skipped.offset not in self._counted:  # passed over again after a rollback
                self._counted.add(skipped.offset)
                self.metrics.skipped(1)
            events.warning(format_event("train.skip", rank=self.records.rank, step=step,
                                        offset=skipped.offset,
                                        indices=skipped.global_indices))
            self.records.record("skip", step=step, offset=skipped.offset,
                                indices=skipped.global_indices)
            self.records.audit(step, offset=skipped.offset, indices=skipped.mine,
                               skipped=True)


__all__ = ["BAD_BATCHES_KEY", "Rollbacks", "carried_bad_batches"]
