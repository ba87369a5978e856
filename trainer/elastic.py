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
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, default_collate

import ckpt
from ckpt.metrics import default_labels
from trainer.data import ResumableSampler
from trainer.health import HealthGuard, TrainingHealthError, Verdict
from trainer.heartbeat import Heartbeat, PeerLoss
from trainer.metrics import TrainerMetrics, format_event

log = logging.getLogger("trainer.elastic")
#: One ``event key=value ...`` line per event (docs/observability.md lists them).
events = logging.getLogger("ckpt.trainer")

#: Exit status of a worker that gave up on its process group (a peer was lost, a collective
#: failed or timed out): any non-zero status makes torchrun restart the group.
EXIT_PEER_LOST = 75
#: Exit status after a checkpoint taken on SIGTERM (128 + SIGTERM).
EXIT_PREEMPTED = 128 + signal.SIGTERM

AUDIT_DIR_ENV = "CKPT_ELASTIC_AUDIT_DIR"
RUN_DIR_ENV = "CKPT_ELASTIC_RUN_DIR"

_RESERVED_OPTIONS = {"every_steps", "process_group", "handle_sigterm", "save_on_preemption"}


# ------------------------------------------------------------------------------- results


@dataclasses.dataclass
class Recovery:
    """One failure of the job and the way back (times are wall-clock seconds since the epoch).

    ``failed_at`` is an estimate: the last sign of life of the lost ranks (their last
    heartbeat change as seen by a survivor, or their last finished step).
    """

    attempt: int                 # the attempt that ended
    reason: str                  # "lost ranks", "preempted", "collective failed", ...
    lost_ranks: list[int]
    world_before: int
    world_after: int | None
    last_step: int               # the last step the ended attempt finished
    restored_step: int | None    # the step the next attempt resumed from
    steps_lost: int | None       # last_step - restored_step: steps trained twice
    failed_at: float | None
    detected_at: float | None
    restarted_at: float | None   # the first process of the next attempt started
    group_ready_at: float | None  # its process group formed (all ranks)
    built_at: float | None       # model, DDP/FSDP, optimizer, heartbeat built (all ranks)
    restored_at: float | None    # its checkpoint restored (all ranks)
    resumed_at: float | None     # its first step finished

    @staticmethod
    def _delta(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(b - a, 3)

    @property
    def detect_s(self) -> float | None:
        """Failure to detection."""
        return self._delta(self.failed_at, self.detected_at)

    @property
    def restart_s(self) -> float | None:
        """Detection to the next workers' start: exit, torchrun re-rendezvous, spawn."""
        return self._delta(self.detected_at, self.restarted_at)

    @property
    def init_s(self) -> float | None:
        """Worker start to process group formed (interpreter, imports, init_process_group)."""
        return self._delta(self.restarted_at, self.group_ready_at)

    @property
    def build_s(self) -> float | None:
        """Process group formed to model, DDP/FSDP and optimizer built."""
        return self._delta(self.group_ready_at, self.built_at)

    @property
    def restore_s(self) -> float | None:
        """Checkpoint manager opened (rank 0 takes the lock) and the checkpoint loaded."""
        return self._delta(self.built_at, self.restored_at)

    @property
    def first_step_s(self) -> float | None:
        return self._delta(self.restored_at, self.resumed_at)

    @property
    def resume_s(self) -> float | None:
        """Detection to the first step of the next attempt."""
        return self._delta(self.detected_at, self.resumed_at)

    @property
    def downtime_s(self) -> float | None:
        """Failure to the first step of the next attempt (no progress in between)."""
        return self._delta(self.failed_at if self.failed_at is not None else self.detected_at,
                           self.resumed_at)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for name in ("detect_s", "restart_s", "init_s", "build_s", "restore_s", "first_step_s",
                     "resume_s", "downtime_s"):
            d[name] = getattr(self, name)
        return d


@dataclasses.dataclass
class ElasticSummary:
    """What :meth:`ElasticTrainer.fit` did, across every restart of the job."""

    final_step: int
    total_steps: int
    world_sizes: list[int]           # one entry per attempt (a run of the worker group)
    attempts: int
    restarts: int                    # TORCHELASTIC_RESTART_COUNT now (max over agents)
    restores: list[int]              # the steps the attempts resumed from (0: fresh start)
    steps_lost: int                  # steps trained again after failures
    recoveries: list[Recovery]
    wall_s: float                    # first worker start to the end
    lost_s: float                    # downtime plus the time of the steps trained again
    step_s: float | None             # median time of one step (this attempt)
    final_loss: float | None
    run_dir: str | None = None
    rollbacks: int = 0               # health-guard rollbacks, all attempts
    skipped_batches: int = 0         # distinct global batches skipped by them

    @property
    def lost_fraction(self) -> float:
        return self.lost_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def detect_s(self) -> list[float | None]:
        return [r.detect_s for r in self.recoveries]

    @property
    def resume_s(self) -> list[float | None]:
        return [r.resume_s for r in self.recoveries]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["recoveries"] = [r.to_dict() for r in self.recoveries]
        d["lost_fraction"] = self.lost_fraction
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ElasticSummary":
        fields = {f.name for f in dataclasses.fields(Recovery)}
        rec = [Recovery(**{k: v for k, v in r.items() if k in fields}) for r in d["recoveries"]]
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in d.items() if k in names}, "recoveries": rec})

    def format(self) -> str:
        """A human-readable account: world sizes, restarts and each recovery's timeline."""
        def s(x: float | None) -> str:
            return "-" if x is None else f"{x:.2f}s"

        lines = [f"elastic run: step {self.final_step}/{self.total_steps}, world sizes "
                 f"{self.world_sizes}, {self.attempts} attempt(s), torchrun restarts "
                 f"{self.restarts}, resumed from {self.restores}, steps lost "
                 f"{self.steps_lost}, wall {self.wall_s:.1f}s, lost {self.lost_s:.1f}s "
                 f"({100 * self.lost_fraction:.1f}%)"
                 + (f", step {self.step_s * 1e3:.0f} ms" if self.step_s else "")
                 + (f", final loss {self.final_loss:.4f}" if self.final_loss is not None
                    else "")
                 + (f", {self.rollbacks} rollback(s), {self.skipped_batches} batch(es) "
                    "skipped" if self.rollbacks or self.skipped_batches else "")]
        for r in self.recoveries:
            lines.append(
                f"  attempt {r.attempt} ended ({r.reason}; lost ranks {r.lost_ranks}) at "
                f"step {r.last_step}, world {r.world_before} -> {r.world_after}, resumed "
                f"from step {r.restored_step}: {r.steps_lost} steps lost; detect "
                f"{s(r.detect_s)}, exit+rendezvous+spawn {s(r.restart_s)}, init "
                f"{s(r.init_s)}, build {s(r.build_s)}, restore {s(r.restore_s)}, first step "
                f"{s(r.first_step_s)}; detect->resume {s(r.resume_s)}, downtime {s(r.downtime_s)}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------- helpers


def valid_world_sizes(global_batch_size: int, micro_batch_size: int,
                      limit: int | None = None) -> list[int]:
    """World sizes at which ``global_batch_size`` splits into whole micro batches per rank."""
    if global_batch_size % micro_batch_size:
        return []
    micro_batches = global_batch_size // micro_batch_size
    top = micro_batches if limit is None else min(limit, micro_batches)
    return [w for w in range(1, top + 1) if micro_batches % w == 0]


def check_world_size(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Gradient accumulation steps at ``world_size``; ValueError naming the sizes that work."""
    if global_batch_size <= 0 or micro_batch_size <= 0:
        raise ValueError("global_batch_size and micro_batch_size must be positive")
    if global_batch_size % (micro_batch_size * world_size) == 0:
        return global_batch_size // (micro_batch_size * world_size)
    works = valid_world_sizes(global_batch_size, micro_batch_size)
    raise ValueError(
        f"global batch {global_batch_size} does not split into micro batches of "
        f"{micro_batch_size} over {world_size} ranks (global batch = micro batch x world "
        f"size x accumulation steps); world sizes that work: "
        f"{', '.join(map(str, works)) if works else 'none (micro batch does not divide it)'}"
        f". Start the job with a world size from that list (torchrun --nnodes=MIN:MAX with "
        f"node counts giving such sizes), or change the batch sizes")


def _process_start_time() -> float:
    """Wall time at which this process started (Linux: from /proc), else now."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


_DIST_ERROR_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "socket", "peer",
                     "store", "broken pipe", "process group", "c10d")


def _is_distributed_error(e: BaseException) -> bool:
    """Whether ``e`` says the process group broke (a peer died or hangs), not our code."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(w in text for w in _DIST_ERROR_WORDS)


def _warm_imports() -> None:
    """Import torch._dynamo in the background: DDP's constructor (and the first optimizer)
    import it, 1.6 s on a small CPU machine, which a restarted worker would pay after its
    process group formed. Started at construction, it overlaps init_process_group's wait
    for the peers."""
    import importlib

    def work() -> None:
        with contextlib.suppress(Exception):
            importlib.import_module("torch._dynamo")

    threading.Thread(target=work, name="ckpt-elastic-warm-imports", daemon=True).start()


def _to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


def _flush_streams() -> None:
    for h in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            h.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


class _JsonLines:
    """An append-only JSON-lines file, flushed per line (survives SIGKILL), thread safe."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = open(path, "a", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if not self._f.closed:
                self._f.write(line)
                self._f.flush()

    def close(self) -> None:
        with self._lock:
            self._f.close()


def _append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one record to a JSON-lines file (opened and closed for it: rare events)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, separators=(",", ":")) + "\n")


def _json_float(value: float | None) -> float | str | None:
    """A float for JSON: NaN and infinities as the strings "nan", "inf", "-inf"."""
    if value is None or math.isfinite(value):
        return value
    return str(float(value))


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of a JSON-lines file; a torn last line (the writer was killed) is skipped."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def read_audit(audit_dir: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """The audit log reduced to what counts: per step, the records of the newest attempt.

    A step trained again after a failure (it came after the checkpoint the job resumed
    from) appears in several attempts; the newest attempt's records are the ones whose
    state survived. Returns ``{step: {"attempt", "world", "ranks": {rank: indices},
    "micro": {rank: [sizes]}}}``. Batches skipped by the health guards are not in it (see
    :func:`read_skips`).
    """
    best: dict[int, dict[str, Any]] = {}
    for path in sorted(Path(audit_dir).glob("audit-*.jsonl")):
        for r in read_jsonl(path):
            if r.get("skipped"):
                continue
            step, attempt = r["step"], r["attempt"]
            cur = best.get(step)
            if cur is None or attempt > cur["attempt"]:
                cur = best[step] = {"attempt": attempt, "world": r["world"], "ranks": {},
                                    "micro": {}}
            if attempt == cur["attempt"]:
                cur["ranks"][r["rank"]] = r["indices"]
                cur["micro"][r["rank"]] = r["micro"]
    return dict(sorted(best.items()))


def read_skips(audit_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The audit log's records of skipped batches: ``{"step", "attempt", "rank", "world",
    "offset", "indices", "skipped": True}``, one per rank and skip, oldest first."""
    out = []
    for path in sorted(Path(audit_dir).glob("audit-*.jsonl")):
        out.extend(r for r in read_jsonl(path) if r.get("skipped"))
    return sorted(out, key=lambda r: (r["attempt"], r["step"], r["rank"]))


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
        if not isinstance(checkpoint_every, int) or checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be a positive int, not {checkpoint_every!r}")
        if log_every is not None and (not isinstance(log_every, int) or log_every < 1):
            raise ValueError(f"log_every must be a positive int or None, not {log_every!r}")
        options = dict(checkpoint_options or {})
        reserved = _RESERVED_OPTIONS & options.keys()
        if reserved:
            raise TypeError(f"checkpoint_options may not set {sorted(reserved)}: the trainer "
                            "owns them (checkpoint_every, its process group, SIGTERM)")
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
        self.run_dir = self._default_run_dir(run_dir)
        self._device_arg = device
        self.diagnose_grace = 0.0  # seconds to wait for the heartbeat to name a lost peer
        self._hard_exit_arg = hard_exit
        self._process_start = _process_start_time()
        self._created_at = time.time()
        if heartbeat_timeout is not None and heartbeat_timeout < 2 * heartbeat_interval:
            raise ValueError(f"heartbeat_timeout {heartbeat_timeout}s must be at least two "
                             f"heartbeat intervals ({2 * heartbeat_interval}s)")
        # Fail at start, before any process group: on every rank, with the sizes that work.
        self.world_size = self._expected_world_size()
        self.accumulation = check_world_size(self.global_batch_size, self.micro_batch_size,
                                             self.world_size)
        _warm_imports()
        self.rank = 0
        self.attempt = 0
        self.summary: ElasticSummary | None = None
        self._sigterm = False
        self._owns_group = False
        self._heartbeat: Heartbeat | None = None
        self._progress: _JsonLines | None = None
        self._audit: _JsonLines | None = None
        self._step = 0
        self._manager: ckpt.CheckpointManager | None = None
        self.grad_scaler = grad_scaler
        self.health: HealthGuard | None = (HealthGuard() if health is True
                                           else health if isinstance(health, HealthGuard)
                                           else None)
        self.metrics_port = metrics_port
        self.metrics_textfile = None if metrics_textfile is None else os.fspath(metrics_textfile)
        self.log_every = log_every
        self.metrics = TrainerMetrics(labels=default_labels())
        self._skips: set[int] = set()      # data offsets of global batches to pass over
        self._skipped_batches = 0          # of them, those behind the current data position
        self._skips_counted: set[int] = set()  # of them, those this process passed over

    # -- configuration -------------------------------------------------------------------------
    def _default_run_dir(self, run_dir: str | os.PathLike | None) -> Path | None:
        if run_dir is not None:
            return Path(run_dir)
        if os.environ.get(RUN_DIR_ENV):
            return Path(os.environ[RUN_DIR_ENV])
        root = os.fspath(self.checkpoint_root)
        if "://" in root and not root.startswith("file://"):
            return None  # an object-store root: no local bookkeeping unless run_dir is given
        return Path(root.removeprefix("file://")) / ".elastic"

    @staticmethod
    def _expected_world_size() -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return int(os.environ.get("WORLD_SIZE", "1"))

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

    # -- process group -------------------------------------------------------------------------
    def _init_distributed(self) -> None:
        if self._device_arg is not None:
            self.device = torch.device(self._device_arg)
        elif torch.cuda.is_available():
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        else:
            self.device = torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if dist.is_available() and dist.is_initialized():
            self._owns_group = False
        elif "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend, timeout=datetime.timedelta(seconds=self.collective_timeout),
                **({"device_id": self.device} if backend == "nccl" else {}))
            self._owns_group = True
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world_size = 0, 1
        self.accumulation = check_world_size(self.global_batch_size, self.micro_batch_size,
                                             self.world_size)

    def _broadcast(self, obj: Any) -> Any:
        if not self.distributed or self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _gather(self, obj: Any) -> list[Any]:
        if not self.distributed or self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    # -- bookkeeping ---------------------------------------------------------------------------
    def _next_attempt(self) -> int:
        if self.run_dir is None or not self.run_dir.is_dir():
            return 0
        numbers = [int(p.name.split("-")[1]) for p in self.run_dir.glob("attempt-*")
                   if p.name.split("-")[1].isdigit()]
        return max(numbers, default=-1) + 1

    def _record(self, event: str, **fields: Any) -> None:
        if self._progress is not None:
            self._progress.write({"event": event, "time": time.time(), "rank": self.rank,
                                  **fields})

    def _open_records(self) -> None:
        if self.run_dir is not None:
            self._progress = _JsonLines(
                self.run_dir / f"attempt-{self.attempt:04d}" / f"rank-{self.rank:05d}.jsonl")
        if self.audit_dir:
            self._audit = _JsonLines(Path(self.audit_dir) /
                                     f"audit-a{self.attempt:04d}-r{self.rank:05d}.jsonl")

    # -- failure handling ----------------------------------------------------------------------
    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._sigterm = True
        log.warning("rank %d: SIGTERM at step %d: checkpointing at the end of this step",
                    self.rank, self._step)

    def _peer_lost(self, loss: PeerLoss) -> None:
        """Heartbeat watchdog verdict (watchdog thread): record it and leave."""
        self._give_up(f"lost ranks ({loss.reason})", loss, None)

    def _give_up(self, reason: str, loss: PeerLoss | None, error: BaseException | None) -> None:
        lost = loss.lost if loss else []
        events.error(format_event(
            "train.detect", rank=self.rank, step=self._step, reason=reason, lost=lost,
            last_steps=[loss.last_steps.get(r) for r in lost] if loss else [],
            error=f"{type(error).__name__}: {error}".splitlines()[0][:200] if error else None,
            exit_status=EXIT_PEER_LOST))
        log.error("rank %d: giving up on the process group at step %d: %s%s; exiting with "
                  "status %d so torchrun restarts the workers", self.rank, self._step, reason,
                  f" - {loss.describe()}" if loss else " - no peer identified as lost",
                  EXIT_PEER_LOST)
        self._record("failure", step=self._step, reason=reason, lost=lost,
                      last_steps={str(k): v for k, v in (loss.last_steps if loss else {}).items()},
                      last_seen={str(k): v for k, v in (loss.last_seen if loss else {}).items()},
                      detail=(loss.detail if loss else "")
                      + (f" {type(error).__name__}: {error}"[:500] if error else ""))
        _flush_streams()
        os._exit(EXIT_PEER_LOST)

    # -- the job -------------------------------------------------------------------------------
    def fit(self, total_steps: int) -> ElasticSummary:
        """Train until ``total_steps`` (resuming where the job's checkpoints left off).

        Returns the :class:`ElasticSummary` of the whole job (every attempt). Under torchrun
        a failure ends the process with :data:`EXIT_PEER_LOST` (torchrun restarts it) and
        SIGTERM ends it with :data:`EXIT_PREEMPTED` after a checkpoint.
        """
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps must be a positive int, not {total_steps!r}")
        self._init_distributed()
        self._group_ready_at = time.time()
        self.attempt = self._broadcast(self._next_attempt() if self.rank == 0 else None)
        self._open_records()
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self._record("start", attempt=self.attempt, world=self.world_size, pid=os.getpid(),
                     host=socket.gethostname(), restart_count=restart,
                     group_rank=os.environ.get("GROUP_RANK"),
                     process_start=self._process_start, created=self._created_at,
                     group_ready=self._group_ready_at)
        log.info("rank %d/%d: attempt %d (torchrun restart %d), %d accumulation steps of %d",
                 self.rank, self.world_size, self.attempt, restart, self.accumulation,
                 self.micro_batch_size)
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
            reason = "unhealthy" if isinstance(e, TrainingHealthError) else "error"
            if not self.hard_exit or isinstance(e, KeyboardInterrupt) and not self.elastic:
                self._record("failure", step=self._step, reason=reason, lost=[],
                             detail=f"{type(e).__name__}: {e}"[:500])
                if self.world_size == 1:
                    self._release()  # the root's lock: a retry in this process can open it
                raise
            log.error("rank %d: step %d failed:\n%s", self.rank, self._step,
                      traceback.format_exc())
            if not _is_distributed_error(e):
                self._record("failure", step=self._step, reason=reason, lost=[],
                             detail=f"{type(e).__name__}: {e}"[:500])
                _flush_streams()
                os._exit(1)  # a bug, not a lost peer; torchrun still restarts (max-restarts)
            # Name a culprit only if the heartbeat already knows one: waiting for a peer to
            # miss beats would delay the restart by seconds. The summary later names the
            # ranks that left no record of their own (they died without a word).
            loss = None
            if self._heartbeat is not None:
                loss = self._heartbeat.diagnose(self.diagnose_grace)
            self._give_up("collective failed", loss, e)
            raise  # not reached
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _release(self) -> None:
        """After an error in a plain process: close the manager (finishing the save in
        flight, releasing the root's lock) and the record files; errors are ignored."""
        if self._manager is not None:
            with contextlib.suppress(Exception):
                self._manager.close()
        for f in (self._progress, self._audit):
            if f is not None:
                f.close()
        with contextlib.suppress(Exception):
            self.metrics.write_textfile()

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

    def _start_heartbeat(self) -> None:
        if not self.distributed or self.heartbeat_timeout is None or self.world_size == 1:
            return
        base = dist.distributed_c10d._get_default_store()
        try:
            store = base.clone()  # its own connection: no queueing behind ckpt's store waits
        except Exception:  # store types without clone (FileStore on old torch): share it
            store = base
        store = dist.PrefixStore(f"ckpt-elastic/a{self.attempt}/hb", store)
        self._heartbeat = Heartbeat(store, self.rank, self.world_size,
                                    timeout=self.heartbeat_timeout,
                                    interval=self.heartbeat_interval, on_lost=self._peer_lost
                                    if self.hard_exit else None).start()
        self.metrics.heartbeat = self._heartbeat

    def _build(self) -> None:
        t0 = time.time()
        torch.manual_seed(self.seed)  # the same initial weights on every rank
        model = self.model_fn().to(self.device)
        self.module = model
        t_model = time.time()
        if self.fsdp and self.distributed:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(self.device.type, (self.world_size,))
            if callable(self.fsdp):
                model = self.fsdp(model, mesh)
            else:  # each layer of every ModuleList (transformer blocks), then the rest
                for container in [m for m in model.modules()
                                  if isinstance(m, torch.nn.ModuleList)]:
                    for layer in container:
                        if any(p.requires_grad for p in layer.parameters()):
                            fully_shard(layer, mesh=mesh)
                fully_shard(model, mesh=mesh)
            self.model = model
        elif self.distributed and self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(model, device_ids=[self.device.index]
                             if self.device.type == "cuda" else None)
        else:
            self.model = model
        self.optimizer = self.optimizer_fn(self.model.parameters())
        self._record("built", seconds=time.time() - self._group_ready_at,
                     model_s=t_model - t0, wrap_s=time.time() - t_model)
        self.scheduler = self.scheduler_fn(self.optimizer) if self.scheduler_fn else None
        self.sampler = ResumableSampler(len(self.dataset), seed=self.seed)
        torch.manual_seed(self.seed + 1 + self.rank)  # dropout differs by rank
        self.state: dict[str, Any] = {"rng": ckpt.RNGState(), "data": self.sampler,
                                      "meta": {"step": 0}}
        if self.fsdp:
            self.state["train"] = ckpt.ModelOptimizer(self.model, self.optimizer)
        else:
            self.state["model"] = self.module
            self.state["optim"] = self.optimizer
        if self.scheduler is not None:
            self.state["sched"] = self.scheduler
        if self.grad_scaler is not None:
            self.state["scaler"] = self.grad_scaler
        options = {"keep_last": 3, "commit_timeout": self.collective_timeout,
                   **self.checkpoint_options}
        self._manager = ckpt.CheckpointManager(
            self.checkpoint_root, every_steps=self.checkpoint_every, handle_sigterm=False,
            save_on_preemption=False, **options)
        self.metrics.attach_checkpoint(self._manager.metrics)

    def _restore(self) -> int:
        assert self._manager is not None
        t0 = time.time()
        restored = self._manager.restore(self.state)
        start = restored or 0
        self._skipped_batches = 0
        if restored is not None:
            meta = self.state.get("meta") or {}
            self._skipped_batches = int(meta.get("skipped_batches", 0))
            if self._data_offset() != (start + self._skipped_batches) * self.global_batch_size:
                log.warning("rank %d: checkpoint step %d has %d samples consumed, expected "
                            "(%d + %d skipped) x %d: was it written with another global batch "
                            "size?", self.rank, start, self._data_offset(), start,
                            self._skipped_batches, self.global_batch_size)
            log.info("rank %d: resumed from step %d (written by attempt %s at world size %s) "
                     "in %.2fs", self.rank, start, meta.get("attempt"), meta.get("world"),
                     time.time() - t0)
        elif self.health is not None:
            # A rollback before the first scheduled checkpoint needs a step to go back to.
            self.state["meta"] = self._meta(0, None)
            self._manager.save(0, self.state, force=True)
        self._skips = set(self._broadcast(self._recorded_skips() if self.rank == 0 else None))
        self._step = start
        self._record("restored", step=start, fresh=restored is None, seconds=time.time() - t0)
        events.info(format_event("train.resume", rank=self.rank, step=start,
                                 fresh=restored is None, seconds=round(time.time() - t0, 3),
                                 known_bad_batches=len(self._skips)))
        if self._heartbeat is not None:
            self._heartbeat.update(start)
        return start

    def _meta(self, step: int, loss: float | None) -> dict[str, Any]:
        return {"step": step, "attempt": self.attempt, "world": self.world_size, "loss": loss,
                "skipped_batches": self._skipped_batches}

    def _data_offset(self) -> int:
        """Position in the job's sample stream: samples drawn by all ranks, all epochs."""
        return self.sampler.epoch * self.sampler.num_samples + self.sampler.consumed

    def _micro_batches(self, indices: list[int]) -> list[list[int]]:
        m = self.micro_batch_size
        return [indices[i:i + m] for i in range(0, len(indices), m)]

    def _sync_context(self, last: bool) -> Any:
        if self.fsdp and hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        if last or not hasattr(self.model, "no_sync"):
            return contextlib.nullcontext()
        return self.model.no_sync()

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
            # One small all-reduce per step, before the update: the global mean loss, whether
            # any rank got SIGTERM (so that all ranks take the preemption checkpoint at the
            # same step) and the gradient norm. Every rank judges the step's health from
            # these same agreed numbers, so all of them roll back, or none.
            agree = torch.stack([loss_sum / len(micro),
                                 torch.tensor(float(self._sigterm), device=self.device),
                                 grad_norm])
            if self.distributed and self.world_size > 1:
                dist.all_reduce(agree)
            loss_total, sigterms, norm_total = agree.tolist()
            loss_value = loss_total / self.world_size
            norm_value = norm_total / self.world_size  # the same on every rank: mean = it
            preempt = sigterms > 0
            verdict = self._judge(step, loss_value, norm_value)
            if verdict is not None and not verdict.ok:
                step = self._rollback(verdict, offset, global_indices)
                continue
            self._optimizer_step()
            self._step = step
            self.state["meta"] = self._meta(step, loss_value)
            if self._audit is not None:
                self._audit.write({"step": step, "attempt": self.attempt, "rank": self.rank,
                                   "world": self.world_size, "indices": mine,
                                   "micro": [len(m) for m in micro]})
            self._record("step", step=step, loss=loss_value, grad_norm=_json_float(norm_value))
            if self._heartbeat is not None:
                self._heartbeat.update(step)
            handle = mgr.save(step, self.state)
            if handle is not None:
                self._record("save", step=step)
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

    def _forward_backward(self, micro: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients of one step (accumulated over the micro batches, synchronized on the
        last); returns this rank's summed micro-batch losses and the total gradient norm
        (unscaled first with a GradScaler, measured before clipping, clipped if asked)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        scaler = self.grad_scaler
        total = torch.zeros((), device=self.device)
        for i, idx in enumerate(micro):
            batch = _to_device(self.collate_fn([self.dataset[j] for j in idx]), self.device)
            with self._sync_context(i == len(micro) - 1):
                loss = self.step_fn(self.model, batch)
                part = loss / len(micro)
                (scaler.scale(part) if scaler is not None else part).backward()
            total += loss.detach().float()
        if scaler is not None:
            scaler.unscale_(self.optimizer)  # measure and clip the true gradient
        params = list(self.model.parameters())
        if self.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        else:
            grads = [p.grad for p in params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if hasattr(norm, "full_tensor"):  # a DTensor (FSDP2): the global norm, on every rank
            norm = norm.full_tensor()
        return total, norm.detach().float().to(self.device)

    def _optimizer_step(self) -> None:
        if self.grad_scaler is not None:
            self.grad_scaler.step(self.optimizer)  # skipped when the gradient overflowed
            self.grad_scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

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
        fields = {"step": verdict.step, "reason": verdict.reason, "restored_step": restored,
                  "rollbacks": count, "max_rollbacks": self.health.max_rollbacks,
                  "skip_offset": offset, "skip_indices": global_indices}
        events.warning(format_event("train.rollback", rank=self.rank, **fields,
                                    seconds=round(time.time() - t0, 3)))
        self._record("rollback", **fields, loss=_json_float(verdict.loss),
                     grad_norm=_json_float(verdict.grad_norm),
                     global_batch=self.global_batch_size, seconds=time.time() - t0)
        if self.rank == 0 and self.run_dir is not None:
            _append_jsonl(self.run_dir / "skips.jsonl",
                          {"offset": offset, "global_batch": self.global_batch_size,
                           "step": verdict.step, "attempt": self.attempt,
                           "reason": verdict.reason, "indices": global_indices})
        self.metrics.write_textfile()
        return restored

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
            if self._audit is not None:
                self._audit.write({"step": step, "attempt": self.attempt, "rank": self.rank,
                                   "world": self.world_size, "offset": offset,
                                   "indices": mine, "skipped": True})

    def _recorded_skips(self) -> list[int]:
        """Data offsets of the batches earlier rollbacks of this job skipped (run_dir)."""
        path = None if self.run_dir is None else self.run_dir / "skips.jsonl"
        if path is None or not path.is_file():
            return []
        return sorted({int(r["offset"]) for r in read_jsonl(path)
                       if r.get("global_batch") == self.global_batch_size})

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

    def _preempted(self, step: int, handle: Any) -> None:
        """Every rank agreed that one of them got SIGTERM: checkpoint this step and leave."""
        mgr = self._manager
        assert mgr is not None
        if self._heartbeat is not None:
            self._heartbeat.stop(final_state="preempted")
        t0 = time.time()
        if handle is None:
            mgr.save(step, self.state, force=True)
        mgr.wait()
        log.warning("rank %d: preemption checkpoint of step %d committed in %.2fs; exiting "
                    "with status %d", self.rank, step, time.time() - t0, EXIT_PREEMPTED)
        self._record("preempted", step=step, signalled=self._sigterm, seconds=time.time() - t0)
        events.warning(format_event("train.preempted", rank=self.rank, step=step,
                                    signalled=self._sigterm, seconds=round(time.time() - t0, 3),
                                    exit_status=EXIT_PREEMPTED))
        self.metrics.write_textfile()
        # A rank whose agent has not signalled it yet waits a little for its SIGTERM: an exit
        # before it would count as a failure (a restart used up) instead of a membership change.
        deadline = time.time() + min(10.0, self.collective_timeout)
        while self.elastic and not self._sigterm and time.time() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(Exception):
            mgr.close()
        _flush_streams()
        if self.hard_exit:
            os._exit(EXIT_PREEMPTED)
        raise SystemExit(EXIT_PREEMPTED)

    def _finish(self, total_steps: int, step_times: list[float],
                loss_value: float | None) -> ElasticSummary:
        restarts = max(self._gather(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))))
        summary = None
        if self.rank == 0:
            step_s = sorted(step_times)[len(step_times) // 2] if step_times else None
            summary = build_summary(self.run_dir, total_steps=total_steps,
                                    final_step=self._step, restarts=restarts,
                                    final_loss=loss_value, step_s=step_s,
                                    fallback_world=self.world_size)
            if self.run_dir is not None:
                tmp = self.run_dir / "summary.json.tmp"
                tmp.write_text(json.dumps(summary.to_dict(), indent=1))
                os.replace(tmp, self.run_dir / "summary.json")
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
        for f in (self._progress, self._audit):
            if f is not None:
                f.close()
        if self._owns_group:
            dist.destroy_process_group()
            self._owns_group = False
        return self.summary

    def close(self) -> None:
        """Stop the metrics HTTP server (it outlives :meth:`fit` so that the final values
        can still be scraped). The in-memory metrics stay."""
        self.metrics.close()


# ------------------------------------------------------------------------------- the summary


def build_summary(run_dir: str | os.PathLike | None, *, total_steps: int, final_step: int,
                  restarts: int = 0, final_loss: float | None = None,
                  step_s: float | None = None, fallback_world: int = 1) -> ElasticSummary:
    """Read the run directory's records of every attempt and put the story together."""
    attempts: list[dict[str, Any]] = []
    if run_dir is not None and Path(run_dir).is_dir():
        for adir in sorted(Path(run_dir).glob("attempt-*")):
            records = [r for p in sorted(adir.glob("rank-*.jsonl")) for r in read_jsonl(p)]
            if records:
                attempts.append(_attempt_facts(int(adir.name.split("-")[1]), records))
    if not attempts:
        attempts = [{"attempt": 0, "world": fallback_world, "restored": 0, "last_step":
                     final_step, "start": time.time(), "end": time.time(), "failures": [],
                     "done": True}]
    recoveries = []
    for a, b in zip(attempts, attempts[1:]):
        recoveries.append(_recovery(a, b))
    steps_lost = sum(r.steps_lost or 0 for r in recoveries)
    rollbacks = sum(a.get("rollbacks", 0) for a in attempts)
    skipped = len(set().union(*(a.get("skipped_offsets", set()) for a in attempts)))
    start = min(a["start"] for a in attempts if a["start"] is not None)
    wall = time.time() - start
    step_time = step_s or 0.0
    lost = sum((r.downtime_s or 0.0) for r in recoveries) + steps_lost * step_time
    return ElasticSummary(
        final_step=final_step, total_steps=total_steps,
        world_sizes=[a["world"] for a in attempts], attempts=len(attempts), restarts=restarts,
        restores=[a["restored"] for a in attempts if a["restored"] is not None],
        steps_lost=steps_lost, recoveries=recoveries, wall_s=round(wall, 3),
        lost_s=round(lost, 3), step_s=step_s, final_loss=final_loss,
        run_dir=None if run_dir is None else os.fspath(run_dir), rollbacks=rollbacks,
        skipped_batches=skipped)


def _attempt_facts(number: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    by = {}
    for r in records:
        by.setdefault(r["event"], []).append(r)
    starts = by.get("start", [])
    restored = by.get("restored", [])
    steps = by.get("step", [])
    restored_step = restored[0]["step"] if restored else None
    first = [r["time"] for r in steps if restored_step is not None
             and r["step"] == restored_step + 1]

    def most_of_one_rank(event: str) -> int:  # every rank records rollbacks and skips
        return max(collections.Counter(r["rank"] for r in by.get(event, [])).values(),
                   default=0)

    return {
        "attempt": number,
        "world": starts[0]["world"] if starts else None,
        "start": min((r["process_start"] for r in starts), default=None),
        "group_ready": max((r["group_ready"] for r in starts), default=None),
        "restored": restored_step,
        "restored_at": max((r["time"] for r in restored), default=None),
        "resumed_at": max(first) if first else None,
        "last_step": max((r["step"] for r in steps), default=restored_step or 0),
        "last_step_times": {r["rank"]: r["time"] for r in steps},
        "failures": by.get("failure", []),
        "silent": sorted({r["rank"] for r in starts} - {r["rank"] for r in records if r["event"]
                                                        in ("failure", "preempted", "done")}),
        "built_at": max((r["time"] for r in by.get("built", [])), default=None),
        "preempted": by.get("preempted", []),
        "done": bool(by.get("done")),
        "end": max((r["time"] for r in records), default=None),
        "rollbacks": most_of_one_rank("rollback"),
        "skipped_offsets": {r["offset"] for r in by.get("skip", [])},
    }


def _recovery(a: dict[str, Any], b: dict[str, Any]) -> Recovery:
    failures, preempted = a["failures"], a["preempted"]
    # Lost: named by a survivor's heartbeat, or silent (started, then left no final record:
    # killed, or stopped and killed by its agent).
    # (A rank named by a peer that then recorded its own exit was alive: not lost.)
    spoke = {f["rank"] for f in failures} | {p["rank"] for p in preempted}
    lost = sorted(({r for f in failures for r in f.get("lost", [])} - spoke)
                  | set(a["silent"]))
    if failures:
        reasons = sorted({f["reason"] for f in failures})
        reason = ", ".join(reasons)
        detected = min(f["time"] for f in failures)
        # The failure came after the lost ranks' last sign of life: their last step record
        # or the last change of their heartbeat that a survivor saw (the latest is tightest).
        signs = [v for f in failures for k, v in f.get("last_seen", {}).items()
                 if int(k) in lost and v is not None]
        signs += [a["last_step_times"][r] for r in lost if r in a["last_step_times"]]
        failed = min(max(signs), detected) if signs else None
    elif preempted:
        reason = "SIGTERM (preemption, or torchrun restarting the group for a new node)"
        detected = failed = min(p["time"] for p in preempted)
    elif a["done"]:
        reason, detected, failed = "finished (the job was started again for more steps)", None, None
    else:
        reason, detected, failed = "unknown (no survivor recorded it)", None, None
    restored = b["restored"]
    lost_steps = None if restored is None else max(0, a["last_step"] - restored)
    if a["done"] and not failures:
        b = {**b, "start": None}  # not a recovery: no downtime to count
    return Recovery(attempt=a["attempt"], reason=reason, lost_ranks=lost,
                    world_before=a["world"], world_after=b["world"], last_step=a["last_step"],
                    restored_step=restored, steps_lost=lost_steps, failed_at=failed,
                    detected_at=detected, restarted_at=b["start"],
                    group_ready_at=b["group_ready"], built_at=b["built_at"],
                    restored_at=b["restored_at"],
                    resumed_at=b["resumed_at"])


__all__ = ["EXIT_PEER_LOST", "EXIT_PREEMPTED", "ElasticSummary", "ElasticTrainer", "Recovery",
           "TrainingHealthError", "build_summary", "check_world_size", "read_audit",
           "read_jsonl", "read_skips", "valid_world_sizes"]
