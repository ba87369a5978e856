"""One optimizer step of the elastic trainer, from sample indices to the update.

The rank's share of the global batch is split into micro batches whose gradients are
accumulated (synchronized across ranks on the last one only), the gradient norm is
measured (and clipped), one small all-reduce agrees on the loss, the norm and any SIGTERM,
and the optimizer (through a ``GradScaler`` with mixed precision) and scheduler step.
:class:`StepMechanics` holds this for :class:`trainer.elastic.ElasticTrainer`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist


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


class StepMechanics:
    """The computation of one step of :class:`trainer.elastic.ElasticTrainer` (a mixin: it
    uses the trainer's model, optimizer, scheduler, grad scaler, dataset and device)."""

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

    def _agree(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[float, float, bool]:
        """One small all-reduce per step, before the update: the global mean loss, whether
        any rank got SIGTERM (so that all ranks take the preemption checkpoint at the same
        step) and the gradient norm. Every rank judges the step's health from these same
        agreed numbers, so all of them roll back, or none."""
        agree = torch.stack([loss, torch.tensor(float(self._sigterm), device=self.device),
                             grad_norm])
        if self.distributed and self.world_size > 1:
            dist.all_reduce(agree)
        loss_total, sigterms, norm_total = agree.tolist()
        loss_value = loss_total / self.world_size
        norm_value = norm_total / self.world_size  # the same on every rank: mean = it
        return loss_value, norm_value, sigterms > 0

    def _optimizer_step(self) -> None:
        if self.grad_scaler is not None:
            self.grad_scaler.step(self.optimizer)  # skipped when the gradient overflowed
            self.grad_scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()


__all__ = ["StepMechanics"]
