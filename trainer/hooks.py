"""User code the elastic trainer calls: after each step, every N steps (evaluation), and
after each checkpoint.

Hooks run on every rank, in the training thread, and are called only for steps that count:
a step the health guard rolled back calls none. They are called with the trainer and the
step, so they can reach ``trainer.module``, ``trainer.rank``, ``trainer.state`` and so on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

#: ``(trainer, step) -> None``
Hook = Callable[[Any, int], None]


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What to call, and when.

    Args:
        after_step: after each step's update and before its checkpoint, so that what it
            changes (an EMA of the weights, a counter among the checkpointed items) is saved
            with the step.
        evaluate: every ``eval_every`` steps, after ``after_step`` and before the step's
            checkpoint; the model is in eval mode, gradients are off, and the torch RNG is
            forked, so an evaluation changes neither training's random stream nor its result.
        eval_every: how often ``evaluate`` runs (in steps).
        after_checkpoint: once the checkpoint of a step is committed (checked before each
            step and at the end of training, so it may come a few steps late; the
            preemption checkpoint calls it before the process exits).
    """

    after_step: Hook | None = None
    evaluate: Hook | None = None
    eval_every: int | None = None
    after_checkpoint: Hook | None = None

    def __post_init__(self) -> None:
        if (self.evaluate is None) != (self.eval_every is None):
            raise ValueError("Hooks: evaluate and eval_every go together")
        if self.eval_every is not None and (not isinstance(self.eval_every, int)
                                            or self.eval_every < 1):
            raise ValueError(f"eval_every must be a positive int, not {self.eval_every!r}")


class HookRunner:
    """Calls ``hooks`` for ``trainer`` on ``model`` (the unwrapped module); remembers the
    checkpoints in flight until they are committed."""

    def __init__(self, hooks: Hooks, trainer: Any, model: torch.nn.Module) -> None:
        self.hooks, self.trainer, self.model = hooks, trainer, model
        self._pending: list[tuple[int, Any]] = []

    def step_done(self, step: int) -> None:
        """``step`` was trained: ``after_step``, then ``evaluate`` when it is due."""
        if self.hooks.after_step is not None:
            self.hooks.after_step(self.trainer, step)
        every = self.hooks.eval_every
        if self.hooks.evaluate is not None and every and step % every == 0:
            self._evaluate(step)

    def _evaluate(self, step: int) -> None:
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        devices = [device.index or 0] if device.type == "cuda" else []
        was_training = self.model.training
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            self.model.eval()
            try:
                self.hooks.evaluate(self.trainer, step)
            finally:
                self.model.train(was_training)

    def checkpoint_taken(self, step: int, handle: Any) -> None:
        """The save of ``step`` started (``handle``: the manager's)."""
        if self.hooks.after_checkpoint is not None and handle is not None:
            self._pending.append((step, handle))

    def preempted(self, step: int, taken: Any) -> None:
        """The preemption checkpoint of ``step`` is committed (``taken``: the handle of its
        save, if it was not the step's scheduled one): the hooks of every checkpoint."""
        self.checkpoint_taken(step, taken)
        self.poll()

    def poll(self) -> None:
        """``after_checkpoint`` for the checkpoints committed since the last call."""
        while self._pending and self._pending[0][1].done():
            step, handle = self._pending.pop(0)
            if handle.exception() is None:  # a failed save raises at the next save
                self.hooks.after_checkpoint(self.trainer, step)
