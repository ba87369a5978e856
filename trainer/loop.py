"""One attempt's training once its parts are built: the restore, the steps, the end.

:class:`TrainingLoop` restores the newest good checkpoint (or, with a health guard, saves
step 0 of a fresh run), runs the steps to the last one (rolling back a bad step, saving on
the schedule, leaving on preemption), saves the final state, and ends the attempt with the
job's :class:`trainer.progress.ElasticSummary`. It moves the progress markers
(:mod:`trainer.sections`) at the step's boundaries: restore, data, save, the user's hooks,
finish (the step runner marks the rest).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from trainer.batches import StepBatch
from trainer.launch import restart_count
from trainer.metrics import format_event
from trainer.parts import AttemptParts
from trainer.progress import (ElasticSummary, build_summary, json_float, recorded_skips,
                              write_summary)
from trainer.rollback import BAD_BATCHES_KEY, Rollbacks, carried_bad_batches

if TYPE_CHECKING:
    from trainer.elastic import ElasticTrainer

log = logging.getLogger("trainer.elastic")
#: One ``event key=value ...`` line per event (docs/observability.md lists them).
events = logging.getLogger("ckpt.trainer")


class TrainingLoop:
    """Trains ``parts`` (built by :func:`trainer.parts.build_parts`) for ``trainer``.

    ``counted`` holds the offsets of skipped batches already in the metrics; it outlives
    the attempt, so a retry in this process does not count a batch twice.
    """

    def __init__(self, trainer: ElasticTrainer, parts: AttemptParts, *,
                 counted: set[int]) -> None:
        self.trainer, self.parts, self.counted = trainer, parts, counted

    def _meta(self, step: int, loss: float | None) -> dict[str, Any]:
        rollbacks = self.parts.rollbacks
        meta = {"step": step, "attempt": self.parts.attempt.number,
                "world": self.parts.attempt.world_size, "loss": loss,
                "skipped_batches": rollbacks.skipped_batches if rollbacks else 0}
        if rollbacks is not None and rollbacks.bad:
            meta[BAD_BATCHES_KEY] = rollbacks.carried(self.trainer.global_batch_size)
        return meta

    def restore(self) -> int:
        """Load the newest checkpoint (a fresh run with a health guard saves step 0 instead)
        and the batches earlier rollbacks marked bad; returns the step to continue after."""
        trainer, parts = self.trainer, self.parts
        attempt, checkpointer, batches = parts.attempt, parts.checkpointer, parts.batches
        assert checkpointer is not None and batches is not None and parts.steps is not None
        trainer.sections.enter("restore")
        t0 = time.time()
        # A stop checkpoint of the previous attempt is resumed from though not verified yet;
        # rank 0 reads it once so that every rank restores the same step.
        # Without a run directory every attempt is number 0: the stop record cannot say
        # which attempt took it (trainer.checkpointing.TrainerCheckpointer.stop_step).
        numbered = attempt.number if trainer.run_dir is not None else None
        stop = attempt.broadcast(checkpointer.stop_step(numbered) if attempt.rank == 0
                                 else None)
        restored = checkpointer.restore(stop)
        start = restored or 0
        skipped, carried = 0, []
        if restored is not None:
            meta = checkpointer.meta
            carried = carried_bad_batches(meta, trainer.global_batch_size)
            skipped = int(meta.get("skipped_batches", 0))
            if batches.offset() != (start + skipped) * trainer.global_batch_size:
                log.warning("rank %d: checkpoint step %d has %d samples consumed, expected "
                            "(%d + %d skipped) x %d: was it written with another global batch "
                            "size?", attempt.rank, start, batches.offset(), start, skipped,
                            trainer.global_batch_size)
            log.info("rank %d: resumed from step %d (written by attempt %s at world size %s) "
                     "in %.2fs", attempt.rank, start, meta.get("attempt"), meta.get("world"),
                     time.time() - t0)
        elif trainer.health is not None:
            # A rollback before the first scheduled checkpoint needs a step to go back to.
            checkpointer.save(0, self._meta(0, None), force=True)
        # The batches marked bad: those in the run directory's record, and those the restored
        # checkpoint carries (all a restart without the run directory has: the rollbacks
        # before that checkpoint's save).
        known = (sorted({*recorded_skips(trainer.run_dir, trainer.global_batch_size),
                         *carried}) if attempt.rank == 0 else None)
        parts.rollbacks = Rollbacks(trainer.health, steps=parts.steps,
                                    checkpointer=checkpointer, records=parts.records,
                                    metrics=trainer.metrics,
                                    known_bad=attempt.broadcast(known),
                                    skipped_batches=skipped, counted=self.counted)
        parts.step = start
        source = checkpointer.restored_from() if restored is not None else {}
        parts.records.record("restored", step=start, fresh=restored is None,
                             seconds=time.time() - t0, started=t0, **source)
        events.info(format_event("train.resume", rank=attempt.rank, step=start,
                                 fresh=restored is None, seconds=round(time.time() - t0, 3),
                                 known_bad_batches=len(parts.rollbacks.bad), **source))
        if parts.heartbeat is not None:
            parts.heartbeat.update(start)
        return start

    def run(self, start: int, total_steps: int) -> ElasticSummary:
        """Train from ``start`` to ``total_steps`` and end the attempt; the job's summary."""
        parts, metrics = self.parts, self.trainer.metrics
        batches, steps, rollbacks = parts.batches, parts.steps, parts.rollbacks
        checkpointer, exits, feed = parts.checkpointer, parts.exits, parts.feed
        assert batches is not None and steps is not None and rollbacks is not None
        assert checkpointer is not None and feed is not None
        hooks = parts.hook_runner
        sections = self.trainer.sections
        log_every = self.trainer.config.observability.log_every
        feed.start(batches, rollbacks.bad, total_steps - start)
        step_times: list[float] = []
        loss_value: float | None = None
        handle = None
        step = start
        while step < total_steps:
            step += 1
            t0 = time.perf_counter()
            sections.step(step)
            if hooks is not None:
                with sections.user("hooks"):
                    hooks.poll()
            sections.enter("data")
            rollbacks.pass_known_bad(step, batches)
            batch = batches.take()
            loss_sum, grad_norm = steps.forward_backward(batch.micro, feed.fetch)
            lr = steps.learning_rate()
            loss_value, norm_value, preempt = steps.agree(loss_sum / len(batch.micro),
                                                          grad_norm, exits.sigterm)
            verdict = rollbacks.judge(step, loss_value, norm_value)
            if verdict is not None and not verdict.ok:
                sections.enter("restore")
                sections.restart()
                step = rollbacks.rollback(verdict, batch)
                parts.at_step(step)
                if parts.stragglers is not None:
                    parts.stragglers.restart_window()  # the undone steps are no window's
                feed.start(batches, rollbacks.bad, total_steps - step)  # the position jumped
                continue
            steps.update()
            parts.step = step
            if hooks is not None:
                with sections.user("hooks"):
                    hooks.step_done(step)
            handle = self._commit_step(step, loss_value, norm_value, batch,
                                       stop="preempted" if preempt else
                                       "finished" if step == total_steps else None)
            if hooks is not None:
                with sections.user("hooks"):
                    hooks.checkpoint_taken(step, handle)
            step_times.append(time.perf_counter() - t0)
            metrics.step_done(step=step, seconds=step_times[-1], loss=loss_value,
                              grad_norm=norm_value, learning_rate=lr)
            if log_every and (step % log_every == 0 or step == total_steps):
                self._log_step(step, step_times, loss_value, norm_value, lr)
            if parts.stragglers is not None:  # at a window's end: scores, maybe a drop
                parts.stragglers.step_done(step, handle)
            if preempt:
                sections.enter("finish")
                feed.stop()
                exits.preempted(step, handle, None if hooks is None else
                                lambda taken: hooks.preempted(step, taken))
        sections.enter("finish")
        feed.stop()
        if handle is None and start < total_steps:
            # the final state, whatever the schedule
            handle = checkpointer.save(total_steps, checkpointer.meta, force=True,
                                       stop="finished")
            parts.records.record("save", step=total_steps)
            if hooks is not None:
                hooks.checkpoint_taken(total_steps, handle)
        checkpointer.wait()
        if hooks is not None:
            hooks.poll()
        parts.records.record("done", step=max(start, parts.step), loss=loss_value)
        return self._finish(total_steps, step_times, loss_value)

    def _commit_step(self, step: int, loss: float, grad_norm: float, batch: StepBatch, *,
                     stop: str | None = None) -> Any:
        """``step`` is done: its metadata, audit and progress records, heartbeat, and the
        checkpoint when one is due (returns the manager's save handle, None if none). The
        attempt's last step (``stop``: "finished" or "preempted") is checkpointed to the
        root too, as a stop checkpoint."""
        parts = self.parts
        assert parts.checkpointer is not None
        parts.step = step
        meta = self._meta(step, loss)
        parts.records.audit(step, indices=batch.mine, micro=[len(m) for m in batch.micro])
        parts.records.record("step", step=step, loss=loss, grad_norm=json_float(grad_norm))
        if parts.heartbeat is not None:
            parts.heartbeat.update(step)
        sections = self.trainer.sections
        if parts.checkpointer.due(step):
            # the storage's time, judged against the save's deadline, not the step's
            sections.enter("save_wait")
            parts.checkpointer.wait_previous(step)
        sections.enter("save")
        handle = parts.checkpointer.save(step, meta, stop=stop)
        if handle is not None:
            parts.records.record("save", step=step)
        else:
            sections.discard()  # no save was due: not a save's duration
        return handle

    def _log_step(self, step: int, step_times: list[float], loss: float, grad_norm: float,
                  lr: float) -> None:
        """A ``train.step`` summary (rank 0), and the metrics textfile."""
        if self.parts.attempt.rank != 0:
            return
        metrics = self.trainer.metrics
        log_every = self.trainer.config.observability.log_every
        recent = step_times[-log_every:] if log_every else step_times[-1:]
        snap = metrics.snapshot()
        events.info(format_event(
            "train.step", step=step, loss=loss, grad_norm=grad_norm, lr=lr,
            step_s=sum(recent) / len(recent), world=self.parts.attempt.world_size,
            heartbeat_age_s=snap["heartbeat_age_seconds"],
            rollbacks=int(snap["rollbacks_total"]),
            skipped_batches=int(snap["skipped_batches_total"])))
        metrics.write_textfile()

    def _finish(self, total_steps: int, step_times: list[float],
                loss_value: float | None) -> ElasticSummary:
        """The job's summary (built by rank 0 from the run directory, shared with every
        rank), the done event, then the attempt's end: heartbeat, barrier, manager,
        records and process group."""
        trainer, parts = self.trainer, self.parts
        attempt, checkpointer, records = parts.attempt, parts.checkpointer, parts.records
        assert checkpointer is not None
        restarts = max(attempt.gather(restart_count()))
        summary = None
        if attempt.rank == 0:
            step_s = sorted(step_times)[len(step_times) // 2] if step_times else None
            summary = build_summary(trainer.run_dir, total_steps=total_steps,
                                    final_step=parts.step, restarts=restarts,
                                    final_loss=loss_value, step_s=step_s,
                                    fallback_world=attempt.world_size)
            if trainer.run_dir is not None:
                write_summary(trainer.run_dir, summary)
            log.info("%s", summary.format())
        summary = trainer.summary = ElasticSummary.from_dict(
            attempt.broadcast(summary.to_dict() if summary else None))
        snap = trainer.metrics.snapshot()
        events.info(format_event("train.done", rank=attempt.rank, step=parts.step,
                                 loss=loss_value, rollbacks=int(snap["rollbacks_total"]),
                                 skipped_batches=int(snap["skipped_batches_total"])))
        trainer.metrics.write_textfile()
        # Stop beating before anyone leaves: rank 0's process may host the store.
        if parts.heartbeat is not None:
            parts.heartbeat.stop(final_state="done")
        attempt.barrier()
        checkpointer.close()
        records.close()
        attempt.leave()
        return summary


__all__ = ["TrainingLoop"]
