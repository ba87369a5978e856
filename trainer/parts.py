"""The parts of one attempt of the elastic trainer, and how they are built.

Each part owns its state (docs/design.md, "Trainer parts"): the attempt (process group,
rank, world, device), the run records, the exit policy, the heartbeat, the batch stream,
the step, the checkpointer, the feed of micro batches, the hooks and the health rollbacks.
:class:`AttemptParts` holds them for one attempt; :func:`build_parts` builds the model and
everything that trains and checkpoints it.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import TYPE_CHECKING, Any

import torch

try:
    import numpy as np
except ImportError:  # ckpt.RNGState holds NumPy's state only when NumPy is installed
    np = None

from trainer.batches import DatasetFeed, GlobalBatches, LoaderFeed
from trainer.checkpointing import (TrainerCheckpointer, checkpointed_items, make_probe,
                                   manager_keywords)
from trainer.data import ResumableSampler
from trainer.exits import ExitPolicy
from trainer.heartbeat import Heartbeat
from trainer.hooks import HookRunner
from trainer.launch import Attempt, wrap_model
from trainer.records import RunRecords
from trainer.rollback import Rollbacks
from trainer.step import StepRunner
from trainer.stragglers import StragglerWatch

if TYPE_CHECKING:
    from trainer.elastic import ElasticTrainer


@dataclasses.dataclass(eq=False)
class AttemptParts:
    """The parts of the attempt under way. The first three exist from its start; the rest
    once :func:`build_parts` (and, for ``rollbacks``, the restore) made them."""

    attempt: Attempt
    records: RunRecords
    exits: ExitPolicy
    #: The last step finished (or restored) by this process.
    step: int = 0
    heartbeat: Heartbeat | None = None
    #: The model as built (not wrapped).
    module: torch.nn.Module | None = None
    batches: GlobalBatches | None = None
    steps: StepRunner | None = None
    checkpointer: TrainerCheckpointer | None = None
    feed: DatasetFeed | LoaderFeed | None = None
    hook_runner: HookRunner | None = None
    rollbacks: Rollbacks | None = None
    #: The straggler scores and drop policy (None: off, or one rank).
    stragglers: StragglerWatch | None = None

    def at_step(self, step: int) -> None:
        """``step`` is where training stands now (done, restored or rolled back to)."""
        self.step = step
        if self.heartbeat is not None:
            self.heartbeat.update(step)


def seed_everything(seed: int) -> None:
    """Seed torch (every device), NumPy (when installed) and Python's ``random``."""
    torch.manual_seed(seed)
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2 ** 32)


def probe_batch(trainer: ElasticTrainer) -> Any:
    """A fixed micro batch of the trainer's dataset: its first samples, collated."""
    n = min(trainer.micro_batch_size, len(trainer.dataset))
    return trainer.collate_fn([trainer.dataset[i] for i in range(n)])


def build_parts(trainer: ElasticTrainer, parts: AttemptParts) -> None:
    """The model (same initial weights on every rank), wrapped; optimizer, scheduler, the
    batch stream, the step, and the checkpointed state with its manager, into ``parts``."""
    config, attempt, records = trainer.config, parts.attempt, parts.records
    fsdp = config.step.fsdp
    t0 = time.time()
    seed_everything(config.seed)  # the same initial weights on every rank
    module = parts.module = trainer.model_fn().to(attempt.device)
    t_model = time.time()
    model = wrap_model(module, attempt.device, fsdp, attempt.distributed, attempt.world_size)
    optimizer = trainer.optimizer_fn(model.parameters())
    records.record("built", seconds=time.time() - attempt.group_ready_at,
                   model_s=t_model - t0, wrap_s=time.time() - t_model)
    scheduler = trainer.scheduler_fn(optimizer) if trainer.scheduler_fn else None
    sampler = ResumableSampler(len(trainer.dataset), seed=config.seed)
    extra_state = config.checkpoint.extra_state
    extra = extra_state(module) if extra_state is not None else None
    seed_everything(config.seed + 1 + attempt.rank)  # dropout differs by rank
    parts.batches = GlobalBatches(sampler, global_batch_size=trainer.global_batch_size,
                                  micro_batch_size=trainer.micro_batch_size,
                                  rank=attempt.rank, world_size=attempt.world_size)
    grad_scaler = config.step.grad_scaler
    parts.steps = StepRunner(attempt, model, optimizer, scheduler, grad_scaler,
                             trainer.step_fn, max_grad_norm=config.step.max_grad_norm,
                             fsdp=bool(fsdp), sections=trainer.sections)
    checkpoint = config.checkpoint
    parts.checkpointer = TrainerCheckpointer(
        trainer.checkpoint_root, every=trainer.checkpoint_every,
        items=checkpointed_items(sampler=sampler, module=module, model=model,
                                 optimizer=optimizer, scheduler=scheduler,
                                 grad_scaler=grad_scaler, fsdp=bool(fsdp), extra=extra),
        collective_timeout=config.failure.collective_timeout,
        options=manager_keywords(checkpoint, root=trainer.checkpoint_root,
                                 elastic=trainer.elastic),
        probe=make_probe(checkpoint.probe, module, lambda: probe_batch(trainer),
                         fsdp=bool(fsdp)),
        verify=checkpoint.verify, verified_window=checkpoint.verified_window,
        guard=trainer.health)
    parts.exits.attach(checkpointer=parts.checkpointer)
    trainer.metrics.attach_checkpoint(parts.checkpointer.manager.metrics)
    data = config.data
    parts.feed = (LoaderFeed(data.data_loader, config.seed) if data.data_loader is not None
                  else DatasetFeed(trainer.dataset, trainer.collate_fn))
    if config.hooks is not None:
        parts.hook_runner = HookRunner(config.hooks, trainer, module)


__all__ = ["AttemptParts", "build_parts", "probe_batch", "seed_everything"]
