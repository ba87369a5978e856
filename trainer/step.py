"""One optimizer step of the elastic trainer, from sample indices to the update.

The rank's share of the global batch is split into micro batches whose gradients are
accumulated (synchronized across ranks on the last one only), the gradient norm is
measured (and clipped), one small all-reduce agrees on the loss, the norm and any SIGTERM,
and the optimizer (through a ``GradScaler`` with mixed precision) and scheduler step.
:class:`StepRunner` does this for :class:`trainer.elastic.ElasticTrainer`, marking each
part for the hang detector and the straggler scores (:mod:`trainer.sections`: data,
forward, backward, collective, optimizer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from trainer.launch import Attempt
from trainer.sections import Sections

T = TypeVar("T")


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


class StepRunner:
    """One optimizer step's computation: gradients accumulated over micro batches (synced
    across ranks on the last one), the gradient norm (unscaled with a GradScaler, clipped
    if asked), the agreement on loss, norm and SIGTERM, then the update.

    Args:
        attempt: the attempt's device and collectives.
        model: the model as trained (wrapped in DDP, or sharded by FSDP2).
        optimizer, scheduler, grad_scaler: stepped once per step (scheduler and scaler
            may be None).
        step_fn: ``(model, batch) -> loss`` of one micro batch.
        max_grad_norm: clip the gradient norm to this (None: measure only).
        fsdp: whether ``model`` is sharded with FSDP2 (gradient sync is switched on it).
        sections: the progress markers to move (default: markers nobody reads).
    """

    def __init__(self, attempt: Attempt, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any | None,
                 grad_scaler: torch.amp.GradScaler | None,
                 step_fn: Callable[[torch.nn.Module, Any], torch.Tensor], *,
                 max_grad_norm: float | None, fsdp: bool,
                 sections: Sections | None = None) -> None:
        self.attempt = attempt
        self.sections = sections if sections is not None else Sections()
        self.device = attempt.device
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.grad_scaler, self.step_fn = grad_scaler, step_fn
        self.max_grad_norm, self.fsdp = max_grad_norm, fsdp

    def _sync_context(self, last: bool) -> Any:
        if self.fsdp and hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        if last or not hasattr(self.model, "no_sync"):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def learning_rate(self) -> float:
        """The first parameter group's learning rate (the one this step uses)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def forward_backward(self, micro: Sequence[T], fetch: Callable[[T], Any]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients of one step over the micro batches ``fetch(m)`` for ``m`` in ``micro``
        (each fetched just before its forward), accumulated and synchronized on the last;
        returns this rank's summed micro-batch losses and the total gradient norm
        (unscaled first with a GradScaler, measured before clipping, clipped if asked)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        scaler = self.grad_scaler
        total = torch.zeros((), device=self.device)
        enter = self.sections.enter
        for i, m in enumerate(micro):
            enter("data")
            batch = _to_device(fetch(m), self.device)
            enter("forward")
            with self._sync_context(i == len(micro) - 1):
                loss = self.step_fn(self.model, batch)
                part = loss / len(micro)
                enter("backward")  # with DDP, the last one waits for the gradient all-reduce
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

    def agree(self, loss: torch.Tensor, grad_norm: torch.Tensor,
              sigterm: bool) -> tuple[float, float, bool]:
        """One small all-reduce per step, before the update: the global mean loss, whether
        any rank got SIGTERM (so that all ranks take the preemption checkpoint at the same
        step) and the gradient norm. Every rank judges the step's health from these same
        agreed numbers, so all of them roll back, or none."""
        agree = torch.stack([loss, torch.tensor(float(sigterm), device=self.device),
                             grad_norm])
        self.sections.enter("collective")
        self.attempt.all_reduce(agree)
        loss_total, sigterms, norm_total = agree.tolist()
        world = self.attempt.world_size
        loss_value = loss_total / world
        norm_value = norm_total / world  # the same on every rank: mean = it
        return loss_value, norm_value, sigterms > 0

    def update(self) -> None:
        """The optimizer step (through the GradScaler, if any), then the scheduler's."""
        self.sections.enter("optimizer")
        if self.grad_scaler is not None:
            self.grad_scaler.step(self.optimizer)  # skipped when the gradient overflowed
            self.grad_scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def abandon(self) -> None:
        """Drop this step's gradients instead of an update (before a rollback restores the
        state): end the scaler's step (``unscale_`` ran) and clear the gradients."""
        if self.grad_scaler is not None:
            self.grad_scaler.update()
        self.optimizer.zero_grad(set_to_none=True)


__all__ = ["StepRunner"]
