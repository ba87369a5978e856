"""The elastic trainer's checkpoints: which items they hold, and the manager that writes them.

Every checkpoint holds the RNG streams, the data position (the global sampler), the step's
metadata, the model and optimizer (through ``ckpt.ModelOptimizer`` with FSDP, so that any
world size can load them), the scheduler and grad scaler when there are any, and the
user's extra items (an EMA copy of the model, a counter: anything ``ckpt`` saves).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
from collections.abc import Callable
from typing import Any

import torch

import ckpt

log = logging.getLogger("trainer.elastic")

#: Restore levels (``CheckpointManager.restore``'s ``verify``).
VERIFY_LEVELS = ("structure", "digest", "forward")


#: Item names the trainer uses itself; extra items may not take them.
RESERVED_ITEMS = frozenset({"rng", "data", "meta", "model", "optim", "train", "sched",
                            "scaler"})


def checkpointed_items(*, sampler: Any, module: torch.nn.Module, model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer, scheduler: Any | None,
                       grad_scaler: torch.amp.GradScaler | None, fsdp: bool,
                       extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The items of every checkpoint (``"meta"``: the metadata of its step), then the
    user's ``extra`` items (ValueError for a name the trainer uses)."""
    items: dict[str, Any] = {"rng": ckpt.RNGState(), "data": sampler, "meta": {"step": 0}}
    if fsdp:
        items["train"] = ckpt.ModelOptimizer(model, optimizer)
    else:
        items["model"] = module
        items["optim"] = optimizer
    if scheduler is not None:
        items["sched"] = scheduler
    if grad_scaler is not None:
        items["scaler"] = grad_scaler
    extra = dict(extra or {})
    taken = sorted(RESERVED_ITEMS & extra.keys())
    if taken:
        raise ValueError(f"extra_state may not use the item names {taken}: the trainer "
                         f"saves its own items under {sorted(RESERVED_ITEMS)}; rename yours")
    return {**items, **extra}


def default_probe_inputs(batch: Any) -> Any:
    """The model's input in a collated batch: its first element for a tuple or list
    (``(inputs, targets, ...)``), else the batch itself."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def make_probe(spec: bool | Callable[[Any], Any] | ckpt.Probe | None, module: torch.nn.Module,
               batch: Callable[[], Any], *, fsdp: bool) -> ckpt.Probe | None:
    """The probe recorded with every checkpoint (see the trainer's ``probe``), tried once on
    ``module`` now. ``batch()`` gives a fixed micro batch of the dataset.

    Raises ValueError when an explicitly given probe cannot run; the default one (``spec``
    True) is dropped with a warning instead.
    """
    if spec is None or spec is False:
        return None
    if fsdp:
        log.info("no probe recorded: the model is sharded (FSDP), the forward check would "
                 "need every rank; restores check digests")
        return None
    if isinstance(spec, ckpt.Probe):
        probe = spec
    else:
        fn = default_probe_inputs if spec is True else spec
        probe = ckpt.Probe(model_key="model", inputs=fn(batch()))
    try:
        probe.record({probe.model_key: module})
    except Exception as e:
        if spec is not True:
            raise ValueError(f"the probe cannot run through the model: {type(e).__name__}: "
                             f"{e}") from e
        log.warning("no probe recorded: the model refused the first element of a micro "
                    "batch (%s: %s); pass probe=lambda batch: <the model's inputs> to have "
                    "restores run the forward check", type(e).__name__, e)
        return None
    return probe


SHM_DIR = "/dev/shm"

_DEFAULT_COMMIT_TIMEOUT = ckpt.SaveOptions().commit_timeout


def memory_job_id(root: str | os.PathLike, run_id: str | None) -> str:
    """The job's name in memory segment names: torchrun's run id and a hash of the root, so
    that two jobs with one run id (``--rdzv-id``) never read each other's segments and a
    restarted worker of this job finds its own."""
    digest = hashlib.sha256(os.fspath(root).encode()).hexdigest()[:8]
    return re.sub(r"[^A-Za-z0-9_.]+", "_", f"{run_id or 'local'}.{digest}")


def memory_tier_options(requested: bool | None, *, root: str | os.PathLike, elastic: bool,
                        options: ckpt.MemoryTierOptions | None = None) -> dict[str, Any]:
    """The ``CheckpointManager`` keywords that turn the memory tier on (empty: off).

    ``requested``: True (on), False (off) or None, the trainer's default: on when torchrun
    runs the job (``elastic``) and /dev/shm exists. ``options`` say how the tier works
    (``persist_every``, ``replicas``, ``keep``, ...); their ``job``, the name in segment
    names, defaults to :func:`memory_job_id`.
    """
    if requested is False or (requested is None
                              and not (elastic and os.path.isdir(SHM_DIR))):
        return {}
    options = options or ckpt.MemoryTierOptions()
    if options.job is None:
        options = dataclasses.replace(
            options, job=memory_job_id(root, os.environ.get("TORCHELASTIC_RUN_ID")))
    return {"memory_tier": options}


class TrainerCheckpointer:
    """The trainer's checkpointed state (``items`` plus the step's ``"meta"``) and the
    manager that saves it on the schedule and restores it.

    Args:
        root: the checkpoint root (any root ``ckpt.CheckpointManager`` takes).
        every: save every N steps.
        items: what each checkpoint holds (see :func:`checkpointed_items`); restored in
            place.
        collective_timeout: the commit vote's timeout (unless the ``ckpt.SaveOptions`` in
            ``options`` sets another).
        options: more ``CheckpointManager`` keywords (``keep_last`` defaults to 3; the
            memory tier's from :func:`memory_tier_options`).
        probe: recorded with every save (None: none).
        verify: what a step must pass to be restored (see :data:`VERIFY_LEVELS`); a step
            that fails is skipped for the one before it, on a resume and on a rollback.
    """

    def __init__(self, root: str | os.PathLike, *, every: int, items: dict[str, Any],
                 collective_timeout: float, options: dict[str, Any],
                 probe: ckpt.Probe | None = None, verify: str = "digest") -> None:
        self.state: dict[str, Any] = dict(items)
        self.state.setdefault("meta", {"step": 0})
        options = {"keep_last": 3, **options}
        self.manager_options = options
        self.verify = verify
        kwargs = dict(options)
        saving = kwargs.pop("options", None) or ckpt.SaveOptions()
        if saving.commit_timeout == _DEFAULT_COMMIT_TIMEOUT:  # not chosen by the user
            saving = dataclasses.replace(saving, commit_timeout=collective_timeout)
        # The trainer's own SIGTERM handling checkpoints the step every rank agreed on.
        self.manager = ckpt.CheckpointManager(
            root, every_steps=every, schedule=ckpt.Schedule(handle_sigterm=False),
            options=dataclasses.replace(saving, probe=probe), **kwargs)

    @property
    def meta(self) -> dict[str, Any]:
        """The metadata of the step last saved or restored."""
        return self.state.get("meta") or {}

    def restore(self) -> int | None:
        """Load the newest checkpoint that passes the ``verify`` level into the state; its
        step (None: none)."""
        return self.manager.restore(self.state, verify=self.verify)

    @property
    def memory_tier(self) -> bool:
        """Whether saves also go to the memory tier."""
        return bool(self.manager_options.get("memory_tier"))

    def restored_from(self) -> dict[str, Any]:
        """Where the last restore came from: ``tier`` ("memory", "peer" or "storage"),
        ``bytes_from_storage`` (read from the persistent root) and ``skipped_steps``, the
        steps it gave up on first, newest first (the reasons are in the manager's
        ``ckpt.restore`` log line and ``last_restore.skipped``); empty before one."""
        info = self.manager.last_restore
        if info is None:
            return {}
        skipped = list(dict.fromkeys(step for step, _, _ in info.skipped))
        return {"tier": info.tier, "bytes_from_storage": info.bytes_from_storage,
                "skipped_steps": skipped}

    def save(self, step: int, meta: dict[str, Any], *, force: bool = False,
             persist: bool | None = None) -> Any:
        """Save ``step`` with ``meta`` if the schedule (or ``force``) says so; returns the
        manager's handle (None: not saved). A forced save (the trainer's first, final and
        preemption checkpoints) and one with ``persist=True`` also go to the root when the
        memory tier is on, whatever ``persist_every`` says."""
        self.state["meta"] = meta
        return self.manager.save(step, self.state, force=force,
                                 persist=True if force or persist else None)

    def wait(self) -> None:
        """Until the save in flight is committed."""
        self.manager.wait()

    def close(self) -> None:
        """Finish the save in flight and release the root."""
        self.manager.close()


__all__ = ["RESERVED_ITEMS", "TrainerCheckpointer", "VERIFY_LEVELS", "checkpointed_items",
           "default_probe_inputs", "make_probe", "memory_job_id", "memory_tier_options"]
