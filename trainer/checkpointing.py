"""The elastic trainer's checkpoints: which items they hold, and the manager that writes them.

Every checkpoint holds the RNG streams, the data position (the global sampler), the step's
metadata, the model and optimizer (through ``ckpt.ModelOptimizer`` with FSDP, so that any
world size can load them), the scheduler and grad scaler when there are any, and the
user's extra items (an EMA copy of the model, a counter: anything ``ckpt`` saves).
"""

from __future__ import annotations

import os
from typing import Any

import torch

import ckpt


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


class Checkpoints:
    """The checkpointed state (``items`` plus the step's ``"meta"``) and its manager.

    Args:
        root: the checkpoint root (any root ``ckpt.CheckpointManager`` takes).
        every: save every N steps.
        items: what each checkpoint holds (see :func:`checkpointed_items`); restored in
            place.
        collective_timeout: the commit vote's timeout (unless ``options`` sets one).
        options: more ``CheckpointManager`` keywords (``keep_last`` defaults to 3).
    """

    def __init__(self, root: str | os.PathLike, *, every: int, items: dict[str, Any],
                 collective_timeout: float, options: dict[str, Any]) -> None:
        self.state: dict[str, Any] = dict(items)
        self.state.setdefault("meta", {"step": 0})
        options = {"keep_last": 3, "commit_timeout": collective_timeout, **options}
        self.manager = ckpt.CheckpointManager(root, every_steps=every, handle_sigterm=False,
                                              save_on_preemption=False, **options)

    @property
    def meta(self) -> dict[str, Any]:
        """The metadata of the step last saved or restored."""
        return self.state.get("meta") or {}

    def restore(self) -> int | None:
        """Load the newest good checkpoint into the state; its step (None: none)."""
        return self.manager.restore(self.state)

    def save(self, step: int, meta: dict[str, Any], *, force: bool = False) -> Any:
        """Save ``step`` with ``meta`` if the schedule (or ``force``) says so; returns the
        manager's handle (None: not saved)."""
        self.state["meta"] = meta
        return self.manager.save(step, self.state, force=force)

    def wait(self) -> None:
        """Until the save in flight is committed."""
        self.manager.wait()

    def close(self) -> None:
        """Finish the save in flight and release the root."""
        self.manager.close()


__all__ = ["RESERVED_ITEMS", "Checkpoints", "checkpointed_items"]
