"""Health-guard rollbacks of the elastic trainer, and the batches they skip.

Every rank judges a step from the same agreed loss and gradient norm
(:class:`trainer.health.HealthGuard`), so on a bad step all of them roll back to the newest
good checkpoint together. The step's global batch is then marked bad (by its data offset,
in the run directory's ``skips.jsonl``) and passed over from then on, in this attempt and
the ones after it. :class:`HealthRollbacks` holds this for
:class:`trainer.elastic.ElasticTrainer`.
"""

from __future__ import annotations

import logging
import math
import time

from trainer.data import ResumableSampler
from trainer.health import TrainingHealthError, Verdict
from trainer.metrics import format_event
from trainer.progress import json_float, record_skip

events = logging.getLogger("ckpt.trainer")


class HealthRollbacks:
    """Verdicts, rollbacks and skipped batches of :class:`trainer.elastic.ElasticTrainer`
    (a mixin: it uses the trainer's health guard, sampler, manager, state and records)."""

    def _judge(self, step: int, loss: float, grad_norm: float) -> Verdict | None:
        """The health guard's verdict on the agreed loss and gradient norm (None: no guard)."""
        if self.health is None:
            return None
        norm: float | None = grad_norm
        if (self.grad_scaler is not None and self.grad_scaler.is_enabled()
                and not math.isfinite(grad_norm)):
            norm = None  # an overflowed scaled gradient: the scaler skips the update itself
        return self.health.observe(step, loss, norm)

    def _rollback(self, verdict: Verdict, offset: int, global_indices: list[int]) -> int:
        """A bad step, agreed by every rank: restore the newest good checkpoint, mark the
        step's global batch (at data ``offset``) to be skipped, return the restored step.

        Raises TrainingHealthError past the guard's ``max_rollbacks``.
        """
        assert self.health is not None and self._manager is not None
        t0 = time.time()
        events.warning(format_event(
            "train.anomaly", rank=self.rank, step=verdict.step, reason=verdict.reason,
            loss=verdict.loss, grad_norm=verdict.grad_norm, median=verdict.median,
            threshold=verdict.threshold))
        try:
            count = self.health.rollback(verdict)
        except TrainingHealthError:
            events.error(format_event(
                "train.give_up", rank=self.rank, step=verdict.step, reason=verdict.reason,
                rollbacks=len(self.health.rollbacks), max_rollbacks=self.health.max_rollbacks))
            raise
        restored = self._restore_good(verdict, offset)
        self._note_rollback(verdict, offset, global_indices, restored, count, t0)
        return restored

    def _restore_good(self, verdict: Verdict, offset: int) -> int:
        """Restore the newest checkpoint before ``verdict.step`` and mark the batch at data
        ``offset`` bad; returns the restored step."""
        if self.grad_scaler is not None:
            self.grad_scaler.update()  # end the scaler's step (unscale_ ran); restored below
        self.optimizer.zero_grad(set_to_none=True)
        restored = self._manager.restore(self.state)
        if restored is None or restored >= verdict.step:
            raise TrainingHealthError(
                f"{verdict.describe()}: no checkpoint before step {verdict.step} to roll "
                f"back to (found {restored})", [*self.health.rollbacks])
        meta = self.state.get("meta") or {}
        self._skipped_batches = int(meta.get("skipped_batches", 0))
        self._skips.add(offset)
        self.health.rewind(restored)
        self.metrics.rolled_back(restored)
        self._step = restored
        if self._heartbeat is not None:
            self._heartbeat.update(restored)
        return restored

    def _note_rollback(self, verdict: Verdict, offset: int, global_indices: list[int],
                       restored: int, count: int, t0: float) -> None:
        """The rollback's event, progress record, ``skips.jsonl`` entry (rank 0) and metrics."""
        fields = {"step": verdict.step, "reason": verdict.reason, "restored_step": restored,
                  "rollbacks": count, "max_rollbacks": self.health.max_rollbacks,
                  "skip_offset": offset, "skip_indices": global_indices}
        events.warning(format_event("train.rollback", rank=self.rank, **fields,
                                    seconds=round(time.time() - t0, 3)))
        self._record("rollback", **fields, loss=json_float(verdict.loss),
                     grad_norm=json_float(verdict.grad_norm),
                     global_batch=self.global_batch_size, seconds=time.time() - t0)
        if self.rank == 0 and self.run_dir is not None:
            record_skip(self.run_dir,
                        {"offset": offset, "global_batch": self.global_batch_size,
                         "step": verdict.step, "attempt": self.attempt,
                         "reason": verdict.reason, "indices": global_indices})
        self.metrics.write_textfile()

    def _skip_known_bad(self, step: int) -> None:
        """Pass over the global batches marked bad (by a rollback of this or an earlier
        attempt) that are next in the data order; ``step`` then trains the next one."""
        while self._skips and self._data_offset() in self._skips:
            offset = self._data_offset()
            skipped = self.sampler.next_indices(self.global_batch_size)
            mine = ResumableSampler.rank_slice(skipped, self.rank, self.world_size)
            self._skipped_batches += 1
            if offset not in self._skips_counted:  # passed over again after a rollback: once
                self._skips_counted.add(offset)
                self.metrics.skipped(1)
            events.warning(format_event("train.skip", rank=self.rank, step=step, offset=offset,
                                        indices=skipped))
            self._record("skip", step=step, offset=offset, indices=skipped)
            self._audit_write(step, offset=offset, indices=mine, skipped=True)


__all__ = ["HealthRollbacks"]
