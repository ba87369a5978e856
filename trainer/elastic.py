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
accumulation, clipping, scaler), the checkpoints (:class:`trainer.checkpointing.Checkpoints`)
and the health rollbacks (:class:`trainer.rollback.Rollbacks`). This module holds the
configuration, wires the parts for each attempt and runs the loop and its end;
:mod:`trainer.progress` builds the summary from the run directory.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import threading
import time
from typing import Any, Callable, Iterable

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

try:
    import numpy as np
except ImportError:  # ckpt.RNGState holds NumPy's state only when NumPy is installed
    np = None

import ckpt
from ckpt._manager.metrics import default_labels
from trainer.audit import AUDIT_DIR_ENV, read_audit, read_skips
from trainer.batches import DatasetFeed, GlobalBatches, LoaderFeed, StepBatch
from trainer.checkpointing import (VERIFY_LEVELS, Checkpoints, checkpointed_items, make_probe,
                                   memory_tier_options)
from trainer.data import ResumableSampler
from trainer.exits import EXIT_PEER_LOST, EXIT_PREEMPTED, ExitPolicy
from trainer.health import HealthGuard, TrainingHealthError
from trainer.heartbeat import Heartbeat
from trainer.hooks import HookRunner, Hooks
from trainer.launch import (Attempt, check_world_size, expected_world_size,
                            process_start_time, restart_count, start_heartbeat,
                            valid_world_sizes, warm_imports, warm_start, wrap_model)
from trainer.metrics import TrainerMetrics, format_event
from trainer.progress import RUN_DIR_ENV  # noqa: F401 (importable from here, as before)
from trainer.progress import (ElasticSummary, Recovery, build_summary, default_run_dir,
                              json_float, next_attempt, read_jsonl, recorded_skips,
                              write_summary)
from trainer.records import RunRecords
from trainer.rollback import Rollbacks
from trainer.step import StepRunner

log = logging.getLogger("trainer.elastic")
#: One ``event key=value ...`` line per event (docs/observability.md lists them).
events = logging.getLogger("ckpt.trainer")

def seed_everything(seed: int) -> None:
    """Seed torch (every device), NumPy (when installed) and Python's ``random``."""
    torch.manual_seed(seed)
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2 ** 32)


_RESERVED_OPTIONS = {"every_steps", "process_group", "handle_sigterm", "save_on_preemption",
                     "probe", "memory_tier"}


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
                        "owns them (checkpoint_every, its process group, SIGTERM, probe=, "
                        "memory_tier=)")
    return options


# ------------------------------------------------------------------------------- the trainer


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
        heartbeat_timeout: a rank silent this long is lost (None: no heartbeat).
        collective_timeout: timeout of the process group (every collective and store call)
            and of the checkpoint commit vote.
        checkpoint_options: more ``CheckpointManager`` keywords (``keep_last`` defaults to 3),
            the memory tier's among them: ``persist_every`` (only every K-th save also goes
            to ``checkpoint_root``; default 1, every save; the final and preemption
            checkpoints always do), ``replicas`` (copies of each
            node's shards in other nodes' memory; default 1), ``memory_keep``,
            ``memory_budget``, ``memory_job`` (default: torchrun's run id and a hash of
            ``checkpoint_root``).
        memory_tier: keep every checkpoint in node-local shared memory (``/dev/shm``) too,
            and a copy in a peer node's, so that a restarted worker restores from RAM and
            survivors of a lost node from the peer copy before reading
            ``checkpoint_root`` (docs/memory-tier.md). None (default): on when
            torchrun runs the job and /dev/shm exists; True: on, also in a plain process;
            False: off. The run records say which tier each restore came from.
        seed: seeds the model init (same on every rank), the sampler's shuffle and each
            rank's random streams after it (torch, NumPy and Python's ``random``; their
            states are checkpointed with ``ckpt.RNGState``).
        fsdp: shard the model with FSDP2 (``fully_shard``) instead of DDP; True shards
            each layer of every ``nn.ModuleList`` (transformer blocks) and then the root,
            or pass a callable ``(model, mesh) -> model`` to shard it your way.
            Checkpointed through ``ckpt.ModelOptimizer`` (as a plain single process too,
            unsharded, so such a run resumes an FSDP job's checkpoint and vice versa).
        collate_fn: ``(list of samples) -> batch`` (default ``default_collate``), when
            the trainer reads the dataset itself (no ``data_loader``).
        data_loader: a DataLoader factory ``(batch_sampler) -> DataLoader``, to load with
            your own ``num_workers``, ``collate_fn``, ``pin_memory``, ...: return
            ``DataLoader(dataset, batch_sampler=batch_sampler, ...)``. The batch sampler
            yields this rank's micro batches in the trainer's order; the checkpointed
            position counts the batches the loop consumed, not those the workers fetched
            ahead, so a resume neither skips nor repeats a sample. Unless the loader has a
            ``generator``, it gets one seeded from ``seed``, the position and the rank, so
            creating it draws nothing from the global RNG.
        hooks: :class:`trainer.hooks.Hooks`: code to call after each step, every N steps
            (evaluation) and after each checkpoint.
        extra_state: ``(model) -> {name: item}``, called once per attempt with the built
            (unwrapped) model: more items saved with every checkpoint and restored before
            training resumes, e.g. ``{"ema": ema_model, "counter": counter}``. Objects
            with ``state_dict``/``load_state_dict`` and tensors are restored in place;
            plain values are replaced in :attr:`state`.
        probe: the ``ckpt.Probe`` recorded with every checkpoint, for the forward check of
            restores: True (default) runs the model on the first element of a fixed micro
            batch of the dataset (samples ``0..micro_batch_size-1``, collated with
            ``collate_fn``; dropped with a warning if the model refuses it); a callable
            ``batch -> model inputs`` picks them from that batch; or a ``ckpt.Probe``;
            False: none. Not recorded with ``fsdp``.
        verify: what a checkpoint must pass to be restored, on a resume and on a health
            rollback: ``"forward"`` (default: digests, then the probe rerun through the
            restored model must give finite outputs that agree with the recorded ones),
            ``"digest"`` or ``"structure"``. A step that fails is skipped for the one
            before it, so training never resumes from weights that went NaN before a save.
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
                 data_loader: Callable[[Sampler[list[int]]], DataLoader] | None = None,
                 hooks: Hooks | None = None,
                 extra_state: Callable[[torch.nn.Module], dict[str, Any]] | None = None,
                 probe: bool | Callable[[Any], Any] | ckpt.Probe | None = True,
                 verify: str = "forward",
                 max_grad_norm: float | None = None, audit_dir: str | os.PathLike | None = None,
                 run_dir: str | os.PathLike | None = None, heartbeat_interval: float = 1.0,
                 hard_exit: bool | None = None, device: str | torch.device | None = None,
                 grad_scaler: torch.amp.GradScaler | None = None,
                 health: HealthGuard | bool | None = True, metrics_port: int | None = None,
                 metrics_textfile: str | os.PathLike | None = None,
                 log_every: int | None = 10, memory_tier: bool | None = None) -> None:
        options = _checked_options(checkpoint_every, log_every, checkpoint_options)
        if memory_tier is not None and not isinstance(memory_tier, bool):
            raise TypeError(f"memory_tier must be True, False or None, not {memory_tier!r}")
        self.memory_tier = memory_tier
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
        if data_loader is not None and collate_fn is not None:
            raise TypeError("collate_fn is for the trainer's own reading of the dataset; with "
                            "data_loader, give it to your DataLoader")
        self.collate_fn = collate_fn or default_collate
        self.data_loader = data_loader
        self.hooks = hooks
        self.extra_state = extra_state
        if verify not in VERIFY_LEVELS:
            raise ValueError(f"verify must be one of {VERIFY_LEVELS}, not {verify!r}")
        self.probe, self.verify = probe, verify
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
        self._expected_world = expected_world_size()
        check_world_size(self.global_batch_size, self.micro_batch_size, self._expected_world)
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
        self.summary: ElasticSummary | None = None
        self._step = 0
        # The parts of the attempt under way (None before the first fit).
        self._attempt: Attempt | None = None
        self._records: RunRecords | None = None
        self._exits: ExitPolicy | None = None
        self._heartbeat: Heartbeat | None = None
        self._batches: GlobalBatches | None = None
        self._steps: StepRunner | None = None
        self._checkpoints: Checkpoints | None = None
        self._rollbacks: Rollbacks | None = None
        self._feed: DatasetFeed | LoaderFeed | None = None
        self._hook_runner: HookRunner | None = None
        self._skips_counted: set[int] = set()  # offsets of skipped batches in the metrics
        self.module: torch.nn.Module | None = None

    # -- configuration and the attempt's state -------------------------------------------------
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
        return self._exits is not None and self._exits.sigterm

    @property
    def rank(self) -> int:
        """This process's rank (0 before :meth:`fit` joined the process group)."""
        return self._attempt.rank if self._attempt else 0

    @property
    def world_size(self) -> int:
        """The world size: of the process group once joined, else the one announced."""
        return self._attempt.world_size if self._attempt else self._expected_world

    @property
    def accumulation(self) -> int:
        """Micro batches per rank and step at this world size."""
        return (self._attempt.accumulation if self._attempt else
                check_world_size(self.global_batch_size, self.micro_batch_size,
                                 self._expected_world))

    @property
    def attempt(self) -> int:
        """This attempt's number in the run directory (0: the first)."""
        return self._attempt.number if self._attempt else 0

    @property
    def device(self) -> torch.device | None:
        return self._attempt.device if self._attempt else None

    @property
    def hard_exit(self) -> bool:
        if self._hard_exit_arg is not None:
            return self._hard_exit_arg
        return self.elastic or self.world_size > 1

    @property
    def model(self) -> torch.nn.Module | None:
        """The model as trained (wrapped in DDP or sharded by FSDP2); None before fit."""
        return self._steps.model if self._steps else None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._steps.optimizer if self._steps else None

    @property
    def scheduler(self) -> Any:
        return self._steps.scheduler if self._steps else None

    @property
    def sampler(self) -> ResumableSampler | None:
        """The global sampler: the data position that checkpoints hold."""
        return self._batches.sampler if self._batches else None

    @property
    def state(self) -> dict[str, Any] | None:
        """The checkpointed state (None before fit)."""
        return self._checkpoints.state if self._checkpoints else None

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
        exits = self._exits
        assert exits is not None
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, exits.on_sigterm)
        try:
            self._heartbeat = start_heartbeat(
                self._attempt, self.heartbeat_timeout, self.heartbeat_interval,
                exits.peer_lost if self.hard_exit else None)
            if self._heartbeat is not None:
                exits.attach(heartbeat=self._heartbeat)
                self.metrics.heartbeat = self._heartbeat
            self._build()
            start = self._restore()
            return self._train(start, total_steps)
        except SystemExit:
            raise
        except BaseException as e:
            if self._feed is not None and not self.hard_exit:
                self._feed.stop()  # the loader's workers, before a retry in this process
            exits.handle_error(e)  # exits the process, or returns for this to raise
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _begin_attempt(self) -> int:
        """Join the process group, number this attempt, open its records, record its start
        and set up its exit policy; returns torchrun's restart count."""
        self._heartbeat = self._batches = self._steps = None
        self._checkpoints = self._rollbacks = self._feed = self._hook_runner = None
        attempt = self._attempt = Attempt.join(self._device_arg, self.collective_timeout,
                                               self.global_batch_size, self.micro_batch_size)
        attempt.number = attempt.broadcast(next_attempt(self.run_dir) if attempt.rank == 0
                                           else None)
        records = self._records = RunRecords(self.run_dir, self.audit_dir,
                                             attempt=attempt.number, rank=attempt.rank,
                                             world_size=attempt.world_size)
        self._exits = ExitPolicy(records, self.metrics, current_step=lambda: self._step,
                                 hard_exit=self.hard_exit, elastic=self.elastic,
                                 collective_timeout=self.collective_timeout,
                                 diagnose_grace=self.diagnose_grace)
        restart = restart_count()
        records.record("start", attempt=attempt.number, world=attempt.world_size,
                       pid=os.getpid(), host=socket.gethostname(), restart_count=restart,
                       group_rank=os.environ.get("GROUP_RANK"),
                       process_start=self._process_start, created=self._created_at,
                       group_ready=attempt.group_ready_at, **warm_start())
        log.info("rank %d/%d: attempt %d (torchrun restart %d), %d accumulation steps of %d",
                 attempt.rank, attempt.world_size, attempt.number, restart,
                 attempt.accumulation, self.micro_batch_size)
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

    def _build(self) -> None:
        """The model (same initial weights on every rank), wrapped; optimizer, scheduler,
        the batch stream, the step, and the checkpointed state with its manager."""
        attempt, records, exits = self._attempt, self._records, self._exits
        assert attempt is not None and records is not None and exits is not None
        t0 = time.time()
        seed_everything(self.seed)  # the same initial weights on every rank
        module = self.module = self.model_fn().to(attempt.device)
        t_model = time.time()
        model = wrap_model(module, attempt.device, self.fsdp, attempt.distributed,
                           attempt.world_size)
        optimizer = self.optimizer_fn(model.parameters())
        records.record("built", seconds=time.time() - attempt.group_ready_at,
                       model_s=t_model - t0, wrap_s=time.time() - t_model)
        scheduler = self.scheduler_fn(optimizer) if self.scheduler_fn else None
        sampler = ResumableSampler(len(self.dataset), seed=self.seed)
        extra = self.extra_state(module) if self.extra_state is not None else None
        seed_everything(self.seed + 1 + attempt.rank)  # dropout differs by rank
        self._batches = GlobalBatches(sampler, global_batch_size=self.global_batch_size,
                                      micro_batch_size=self.micro_batch_size,
                                      rank=attempt.rank, world_size=attempt.world_size)
        self._steps = StepRunner(attempt, model, optimizer, scheduler, self.grad_scaler,
                                 self.step_fn, max_grad_norm=self.max_grad_norm,
                                 fsdp=bool(self.fsdp))
        self._checkpoints = Checkpoints(
            self.checkpoint_root, every=self.checkpoint_every,
            items=checkpointed_items(sampler=sampler, module=module, model=model,
                                     optimizer=optimizer, scheduler=scheduler,
                                     grad_scaler=self.grad_scaler, fsdp=bool(self.fsdp),
                                     extra=extra),
            collective_timeout=self.collective_timeout,
            options={**memory_tier_options(self.memory_tier, root=self.checkpoint_root,
                                           elastic=self.elastic),
                     **self.checkpoint_options},
            probe=make_probe(self.probe, module, self._probe_batch, fsdp=bool(self.fsdp)),
            verify=self.verify)
        exits.attach(checkpoints=self._checkpoints)
        self.metrics.attach_checkpoint(self._checkpoints.manager.metrics)
        self._feed = (LoaderFeed(self.data_loader, self.seed) if self.data_loader is not None
                      else DatasetFeed(self.dataset, self.collate_fn))
        if self.hooks is not None:
            self._hook_runner = HookRunner(self.hooks, self, module)

    def _probe_batch(self) -> Any:
        """A fixed micro batch of the dataset: its first samples, collated."""
        n = min(self.micro_batch_size, len(self.dataset))
        return self.collate_fn([self.dataset[i] for i in range(n)])

    def _meta(self, step: int, loss: float | None) -> dict[str, Any]:
        skipped = self._rollbacks.skipped_batches if self._rollbacks else 0
        return {"step": step, "attempt": self.attempt, "world": self.world_size, "loss": loss,
                "skipped_batches": skipped}

    def _restore(self) -> int:
        """Load the newest checkpoint (a fresh run with a health guard saves step 0 instead)
        and the batches earlier rollbacks marked bad; returns the step to continue after."""
        attempt, checkpoints, batches = self._attempt, self._checkpoints, self._batches
        assert attempt is not None and checkpoints is not None and batches is not None
        assert self._records is not None and self._steps is not None
        t0 = time.time()
        restored = checkpoints.restore()
        start = restored or 0
        skipped = 0
        if restored is not None:
            meta = checkpoints.meta
            skipped = int(meta.get("skipped_batches", 0))
            if batches.offset() != (start + skipped) * self.global_batch_size:
                log.warning("rank %d: checkpoint step %d has %d samples consumed, expected "
                            "(%d + %d skipped) x %d: was it written with another global batch "
                            "size?", attempt.rank, start, batches.offset(), start, skipped,
                            self.global_batch_size)
            log.info("rank %d: resumed from step %d (written by attempt %s at world size %s) "
                     "in %.2fs", attempt.rank, start, meta.get("attempt"), meta.get("world"),
                     time.time() - t0)
        elif self.health is not None:
            # A rollback before the first scheduled checkpoint needs a step to go back to.
            checkpoints.save(0, self._meta(0, None), force=True)
        known = recorded_skips(self.run_dir, self.global_batch_size) if attempt.rank == 0 \
            else None
        self._rollbacks = Rollbacks(self.health, steps=self._steps, checkpoints=checkpoints,
                                    records=self._records, metrics=self.metrics,
                                    known_bad=attempt.broadcast(known),
                                    skipped_batches=skipped, counted=self._skips_counted)
        self._step = start
        source = checkpoints.restored_from() if restored is not None else {}
        self._records.record("restored", step=start, fresh=restored is None,
                             seconds=time.time() - t0, started=t0, **source)
        events.info(format_event("train.resume", rank=attempt.rank, step=start,
                                 fresh=restored is None, seconds=round(time.time() - t0, 3),
                                 known_bad_batches=len(self._rollbacks.bad), **source))
        if self._heartbeat is not None:
            self._heartbeat.update(start)
        return start

    # -- the training loop ---------------------------------------------------------------------
    def _train(self, start: int, total_steps: int) -> ElasticSummary:
        batches, steps, rollbacks = self._batches, self._steps, self._rollbacks
        checkpoints, exits, feed = self._checkpoints, self._exits, self._feed
        assert batches is not None and steps is not None and rollbacks is not None
        assert checkpoints is not None and exits is not None and self._records is not None
        assert feed is not None
        hooks = self._hook_runner
        feed.start(batches, rollbacks.bad, total_steps - start)
        step_times: list[float] = []
        loss_value: float | None = None
        handle = None
        step = start
        while step < total_steps:
            step += 1
            t0 = time.perf_counter()
            if hooks is not None:
                hooks.poll()
            rollbacks.pass_known_bad(step, batches)
            batch = batches.take()
            loss_sum, grad_norm = steps.forward_backward(batch.micro, feed.fetch)
            lr = steps.learning_rate()
            loss_value, norm_value, preempt = steps.agree(loss_sum / len(batch.micro),
                                                          grad_norm, exits.sigterm)
            verdict = rollbacks.judge(step, loss_value, norm_value)
            if verdict is not None and not verdict.ok:
                step = rollbacks.rollback(verdict, batch)
                self._step = step
                if self._heartbeat is not None:
                    self._heartbeat.update(step)
                feed.start(batches, rollbacks.bad, total_steps - step)  # the position jumped
                continue
            steps.update()
            self._step = step
            if hooks is not None:
                hooks.step_done(step)
            handle = self._commit_step(step, loss_value, norm_value, batch,
                                       last=preempt or step == total_steps)
            if hooks is not None:
                hooks.checkpoint_taken(step, handle)
            step_times.append(time.perf_counter() - t0)
            self.metrics.step_done(step=step, seconds=step_times[-1], loss=loss_value,
                                   grad_norm=norm_value, learning_rate=lr)
            if self.log_every and (step % self.log_every == 0 or step == total_steps):
                self._log_step(step, step_times, loss_value, norm_value, lr)
            if preempt:
                feed.stop()
                exits.preempted(step, handle, None if hooks is None else
                                lambda taken: hooks.preempted(step, taken))
        feed.stop()
        if handle is None and start < total_steps:
            # the final state, whatever the schedule
            handle = checkpoints.save(total_steps, checkpoints.meta, force=True)
            self._records.record("save", step=total_steps)
            if hooks is not None:
                hooks.checkpoint_taken(total_steps, handle)
        checkpoints.wait()
        if hooks is not None:
            hooks.poll()
        self._records.record("done", step=max(start, self._step), loss=loss_value)
        return self._finish(total_steps, step_times, loss_value)

    def _commit_step(self, step: int, loss: float, grad_norm: float, batch: StepBatch, *,
                     last: bool = False) -> Any:
        """``step`` is done: its metadata, audit and progress records, heartbeat, and the
        checkpoint when one is due (returns the manager's save handle, None if none). The
        ``last`` step (the final one, or preempted) is checkpointed to the root too."""
        assert self._checkpoints is not None and self._records is not None
        self._step = step
        meta = self._meta(step, loss)
        self._records.audit(step, indices=batch.mine, micro=[len(m) for m in batch.micro])
        self._records.record("step", step=step, loss=loss, grad_norm=json_float(grad_norm))
        if self._heartbeat is not None:
            self._heartbeat.update(step)
        handle = self._checkpoints.save(step, meta, persist=last)
        if handle is not None:
            self._records.record("save", step=step)
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
        attempt, checkpoints, records = self._attempt, self._checkpoints, self._records
        assert attempt is not None and checkpoints is not None and records is not None
        restarts = max(attempt.gather(restart_count()))
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
        summary = attempt.broadcast(summary.to_dict() if summary else None)
        self.summary = ElasticSummary.from_dict(summary)
        snap = self.metrics.snapshot()
        events.info(format_event("train.done", rank=self.rank, step=self._step,
                                 loss=loss_value, rollbacks=int(snap["rollbacks_total"]),
                                 skipped_batches=int(snap["skipped_batches_total"])))
        self.metrics.write_textfile()
        # Stop beating before anyone leaves: rank 0's process may host the store.
        if self._heartbeat is not None:
            self._heartbeat.stop(final_state="done")
        attempt.barrier()
        checkpoints.close()
        records.close()
        attempt.leave()
        return self.summary

    def close(self) -> None:
        """Stop the metrics HTTP server (it outlives :meth:`fit` so that the final values
        can still be scraped). The in-memory metrics stay."""
        self.metrics.close()


__all__ = ["EXIT_PEER_LOST", "EXIT_PREEMPTED", "ElasticSummary", "ElasticTrainer", "Recovery",
           "TrainingHealthError", "build_summary", "check_world_size", "read_audit",
           "read_jsonl", "read_skips", "valid_world_sizes"]
