"""How an :class:`trainer.elastic.ElasticTrainer` trains, apart from what it trains.

The trainer takes the model, optimizer, data, step function and checkpoint root as
arguments and everything else as one :class:`ElasticConfig`: small frozen sections, one per
concern, each validated when it is built (so a mistake fails before any process group):

- :class:`DataConfig`: how the dataset is read (collate function or DataLoader factory);
- :class:`StepConfig`: how a step runs (device, FSDP, mixed precision, clipping);
- :class:`CheckpointConfig`: what checkpoints hold, which tiers they go to, and what a
  restore must pass;
- :class:`FailureConfig`: how fast a lost peer or a hung collective is noticed, and how the
  worker leaves then;
- :class:`ObservabilityConfig`: run records, audit files, metrics and step lines.

The seed, the health guard and the hooks sit on :class:`ElasticConfig` itself.
:func:`config_from_keywords` maps the trainer's former flat keywords onto these sections,
with a DeprecationWarning naming each one's new spelling.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

import ckpt
from trainer.checkpointing import DEFAULT_VERIFIED_WINDOW, VERIFY_LEVELS, incremental_saves
from trainer.hangs import HangRule
from trainer.health import HealthGuard
from trainer.hooks import Hooks

#: ``CheckpointManager`` keywords the trainer sets itself.
RESERVED_MANAGER_OPTIONS = frozenset({"every_steps", "schedule", "process_group",
                                      "handle_sigterm", "save_on_preemption", "probe",
                                      "memory_tier"})


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """How the trainer reads the dataset.

    Args:
        collate_fn: ``(list of samples) -> batch`` (default ``default_collate``), when the
            trainer reads the dataset itself (no ``data_loader``).
        data_loader: a DataLoader factory ``(batch_sampler) -> DataLoader``, to load with
            your own ``num_workers``, ``collate_fn``, ``pin_memory``, ...: return
            ``DataLoader(dataset, batch_sampler=batch_sampler, ...)``. The batch sampler
            yields this rank's micro batches in the trainer's order; the checkpointed
            position counts the batches the loop consumed, not those the workers fetched
            ahead, so a resume neither skips nor repeats a sample. Unless the loader has a
            ``generator``, it gets one seeded from the seed, the position and the rank, so
            creating it draws nothing from the global RNG.
    """

    collate_fn: Callable[[list[Any]], Any] | None = None
    data_loader: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        if self.data_loader is not None and self.collate_fn is not None:
            raise TypeError("collate_fn is for the trainer's own reading of the dataset; with "
                            "data_loader, give it to your DataLoader")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Where and how each step runs.

    Args:
        device: the device to train on (default: ``cuda:LOCAL_RANK`` when CUDA is
            available, else CPU).
        fsdp: shard the model with FSDP2 (``fully_shard``) instead of DDP; True shards
            each layer of every ``nn.ModuleList`` (transformer blocks) and then the root,
            or pass a callable ``(model, mesh) -> model`` to shard it your way.
            Checkpointed through ``ckpt.ModelOptimizer`` (as a plain single process too,
            unsharded, so such a run resumes an FSDP job's checkpoint and vice versa).
        grad_scaler: a ``torch.amp.GradScaler`` for mixed precision: the loss is scaled
            for ``backward``, the gradients are unscaled before they are measured and
            clipped, and ``scaler.step``/``update`` replace ``optimizer.step``. Its state
            is checkpointed (item ``"scaler"``).
        max_grad_norm: clip the gradient norm before each step (None: no clipping).
    """

    device: str | torch.device | None = None
    fsdp: bool | Callable[..., torch.nn.Module] = False
    grad_scaler: torch.amp.GradScaler | None = None
    max_grad_norm: float | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """What the trainer's checkpoints hold, where they go, and what a restore must pass.
    (How often: the trainer's ``checkpoint_every``.)

    Args:
        manager_options: more ``CheckpointManager`` keywords (``keep_last`` defaults to
            3; ``options=ckpt.SaveOptions(...)``, whose ``commit_timeout`` defaults to the
            failure config's ``collective_timeout`` here; ``retention=``, ...). The trainer
            sets the schedule, process group, SIGTERM handling, probe and memory tier
            itself (TypeError if given here).
        memory_tier: keep every checkpoint in node-local shared memory (``/dev/shm``) too,
            and a copy in a peer node's, so that a restarted worker restores from RAM and
            survivors of a lost node from the peer copy before reading the root
            (docs/memory-tier.md). None (default): on when torchrun runs the job and
            /dev/shm exists, unless ``manager_options`` ask for incremental saves (which
            the tier cannot hold: it stays off, and the log says why); True: on, also in a
            plain process (ValueError with incremental saves); False: off. The run records
            say which tier each restore came from.
        memory_options: how the memory tier works when it is on (``ckpt.MemoryTierOptions``:
            ``persist_every``, only every K-th save also goes to the root, the final and
            preemption checkpoints always do; ``replicas``, copies of each node's shards in
            other nodes' memory; ``keep``, ``budget``, ``shm_dir``, ``node``; ``job``,
            default: torchrun's run id and a hash of the root). Default: its defaults.
        probe: the ``ckpt.Probe`` recorded with every checkpoint, for the forward check of
            restores: True (default) runs the model on the first element of a fixed micro
            batch of the dataset (its first samples, collated; dropped with a warning if
            the model refuses it); a callable ``batch -> model inputs`` picks them from
            that batch; or a ``ckpt.Probe``; False: none. Not recorded with FSDP.
        verify: what a checkpoint must pass to be restored, on a resume and on a health
            rollback: ``"forward"`` (default: digests, then the probe rerun through the
            restored model must give finite outputs that agree with the recorded ones),
            ``"digest"`` or ``"structure"``. A step that fails is skipped for the one
            before it, so training never resumes from weights that went NaN before a save.
        extra_state: ``(model) -> {name: item}``, called once per attempt with the built
            (unwrapped) model: more items saved with every checkpoint and restored before
            training resumes, e.g. ``{"ema": ema_model, "counter": counter}``. Objects
            with ``state_dict``/``load_state_dict`` and tensors are restored in place;
            plain values are replaced in the trainer's ``state``.
        verified_window: with a health guard (``ElasticConfig.health``, on by default), a
            checkpoint becomes *verified* once this many steps after it were judged
            healthy (finite loss and gradient norm, no loss spike, the norm within the
            guard's ``grad_norm_limit``); rank 0 marks it in the root, and resumes and
            health rollbacks restore the newest verified step first
            (``restore(prefer="verified")``), retention always keeps it, ``ckpt ls`` shows
            it. A checkpoint with a bad step inside its window is never verified.
            Default :data:`DEFAULT_VERIFIED_WINDOW` (4 steps): more than 2, so that a NaN
            or spike two steps after a save (corrupted weights that take a step or two to
            show) keeps that save out of recovery with a step of margin, and small, since
            a crash inside the newest save's window resumes from the verified save before
            it: up to ``verified_window + checkpoint_every`` steps recomputed instead of
            up to ``checkpoint_every`` (on average about ``verified_window`` steps more
            per crash). The checkpoints the trainer takes to stop (the final one of a run,
            a preemption, a straggler drop) have no steps after them: the next attempt
            resumes from them all the same, and they wait for their window there (a
            rollback before then goes to the verified save before them). None: no
            marking; restores take the newest good step.
            Without a health guard (``health=None``/``False``) there are no verdicts, so
            no window either, whatever this says (no error): restores take the newest
            good step (docs/observability.md, "Verified checkpoints").
    """

    manager_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    memory_tier: bool | None = None
    memory_options: ckpt.MemoryTierOptions | None = None
    probe: bool | Callable[[Any], Any] | ckpt.Probe | None = True
    verify: str = "forward"
    extra_state: Callable[[torch.nn.Module], dict[str, Any]] | None = None
    verified_window: int | None = DEFAULT_VERIFIED_WINDOW

    def __post_init__(self) -> None:
        window = self.verified_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or window < 1):
            raise ValueError(f"verified_window must be a positive int or None, not "
                             f"{window!r}")
        options = dict(self.manager_options or {})
        reserved = RESERVED_MANAGER_OPTIONS & options.keys()
        if reserved:
            raise TypeError(f"checkpoint manager options may not set {sorted(reserved)}: "
                            "the trainer owns them (checkpoint_every, its process group, "
                            "SIGTERM, probe=, memory_tier= and memory_options=)")
        object.__setattr__(self, "manager_options", options)
        if self.memory_tier is not None and not isinstance(self.memory_tier, bool):
            raise TypeError(f"memory_tier must be True, False or None, not "
                            f"{self.memory_tier!r}")
        if self.memory_tier is True and incremental_saves(options):
            raise ValueError("CheckpointConfig(memory_tier=True) cannot be combined with "
                             "incremental saves in manager_options (incremental=True): the "
                             "memory tier holds whole steps, an incremental step references "
                             "its base step's files in the root; drop one of them")
        if self.memory_options is not None and not isinstance(self.memory_options,
                                                              ckpt.MemoryTierOptions):
            raise TypeError(f"memory_options must be a ckpt.MemoryTierOptions, not "
                            f"{type(self.memory_options).__name__}")
        if self.verify not in VERIFY_LEVELS:
            raise ValueError(f"verify must be one of {VERIFY_LEVELS}, not {self.verify!r}")


@dataclasses.dataclass(frozen=True)
class FailureConfig:
    """How fast a failure is noticed, and how the worker leaves then.

    Args:
        heartbeat_timeout: a rank silent this long is lost (None: no heartbeat).
        heartbeat_interval: seconds between heartbeats.
        collective_timeout: timeout of the process group (every collective and store call)
            and of the checkpoint commit vote.
        hard_exit: on a lost peer or failed collective, exit the process (``os._exit``)
            with ``EXIT_PEER_LOST`` instead of raising. Default: when run by torchrun or on
            more than one rank (the process group is unusable after such an error and a
            clean shutdown can hang); a plain single process raises.
        hang_factor: a rank whose training thread stays in one section (data, forward,
            backward, collective N, optimizer, save) longer than this many times
            the section's typical duration in the run (never less than as many typical
            steps) while the others wait for it is hung: named with its section and stack,
            and dropped (docs/elastic.md, "When a rank hangs or slows down"). None: off
            (a hang is then found by the collective timeout). Needs the heartbeat.
        hang_floor, hang_ceiling: bounds in seconds of that limit (default ceiling: half
            the collective timeout, so that the hang is named before the collectives time
            out). A section is never judged before it was seen twice, nor below 1.5 times
            the longest it took.
    """

    heartbeat_timeout: float | None = 30.0
    heartbeat_interval: float = 1.0
    collective_timeout: float = 60.0
    hard_exit: bool | None = None
    hang_factor: float | None = 3.0
    hang_floor: float = 10.0
    hang_ceiling: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "collective_timeout", float(self.collective_timeout))
        timeout, interval = self.heartbeat_timeout, self.heartbeat_interval
        if timeout is not None and timeout < 2 * interval:
            raise ValueError(f"heartbeat_timeout {timeout}s must be at least two "
                             f"heartbeat intervals ({2 * interval}s)")
        self.hang_rule()  # refuses impossible bounds now, not at the first step

    def hang_rule(self) -> HangRule | None:
        """The hang detector's rule (None when ``hang_factor`` is None)."""
        if self.hang_factor is None:
            return None
        ceiling = (max(self.collective_timeout / 2, self.hang_floor)
                   if self.hang_ceiling is None else self.hang_ceiling)
        return HangRule(factor=float(self.hang_factor), floor=float(self.hang_floor),
                        ceiling=float(ceiling))

    def exits_hard(self, *, elastic: bool, world_size: int) -> bool:
        """Whether a lost peer or failed collective ends the process: ``hard_exit`` if
        set, else under torchrun or on more than one rank."""
        if self.hard_exit is not None:
            return self.hard_exit
        return elastic or world_size > 1


@dataclasses.dataclass(frozen=True)
class ObservabilityConfig:
    """Where the trainer writes down what it does (docs/observability.md).

    Args:
        run_dir: the progress records the summary is built from (default: env
            ``CKPT_ELASTIC_RUN_DIR``, else ``<checkpoint_root>/.elastic`` for a local root).
        audit_dir: write each rank's sample indices per step to
            ``audit-a<attempt>-r<rank>.jsonl`` there (default: env ``CKPT_ELASTIC_AUDIT_DIR``).
        metrics_port, metrics_textfile: export ``trainer.metrics`` and the checkpoint
            manager's metrics through prometheus_client, on this HTTP port and/or to this
            node_exporter textfile. Rank 0 only (its values are the job's: the loss is the
            global mean). The HTTP server stays up until the trainer's ``close()``.
        metrics_addr: the address ``metrics_port`` listens on: all interfaces by default,
            as Prometheus exporters do; give the address your scraper reaches the node at
            (or ``127.0.0.1`` for a scraper on the node) to keep the port off the others.
        log_every: log a ``train.step`` summary line every N steps on rank 0 (and write
            the textfile); None: no step lines.
    """

    run_dir: str | os.PathLike | None = None
    audit_dir: str | os.PathLike | None = None
    metrics_port: int | None = None
    metrics_textfile: str | os.PathLike | None = None
    metrics_addr: str = "0.0.0.0"
    log_every: int | None = 10

    def __post_init__(self) -> None:
        if not isinstance(self.metrics_addr, str) or not self.metrics_addr:
            raise ValueError(f"metrics_addr must be a host address such as '127.0.0.1', not "
                             f"{self.metrics_addr!r}")
        every = self.log_every
        if every is not None and (not isinstance(every, int) or every < 1):
            raise ValueError(f"log_every must be a positive int or None, not {every!r}")


@dataclasses.dataclass(frozen=True)
class StragglerConfig:
    """How ranks slower than their peers are scored, and whether one is dropped
    (:mod:`trainer.stragglers`, docs/elastic.md "Stragglers").

    Args:
        enabled: score the ranks at the end of every window (one small all-reduce per
            window); False: no scores, no drop.
        window: steps per window (W): the scores compare each rank's mean time per step
            in each section over the window.
        threshold: a rank whose overall score (its own work's time over the median of
            the ranks) reaches this in a window is flagged.
        drop: drop a rank flagged in ``windows`` consecutive windows: every rank leaves
            the attempt at the same step and torchrun restarts the job without that
            rank's node. Off by default.
        windows: consecutive flagged windows before a drop (N).
    """

    enabled: bool = True
    window: int = 10
    threshold: float = 2.0
    drop: bool = False
    windows: int = 3

    def __post_init__(self) -> None:
        for name in ("window", "windows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"StragglerConfig.{name} must be a positive int, not "
                                 f"{value!r}")
        if not self.threshold > 1.0:
            raise ValueError(f"StragglerConfig.threshold must be above 1.0 (times the "
                             f"median of the ranks), not {self.threshold!r}")


@dataclasses.dataclass(frozen=True)
class ElasticConfig:
    """Everything about an elastic training run besides the model, optimizer, data, step
    function, checkpoint root, schedule and batch sizes (the trainer's own arguments).

    Args:
        seed: seeds the model init (same on every rank), the sampler's shuffle and each
            rank's random streams after it (torch, NumPy and Python's ``random``; their
            states are checkpointed with ``ckpt.RNGState``).
        data, step, checkpoint, failure, observability: the sections above.
        health: the training-health guard: True (default) for a
            :class:`trainer.health.HealthGuard` with its defaults, a configured
            ``HealthGuard``, or False/None for none. On a bad step (a non-finite loss or
            gradient norm, or a loss spike) every rank rolls back to the newest verified
            checkpoint (see ``CheckpointConfig.verified_window``; else the newest good
            one), the offending global batch is skipped, and training continues;
            past the guard's ``max_rollbacks`` it raises
            :class:`trainer.health.TrainingHealthError`. With a guard, a fresh run saves
            step 0 first (something to roll back to before the first checkpoint).
        hooks: :class:`trainer.hooks.Hooks`: code to call after each step, every N steps
            (evaluation) and after each checkpoint.
        stragglers: :class:`StragglerConfig`: straggler scores, and the optional drop of a
            rank that stays slower than the others.

    Example::

        config = trainer.ElasticConfig(
            seed=1,
            failure=trainer.FailureConfig(heartbeat_timeout=20.0, collective_timeout=90.0),
            checkpoint=trainer.CheckpointConfig(manager_options={"keep_last": 2}))
    """

    seed: int = 0
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    step: StepConfig = dataclasses.field(default_factory=StepConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    failure: FailureConfig = dataclasses.field(default_factory=FailureConfig)
    observability: ObservabilityConfig = dataclasses.field(
        default_factory=ObservabilityConfig)
    health: HealthGuard | bool | None = True
    hooks: Hooks | None = None
    stragglers: StragglerConfig = dataclasses.field(default_factory=StragglerConfig)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            kind = _SECTIONS.get(f.name)
            value = getattr(self, f.name)
            if kind is not None and not isinstance(value, kind):
                raise TypeError(f"ElasticConfig.{f.name} must be a {kind.__name__}, not "
                                f"{type(value).__name__}")
        if self.hooks is not None and not isinstance(self.hooks, Hooks):
            raise TypeError(f"hooks must be a trainer.Hooks, not {type(self.hooks).__name__}")


_SECTIONS: dict[str, type] = {"data": DataConfig, "step": StepConfig,
                              "checkpoint": CheckpointConfig, "failure": FailureConfig,
                              "observability": ObservabilityConfig,
                              "stragglers": StragglerConfig}

#: The trainer's former keywords: (section of ElasticConfig or None for its own fields,
#: field name).
LEGACY_KEYWORDS: dict[str, tuple[str | None, str]] = {
    "seed": (None, "seed"), "health": (None, "health"), "hooks": (None, "hooks"),
    "collate_fn": ("data", "collate_fn"), "data_loader": ("data", "data_loader"),
    "device": ("step", "device"), "fsdp": ("step", "fsdp"),
    "grad_scaler": ("step", "grad_scaler"), "max_grad_norm": ("step", "max_grad_norm"),
    "checkpoint_options": ("checkpoint", "manager_options"),
    "memory_tier": ("checkpoint", "memory_tier"), "probe": ("checkpoint", "probe"),
    "verify": ("checkpoint", "verify"), "extra_state": ("checkpoint", "extra_state"),
    "heartbeat_timeout": ("failure", "heartbeat_timeout"),
    "heartbeat_interval": ("failure", "heartbeat_interval"),
    "collective_timeout": ("failure", "collective_timeout"),
    "hard_exit": ("failure", "hard_exit"),
    "run_dir": ("observability", "run_dir"), "audit_dir": ("observability", "audit_dir"),
    "metrics_port": ("observability", "metrics_port"),
    "metrics_textfile": ("observability", "metrics_textfile"),
    "log_every": ("observability", "log_every"),
}


def new_spelling(keyword: str) -> str:
    """Where a former keyword of the trainer lives in :class:`ElasticConfig`."""
    section, name = LEGACY_KEYWORDS[keyword]
    if section is None:
        return f"config=ElasticConfig({name}=...)"
    return f"config=ElasticConfig({section}={_SECTIONS[section].__name__}({name}=...))"


def config_from_keywords(config: ElasticConfig | None, keywords: Mapping[str, Any], *,
                         stacklevel: int = 3) -> ElasticConfig:
    """``config`` (default: all defaults) with the trainer's former keywords applied over it,
    each with a DeprecationWarning naming its new spelling; TypeError for a keyword that
    never existed."""
    if config is None:
        config = ElasticConfig()
    elif not isinstance(config, ElasticConfig):
        raise TypeError(f"config must be a trainer.ElasticConfig, not {type(config).__name__}")
    unknown = sorted(set(keywords) - LEGACY_KEYWORDS.keys())
    if unknown:
        raise TypeError(f"ElasticTrainer() got an unexpected keyword argument {unknown[0]!r}")
    if not keywords:
        return config
    own: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for keyword, value in keywords.items():
        warnings.warn(f"ElasticTrainer({keyword}=...) is deprecated and will be removed: "
                      f"pass {new_spelling(keyword)}", DeprecationWarning,
                      stacklevel=stacklevel)
        section, name = LEGACY_KEYWORDS[keyword]
        if section is None:
            own[name] = value
        else:
            sections.setdefault(section, {})[name] = value
    for section, values in sections.items():
        own[section] = dataclasses.replace(getattr(config, section), **values)
    return dataclasses.replace(config, **own)


__all__ = ["CheckpointConfig", "DataConfig", "ElasticConfig", "FailureConfig",
           "LEGACY_KEYWORDS", "ObservabilityConfig", "RESERVED_MANAGER_OPTIONS", "StepConfig",
           "StragglerConfig",
           "config_from_keywords", "new_spelling"]
