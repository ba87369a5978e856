"""ElasticTrainer: a training loop that survives lost ranks and changes of world size.

torchrun (``torch.distributed.elastic``) is the engine: its agents restart the workers and
re-rendezvous at whatever world size is available. This module makes the *worker* side of
that contract hold:

- a failure is noticed within a bound (heartbeats in the c10d store, see
  :mod:`trainer.heartbeat`, and ``collective_timeout`` on every collective and store call),
  and the worker then exits with a non-zero code so that torchrun restarts the group;
- a restarted worker resumes from the newest good checkpoint, resharded to the new world;
- the global batch stays the same at every world size (gradient accumulation), and the data
  order is the one the job would have had without a failure (a global ``ResumableSampler``);
- SIGTERM (preemption, or torchrun restarting the workers because a node joined) is turned
  into a checkpoint of the current step that all ranks agree on, so it costs no steps.

What happened is written to a small run directory (one JSON-lines file per rank and attempt)
from which :meth:`ElasticTrainer.fit` derives an :class:`ElasticSummary`: world sizes,
restarts, steps lost and the recovery timeline. See docs/elastic.md.

Observability (docs/observability.md): metrics in ``trainer.metrics`` (exported with the
checkpoint metrics on ``metrics_port``/``metrics_textfile``), one-line events on the
``ckpt.trainer`` logger, and health guards (:mod:`trainer.health`) that roll back to the
newest good checkpoint and skip the batch when a step's loss or gradient goes bad.

This module holds the trainer's configuration, the training loop and its end; the rest of
its parts live in :mod:`trainer.launch` (process group, model, restore: an attempt's
setup), :mod:`trainer.step` (one step's gradients), :mod:`trainer.rollback` (health-guard
rollbacks), :mod:`trainer.exits` (lost peers, errors, SIGTERM), :mod:`trainer.progress`
(the run directory and the summary) and :mod:`trainer.audit` (the audit log).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, default_collate

import ckpt
from ckpt.metrics import default_labels
from trainer.audit import AUDIT_DIR_ENV, open_audit, read_audit, read_skips
from trainer.data import ResumableSampler
from trainer.exits import EXIT_PEER_LOST, EXIT_PREEMPTED, WorkerExits
from trainer.health import HealthGuard, TrainingHealthError
from trainer.heartbeat import Heartbeat
from trainer.launch import (AttemptSetup, check_world_size, expected_world_size,
                            process_start_time, restart_count, valid_world_sizes, warm_imports)
from trainer.metrics import TrainerMetrics, format_event
from trainer.progress import RUN_DIR_ENV  # noqa: F401 (importable from here, as before)
from trainer.progress import (ElasticSummary, JsonLines, Recovery, build_summary,
                              default_run_dir, json_float, next_attempt, open_progress,
                              read_jsonl, write_summary)
from trainer.rollback import HealthRollbacks
from trainer.step import StepMechanics

log = logging.getLogger("trainer.elastic")
#: One ``event key=value ...`` line per event (docs/observability.md lists them).
events = logging.getLogger("ckpt.trainer")

_RESERVED_OPTIONS = {"every_steps", "process_group", "handle_sigterm", "save_on_preemption"}


def _checked_options(checkpoint_every: int, log_every: int | None,
                     checkpoint_options: dict[str, Any] | None) -> dict[str, Any]:
    """Validate the schedule arguments; returns a copy of ``checkpoint_options``."""
    if not isinstance(checkpoint_every, int) or checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be a positive int, not {checkpoint_every!r}")
    if log_every is not None and (not isinstance(log_every, int) or log_every < 1):
        raise ValueError(f"log_every must be a positive int or None, not {log_every!r}")
    options = dict(checkpoint_options or {})
    reserved = _RESERVED_OPTIONS & options.keys()
    if reserved:
        raise TypeError(f"checkpoint_options may not set {sorted(reserved)}: the trainer "
                        "owns them (checkpoint_every, its process group, SIGTERM)")
    return options


# ------------------------------------------------------------------------------- the trainer


class ElasticTrainer(AttemptSetup, StepMechanics, HealthRollbacks, WorkerExits):
    """Data-parallel training that torchrun can shrink, grow and restart.

    Launch the script with torchrun (``--nnodes=MIN:MAX --max-restarts=N``, c10d
    rendezvous) or run it as a plain process (one rank, no process group).

    Args:
        model_fn: ``() -> nn.Module``; called with the same seed on every rank.
        optimizer_fn: ``(params) -> Optimizer``.
        dataset: a map-style dataset; samples are drawn by a :class:`ResumableSampler`.
        step_fn: ``(model, batch) -> loss`` for one micro batch (mean over its samples);
            the trainer runs ``backward`` (scaled for accumulation) and the optimizer step.
        checkpoint_root: where checkpoints go (any root ``ckpt.CheckpointManager`` takes).
        checkpoint_every: save every N steps (asynchronously).
        global_batch_size: samples per optimizer step, at every world size.
        micro_batch_size: samples per forward/backward; accumulation steps are
            ``global_batch_size / (micro_batch_size * world_size)``, which must be whole.
        scheduler_fn: ``(optimizer) -> LR scheduler``, stepped once per step.
        heartbeat_timeout: a rank silent this long is lost (None: no heartbeat).
        collective_timeout: timeout of the process group (every collective and store call)
            and of the checkpoint commit vote.
        checkpoint_options: more ``CheckpointManager`` keywords (``keep_last`` defaults to 3).
        seed: seeds the model init (same on every rank), the sampler's shuffle and each
            rank's dropout RNG.
        fsdp: shard the model with FSDP2 (``fully_shard``) instead of DDP; True shards
            each layer of every ``nn.ModuleList`` (transformer blocks) and then the root,
            or pass a callable ``(model, mesh) -> model`` to shard it your way.
            Checkpointed through ``ckpt.ModelOptimizer`` (as a plain single process too,
            unsharded, so such a run resumes an FSDP job's checkpoint and vice versa).
        collate_fn: ``(list of samples) -> batch`` (default ``default_collate``).
        max_grad_norm: clip the gradient norm before each step (None: no clipping).
        audit_dir: write each rank's sample indices per step to
            ``audit-a<attempt>-r<rank>.jsonl`` there (default: env ``CKPT_ELASTIC_AUDIT_DIR``).
        run_dir: the progress records the summary is built from (default: env
            ``CKPT_ELASTIC_RUN_DIR``, else ``<checkpoint_root>/.elastic`` for a local root).
        heartbeat_interval: seconds between heartbeats.
        hard_exit: on a lost peer or failed collective, exit the process (``os._exit``)
            with :data:`EXIT_PEER_LOST` instead of raising. Default: when run by torchrun or
            on more than one rank (the process group is unusable after such an error and
            a clean shutdown can hang); a plain single process raises.
        device: the device to train on (default: ``cuda:LOCAL_RANK`` when CUDA is
            available, else CPU).
        grad_scaler: a ``torch.amp.GradScaler`` for mixed precision: the loss is scaled
            for ``backward``, the gradients are unscaled (``scaler.unscale_``) before they
            are measured and clipped, and ``scaler.step``/``update`` replace
            ``optimizer.step``. Its state is checkpointed (item ``"scaler"``).
        health: the training-health guard: True (default) for a
            :class:`trainer.health.HealthGuard` with its defaults, a configured
            ``HealthGuard``, or False/None for none. On a bad step (a non-finite loss or
            gradient norm, or a loss spike) every rank rolls back to the newest good
            checkpoint, the offending global batch is skipped, and training continues;
            past the guard's ``max_rollbacks`` it raises
            :class:`trainer.health.TrainingHealthError`. With a guard, a fresh run saves
            step 0 first (something to roll back to before the first checkpoint).
        metrics_port, metrics_textfile: export ``trainer.metrics`` and the checkpoint
            manager's metrics through prometheus_client, on this HTTP port and/or to this
            node_exporter textfile. Rank 0 only (its values are the job's: the loss is
            the global mean). The in-memory values (``trainer.metrics.snapshot()``) exist
            on every rank. The HTTP server stays up until :meth:`close`.
        log_every: log a ``train.step`` summary line every N steps on rank 0 (and write
            the textfile); None: no step lines.
    """

    def __init__(self, model_fn: Callable[[], torch.nn.Module],
                 optimizer_fn: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
                 dataset: Dataset, step_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                 *, checkpoint_root: str | os.PathLike, checkpoint_every: int,
                 global_batch_size: int, micro_batch_size: int,
                 scheduler_fn: Callable[[torch.optim.Optimizer], Any] | None = None,
                 heartbeat_timeout: float | None = 30.0, collective_timeout: float = 60.0,
                 checkpoint_options: dict[str, Any] | None = None, seed: int = 0,
                 fsdp: bool | Callable[..., torch.nn.Module] = False,
                 collate_fn: Callable[[list[Any]], Any] | None = None,
                 max_grad_norm: float | None = None, audit_dir: str | os.PathLike | None = None,
                 run_dir: str | os.PathLike | None = None, heartbeat_interval: float = 1.0,
                 hard_exit: bool | None = None, device: str | torch.device | None = None,
                 grad_scaler: torch.amp.GradScaler | None = None,
                 health: HealthGuard | bool | None = True, metrics_port: int | None = None,
                 metrics_textfile: str | os.PathLike | None = None,
                 log_every: int | None = 10) -> None:
        options = _checked_options(checkpoint_every, log_every, checkpoint_options)
        self.model_fn, self.optimizer_fn, self.step_fn = model_fn, optimizer_fn, step_fn
        self.scheduler_fn = scheduler_fn
        self.dataset = dataset
        self.checkpoint_root = checkpoint_root
        self.checkpoint_every = checkpoint_every
        self.global_batch_size = int(global_batch_size)
        self.micro_batch_size = int(micro_batch_size)
        self.heartbeat_timeout = heartbeat_timeout
        self.heartbeat_interval = heartbeat_interval
        self.collective_timeout = float(collective_timeout)
        self.checkpoint_options = options
        self.seed = seed
        self.fsdp = fsdp
        self.collate_fn = collate_fn or default_collate
        self.max_grad_norm = max_grad_norm
        self.audit_dir = audit_dir if audit_dir is not None else os.environ.get(AUDIT_DIR_ENV)
        self.run_dir = default_run_dir(run_dir, checkpoint_root)
        self._device_arg = device
        self.diagnose_grace = 0.0  # seconds to wait for the heartbeat to name a lost peer
        self._hard_exit_arg = hard_exit
        self._process_start = process_start_time()
        self._created_at = time.time()
        if heartbeat_timeout is not None and heartbeat_timeout < 2 * heartbeat_interval:
            raise ValueError(f"heartbeat_timeout {heartbeat_timeout}s must be at least two "
                             f"heartbeat intervals ({2 * heartbeat_interval}s)")
        # Fail at start, before any process group: on every rank, with the sizes that work.
        self.world_size = expected_world_size()
        self.accumulation = check_world_size(self.global_batch_size, self.micro_batch_size,
                                             self.world_size)
        warm_imports()
        self.grad_scaler = grad_scaler
        self.health: HealthGuard | None = (HealthGuard() if health is True
                                           else health if isinstance(health, HealthGuard)
                                           else None)
        self.metrics_port = metrics_port
        self.metrics_textfile = None if metrics_textfile is None else os.fspath(metrics_textfile)
        self.log_every = log_every
        self.metrics = TrainerMetrics(labels=default_labels())
        self._init_runtime_state()

    def _init_runtime_state(self) -> None:
        self.rank = 0
        self.attempt = 0
        self.summary: ElasticSummary | None = None
        self._sigterm = False
        self._owns_group = False
        self._heartbeat: Heartbeat | None = None
        self._progress: JsonLines | None = None
        self._audit: JsonLines | None = None
        self._step = 0
        self._manager: ckpt.CheckpointManager | None = None
        self._skips: set[int] = set()      # data offsets of global batches to pass over
        self._skipped_batches = 0          # of them, those behind the current data position
        self._skips_counted: set[int] = set()  # of them, those this process passed over

    # -- configuration -------------------------------------------------------------------------
    @property
    def elastic(self) -> bool:
        """True when a torchrun agent runs this process (it will restart us)."""
        return "TORCHELASTIC_RUN_ID" in os.environ

    @property
    def step(self) -> int:
        """The last step finished (or restored) by this process."""
        return self._step

    @property
    def preempted(self) -> bool:
        """True once this process received SIGTERM (a checkpoint follows this step)."""
        return self._sigterm

    @property
    def hard_exit(self) -> bool:
        if self._hard_exit_arg is not None:
            return self._hard_exit_arg
        return self.elastic or self.world_size > 1

    # -- bookkeeping ---------------------------------------------------------------------------
    def _record(self, event: str, **fields: Any) -> None:
        if self._progress is not None:
            self._progress.write({"event": event, "time": time.time(), "rank": self.rank,
                                  **fields})

    def _audit_write(self, step: int, **fields: Any) -> None:
        if self._audit is not None:
            self._audit.write({"step": step, "attempt": self.attempt, "rank": self.rank,
                               "world": self.world_size, **fields})

    def _open_records(self) -> None:
        if self.run_dir is not None:
            self._progress = open_progress(self.run_dir, self.attempt, self.rank)
        if self.audit_dir:
            self._audit = open_audit(self.audit_dir, self.attempt, self.rank)

    def _close_records(self) -> None:
        for f in (self._progress, self._audit):
            if f is not None:
                f.close()

    # -- the job -------------------------------------------------------------------------------
    def fit(self, total_steps: int) -> ElasticSummary:
        """Train until ``total_steps`` (resuming where the job's checkpoints left off).

        Returns the :class:`ElasticSummary` of the whole job (every attempt). Under torchrun
        a failure ends the process with :data:`EXIT_PEER_LOST` (torchrun restarts it) and
        SIGTERM ends it with :data:`EXIT_PREEMPTED` after a checkpoint.
        """
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps must be a positive int, not {total_steps!r}")
        restart = self._begin_attempt()
        self._start_observing(restart)
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._start_heartbeat()
            self._build()
            start = self._restore()
            return self._train(start, total_steps)
        except SystemExit:
            raise
        except BaseException as e:
            self._handle_error(e)  # exits the process, or returns for this to raise
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _begin_attempt(self) -> int:
        """Join the process group, number this attempt, open its records and record its
        start; returns torchrun's restart count."""
        self._init_distributed()
        self._group_ready_at = time.time()
        self.attempt = self._broadcast(next_attempt(self.run_dir) if self.rank == 0 else None)
        self._open_records()
        restart = restart_count()
        self._record("start", attempt=self.attempt, world=self.world_size, pid=os.getpid(),
                     host=socket.gethostname(), restart_count=restart,
                     group_rank=os.environ.get("GROUP_RANK"),
                     process_start=self._process_start, created=self._created_at,
                     group_ready=self._group_ready_at)
        log.info("rank %d/%d: attempt %d (torchrun restart %d), %d accumulation steps of %d",
                 self.rank, self.world_size, self.attempt, restart, self.accumulation,
                 self.micro_batch_size)
        return restart

    def _start_observing(self, restart: int) -> None:
        """Metrics export (rank 0), the start/restart events, a fresh health guard."""
        self.metrics.started(world_size=self.world_size, attempt=self.attempt,
                             restarts=restart)
        if self.rank == 0:
            self.metrics.export(port=self.metrics_port, textfile=self.metrics_textfile)
        if self.health is not None:
            self.health.reset()
        fields = {"rank": self.rank, "world": self.world_size, "attempt": self.attempt,
                  "restart_count": restart, "accumulation": self.accumulation,
                  "micro_batch": self.micro_batch_size, "pid": os.getpid()}
        events.info(format_event("train.start", **fields))
        if self.attempt > 0:  # the worker group runs again: a failure, a membership change,
            events.warning(format_event("train.restart", **fields))  # or a rerun

    def _meta(self, step: int, loss: float | None) -> dict[str, Any]:
        return {"step": step, "attempt": self.attempt, "world": self.world_size, "loss": loss,
                "skipped_batches": self._skipped_batches}

    def _data_offset(self) -> int:
        """Position in the job's sample stream: samples drawn by all ranks, all epochs."""
        return self.sampler.epoch * self.sampler.num_samples + self.sampler.consumed

    # -- the training loop ---------------------------------------------------------------------
    def _train(self, start: int, total_steps: int) -> ElasticSummary:
        mgr = self._manager
        assert mgr is not None
        step_times: list[float] = []
        loss_value: float | None = None
        handle = None
        step = start
        while step < total_steps:
            step += 1
            t0 = time.perf_counter()
            self._skip_known_bad(step)
            offset = self._data_offset()
            global_indices = self.sampler.next_indices(self.global_batch_size)
            mine = ResumableSampler.rank_slice(global_indices, self.rank, self.world_size)
            micro = self._micro_batches(mine)
            loss_sum, grad_norm = self._forward_backward(micro)
            lr = float(self.optimizer.param_groups[0]["lr"])
            loss_value, norm_value, preempt = self._agree(loss_sum / len(micro), grad_norm)
            verdict = self._judge(step, loss_value, norm_value)
            if verdict is not None and not verdict.ok:
                step = self._rollback(verdict, offset, global_indices)
                continue
            self._optimizer_step()
            handle = self._commit_step(step, loss_value, norm_value, mine, micro)
            step_times.append(time.perf_counter() - t0)
            self.metrics.step_done(step=step, seconds=step_times[-1], loss=loss_value,
                                   grad_norm=norm_value, learning_rate=lr)
            if self.log_every and (step % self.log_every == 0 or step == total_steps):
                self._log_step(step, step_times, loss_value, norm_value, lr)
            if preempt:
                self._preempted(step, handle)
        if handle is None and start < total_steps:
            mgr.save(total_steps, self.state, force=True)  # the final state, whatever the schedule
            self._record("save", step=total_steps)
        mgr.wait()
        self._record("done", step=max(start, self._step), loss=loss_value)
        return self._finish(total_steps, step_times, loss_value)

    def _commit_step(self, step: int, loss: float, grad_norm: float, mine: list[int],
                     micro: list[list[int]]) -> Any:
        """``step`` is done: its metadata, audit and progress records, heartbeat, and the
        checkpoint when one is due (returns the manager's save handle, None if none)."""
        assert self._manager is not None
        self._step = step
        self.state["meta"] = self._meta(step, loss)
        self._audit_write(step, indices=mine, micro=[len(m) for m in micro])
        self._record("step", step=step, loss=loss, grad_norm=json_float(grad_norm))
        if self._heartbeat is not None:
            self._heartbeat.update(step)
        handle = self._manager.save(step, self.state)
        if handle is not None:
            self._record("save", step=step)
        return handle

    def _log_step(self, step: int, step_times: list[float], loss: float, grad_norm: float,
                  lr: float) -> None:
        """A ``train.step`` summary (rank 0), and the metrics textfile."""
        if self.rank != 0:
            return
        recent = step_times[-self.log_every:] if self.log_every else step_times[-1:]
        snap = self.metrics.snapshot()
        events.info(format_event(
            "train.step", step=step, loss=loss, grad_norm=grad_norm, lr=lr,
            step_s=sum(recent) / len(recent), world=self.world_size,
            heartbeat_age_s=snap["heartbeat_age_seconds"],
            rollbacks=int(snap["rollbacks_total"]),
            skipped_batches=int(snap["skipped_batches_total"])))
        self.metrics.write_textfile()

    # -- the end -------------------------------------------------------------------------------
    def _finish(self, total_steps: int, step_times: list[float],
                loss_value: float | None) -> ElasticSummary:
        restarts = max(self._gather(restart_count()))
        summary = None
        if self.rank == 0:
            step_s = sorted(step_times)[len(step_times) // 2] if step_times else None
            summary = build_summary(self.run_dir, total_steps=total_steps,
                                    final_step=self._step, restarts=restarts,
                                    final_loss=loss_value, step_s=step_s,
                                    fallback_world=self.world_size)
            if self.run_dir is not None:
                write_summary(self.run_dir, summary)
            log.info("%s", summary.format())
        summary = self._broadcast(summary.to_dict() if summary else None)
        self.summary = ElasticSummary.from_dict(summary)
        snap = self.metrics.snapshot()
        events.info(format_event("train.done", rank=self.rank, step=self._step,
                                 loss=loss_value, rollbacks=int(snap["rollbacks_total"]),
                                 skipped_batches=int(snap["skipped_batches_total"])))
        self.metrics.write_textfile()
        # Stop beating before anyone leaves: rank 0's process may host the store.
        if self._heartbeat is not None:
            self._heartbeat.stop(final_state="done")
        if self.distributed and self.world_size > 1:
            dist.barrier()
        assert self._manager is not None
        self._manager.close()
        self._close_records()
        if self._owns_group:
            dist.destroy_process_group()
            self._owns_group = False
        return self.summary

    def close(self) -> None:
        """Stop the metrics HTTP server (it outlives :meth:`fit` so that the final values
        can still be scraped). The in-memory metrics stay."""
        self.metrics.close()


__all__ = ["EXIT_PEER_LOST", "EXIT_PREEMPTED", "ElasticSummary", "ElasticTrainer", "Recovery",
           "TrainingHealthError", "build_summary", "check_world_size", "read_audit",
           "read_jsonl", "read_skips", "valid_world_sizes"]
