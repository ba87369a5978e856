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

The trainer is composed of parts, each owning its state (docs/design.md, "Trainer parts"):
the attempt (:class:`trainer.launch.Attempt`: process group, rank, world, device), the run
records (:class:`trainer.records.RunRecords`), the exit policy
(:class:`trainer.exits.ExitPolicy`: lost peers, errors, SIGTERM), the batch stream
(:class:`trainer.batches.GlobalBatches`), the step (:class:`trainer.step.StepRunner`:
accumulation, clipping, scaler), the checkpointer
(:class:`trainer.checkpointing.TrainerCheckpointer`) and the health rollbacks
(:class:`trainer.rollback.Rollbacks`), held together by :class:`trainer.parts.AttemptParts`.
This module holds the trainer: its arguments and configuration (:mod:`trainer.config`), the
start of each attempt, and what the running trainer shows; :mod:`trainer.parts` builds the
parts, :mod:`trainer.loop` runs the loop and its end, and :mod:`trainer.progress` builds the
summary from the run directory.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import warnings
from typing import Any, Callable, Iterable

import torch
from torch.utils.data import Dataset, default_collate

from ckpt.tools import default_labels
from trainer.audit import AUDIT_DIR_ENV, next_audit_attempt, read_audit, read_skips
from trainer.config import LEGACY_KEYWORDS, ElasticConfig, config_from_keywords
from trainer.data import ResumableSampler
from trainer.exits import EXIT_PEER_LOST, EXIT_PREEMPTED, ExitPolicy
from trainer.health import HealthGuard, TrainingHealthError
from trainer.launch import (Attempt, check_world_size, expected_world_size,
                            process_start_time, restart_count, start_heartbeat,
                            valid_world_sizes, warm_imports, warm_start)
from trainer.loop import TrainingLoop
from trainer.metrics import TrainerMetrics, format_event
from trainer.parts import AttemptParts, build_parts, seed_everything
from trainer.progress import (RUN_DIR_ENV, ElasticSummary, Recovery, build_summary,
                              default_run_dir, next_attempt, read_jsonl)
from trainer.records import RunRecords
from trainer.sections import Sections
from trainer.stragglers import watch_for

log = logging.getLogger("trainer.elastic")
#: One ``event key=value ...`` line per event (docs/observability.md lists them).
events = logging.getLogger("ckpt.trainer")


class ElasticTrainer:
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
        config: everything else (:class:`trainer.config.ElasticConfig`: seed, data
            loading, device and FSDP, what checkpoints hold, failure detection, health,
            hooks, records and metrics); default: ``ElasticConfig()``.
        **deprecated: the former flat keywords (``heartbeat_timeout=``, ``probe=``,
            ``hooks=``, ...) still work, each with a DeprecationWarning naming its place in
            the config (they override ``config``); any other keyword is a TypeError.
    """

    def __init__(self, model_fn: Callable[[], torch.nn.Module],
                 optimizer_fn: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
                 dataset: Dataset, step_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                 *, checkpoint_root: str | os.PathLike, checkpoint_every: int,
                 global_batch_size: int, micro_batch_size: int,
                 scheduler_fn: Callable[[torch.optim.Optimizer], Any] | None = None,
                 config: ElasticConfig | None = None, **deprecated: Any) -> None:
        if not isinstance(checkpoint_every, int) or checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be a positive int, not {checkpoint_every!r}")
        self.config = config = config_from_keywords(config, deprecated)
        self.model_fn, self.optimizer_fn, self.step_fn = model_fn, optimizer_fn, step_fn
        self.scheduler_fn = scheduler_fn
        self.dataset = dataset
        self.checkpoint_root = checkpoint_root
        self.checkpoint_every = checkpoint_every
        self.global_batch_size = int(global_batch_size)
        self.micro_batch_size = int(micro_batch_size)
        self.collate_fn = config.data.collate_fn or default_collate
        audit_dir = config.observability.audit_dir
        self.audit_dir = audit_dir if audit_dir is not None else os.environ.get(AUDIT_DIR_ENV)
        self.run_dir = default_run_dir(config.observability.run_dir, checkpoint_root)
        self.diagnose_grace = 0.0  # seconds to wait for the heartbeat to name a lost peer
        self._process_start = process_start_time()
        self._created_at = time.time()
        # Fail at start, before any process group: on every rank, with the sizes that work.
        self._expected_world = expected_world_size()
        check_world_size(self.global_batch_size, self.micro_batch_size, self._expected_world)
        warm_imports()
        health = config.health
        self.health: HealthGuard | None = (HealthGuard() if health is True
                                           else health if isinstance(health, HealthGuard)
                                           else None)
        self.metrics = TrainerMetrics(labels=default_labels())
        #: Where the training thread is (progress markers, read by the heartbeat).
        self.sections = Sections()
        self.summary: ElasticSummary | None = None
        #: The parts of the attempt under way (None before the first fit).
        self._parts: AttemptParts | None = None
        self._skips_counted: set[int] = set()  # offsets of skipped batches in the metrics

    def __getattr__(self, name: str) -> Any:
        """The configuration's values under the former attribute names (``t.seed``,
        ``t.heartbeat_timeout``, ...), with a DeprecationWarning naming their place."""
        if name.startswith("__") or name not in LEGACY_KEYWORDS or "config" not in vars(self):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        section, field = LEGACY_KEYWORDS[name]
        warnings.warn(f"ElasticTrainer.{name} is deprecated and will be removed: read "
                      f"trainer.config.{field if section is None else f'{section}.{field}'}",
                      DeprecationWarning, stacklevel=2)
        owner = self.config if section is None else getattr(self.config, section)
        return getattr(owner, field)

    # -- what the running trainer shows ------------------------------------------------------
    @property
    def elastic(self) -> bool:
        """True when a torchrun agent runs this process (it will restart us)."""
        return "TORCHELASTIC_RUN_ID" in os.environ

    @property
    def step(self) -> int:
        """The last step finished (or restored) by this process."""
        return self._parts.step if self._parts else 0

    @property
    def preempted(self) -> bool:
        """True once this process received SIGTERM (a checkpoint follows this step)."""
        return self._parts is not None and self._parts.exits.sigterm

    @property
    def rank(self) -> int:
        """This process's rank (0 before :meth:`fit` joined the process group)."""
        return self._parts.attempt.rank if self._parts else 0

    @property
    def world_size(self) -> int:
        """The world size: of the process group once joined, else the one announced."""
        return self._parts.attempt.world_size if self._parts else self._expected_world

    @property
    def accumulation(self) -> int:
        """Micro batches per rank and step at this world size."""
        return (self._parts.attempt.accumulation if self._parts else
                check_world_size(self.global_batch_size, self.micro_batch_size,
                                 self._expected_world))

    @property
    def attempt(self) -> int:
        """This attempt's number in the run directory (0: the first)."""
        return self._parts.attempt.number if self._parts else 0

    @property
    def device(self) -> torch.device | None:
        return self._parts.attempt.device if self._parts else None

    @property
    def hard_exit(self) -> bool:
        """Whether a lost peer or failed collective ends the process (``FailureConfig``)."""
        return self.config.failure.exits_hard(elastic=self.elastic, world_size=self.world_size)

    @property
    def module(self) -> torch.nn.Module | None:
        """The model as built (unwrapped); None before fit."""
        return self._parts.module if self._parts else None

    @property
    def model(self) -> torch.nn.Module | None:
        """The model as trained (wrapped in DDP or sharded by FSDP2); None before fit."""
        steps = self._parts.steps if self._parts else None
        return steps.model if steps else None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        steps = self._parts.steps if self._parts else None
        return steps.optimizer if steps else None

    @property
    def scheduler(self) -> Any:
        steps = self._parts.steps if self._parts else None
        return steps.scheduler if steps else None

    @property
    def sampler(self) -> ResumableSampler | None:
        """The global sampler: the data position that checkpoints hold."""
        batches = self._parts.batches if self._parts else None
        return batches.sampler if batches else None

    @property
    def state(self) -> dict[str, Any] | None:
        """The checkpointed state (None before fit)."""
        checkpointer = self._parts.checkpointer if self._parts else None
        return checkpointer.state if checkpointer else None

    # -- the job -------------------------------------------------------------------------------
    def fit(self, total_steps: int) -> ElasticSummary:
        """Train until ``total_steps`` (resuming where the job's checkpoints left off).

        Returns the :class:`ElasticSummary` of the whole job (every attempt). Under torchrun
        a failure ends the process with :data:`EXIT_PEER_LOST` (torchrun restarts it) and
        SIGTERM ends it with :data:`EXIT_PREEMPTED` after a checkpoint.
        """
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps must be a positive int, not {total_steps!r}")
        parts, restart = self._begin_attempt()
        self._start_observing(restart)
        exits, failure = parts.exits, self.config.failure
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, exits.on_sigterm)
        try:
            self.sections.begin_attempt()  # on this thread: whose stack a hang shows
            parts.heartbeat = start_heartbeat(
                parts.attempt, failure.heartbeat_timeout, failure.heartbeat_interval,
                exits.peer_lost if self.hard_exit else None, sections=self.sections,
                hang_rule=failure.hang_rule())
            if parts.heartbeat is not None:
                exits.attach(heartbeat=parts.heartbeat)
                self.metrics.heartbeat = parts.heartbeat
            build_parts(self, parts)
            parts.stragglers = watch_for(self, parts)
            loop = TrainingLoop(self, parts, counted=self._skips_counted)
            start = loop.restore()
            return loop.run(start, total_steps)
        except SystemExit:
            raise
        except BaseException as e:
            if parts.feed is not None and not self.hard_exit:
                parts.feed.stop()  # the loader's workers, before a retry in this process
            exits.handle_error(e)  # exits the process, or returns for this to raise
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _begin_attempt(self) -> tuple[AttemptParts, int]:
        """Join the process group, number this attempt, open its records, record its start
        and set up its exit policy; returns the attempt's parts and torchrun's restart
        count."""
        failure = self.config.failure
        attempt = Attempt.join(self.config.step.device, failure.collective_timeout,
                               self.global_batch_size, self.micro_batch_size)
        # Numbered by the run directory; without one (an object-store root's default) by
        # the audit files, so that each attempt's audit records stay its own.
        attempt.number = attempt.broadcast(
            (next_attempt(self.run_dir) if self.run_dir is not None
             else next_audit_attempt(self.audit_dir)) if attempt.rank == 0 else None)
        records = RunRecords(self.run_dir, self.audit_dir, attempt=attempt.number,
                             rank=attempt.rank, world_size=attempt.world_size)
        exits = ExitPolicy(records, self.metrics, current_step=lambda: self.step,
                           hard_exit=failure.exits_hard(elastic=self.elastic,
                                                        world_size=attempt.world_size),
                           elastic=self.elastic,
                           collective_timeout=failure.collective_timeout,
                           diagnose_grace=self.diagnose_grace)
        parts = self._parts = AttemptParts(attempt, records, exits, step=self.step)
        restart = restart_count()
        records.record("start", attempt=attempt.number, world=attempt.world_size,
                       pid=os.getpid(), host=socket.gethostname(), restart_count=restart,
                       group_rank=os.environ.get("GROUP_RANK"),
                       process_start=self._process_start, created=self._created_at,
                       group_ready=attempt.group_ready_at, **warm_start())
        log.info("rank %d/%d: attempt %d (torchrun restart %d), %d accumulation steps of %d",
                 attempt.rank, attempt.world_size, attempt.number, restart,
                 attempt.accumulation, self.micro_batch_size)
        return parts, restart

    def _start_observing(self, restart: int) -> None:
        """Metrics export (rank 0), the start/restart events, a fresh health guard."""
        self.metrics.started(world_size=self.world_size, attempt=self.attempt,
                             restarts=restart)
        observability = self.config.observability
        if self.rank == 0:
            textfile = observability.metrics_textfile
            self.metrics.export(port=observability.metrics_port,
                                textfile=None if textfile is None else os.fspath(textfile),
                                addr=observability.metrics_addr)
        if self.health is not None:
            self.health.reset()
        fields = {"rank": self.rank, "world": self.world_size, "attempt": self.attempt,
                  "restart_count": restart, "accumulation": self.accumulation,
                  "micro_batch": self.micro_batch_size, "pid": os.getpid()}
        events.info(format_event("train.start", **fields))
        if self.attempt > 0:  # the worker group runs again: a failure, a membership change,
            events.warning(format_event("train.restart", **fields))  # or a rerun

    def close(self) -> None:
        """Stop the metrics HTTP server (it outlives :meth:`fit` so that the final values
        can still be scraped). The in-memory metrics stay."""
        self.metrics.close()


__all__ = ["EXIT_PEER_LOST", "EXIT_PREEMPTED", "RUN_DIR_ENV", "ElasticSummary",
           "ElasticTrainer", "Recovery", "TrainingHealthError", "build_summary",
           "check_world_size", "read_audit", "read_jsonl", "read_skips", "seed_everything",
           "valid_world_sizes"]
