"""The job's stream of global batches, and this rank's share of each.

A global :class:`trainer.data.ResumableSampler` (checkpointed as the ``"data"`` item) hands
out the global batch of each step; every rank takes its contiguous slice and splits it into
micro batches. The stream's position (its *data offset*: samples drawn by all ranks, all
epochs) names a global batch independently of the world size, which is how a batch the
health guard marked bad is recognised again after a restart.

The micro batches themselves come from a *feed*: :class:`DatasetFeed` reads the samples in
the loop; :class:`LoaderFeed` takes them from the user's ``DataLoader`` (worker processes,
``collate_fn``, ``pin_memory``), handing it the planned micro batches as its
``batch_sampler``. Either way the position that checkpoints hold counts the batches the
loop consumed, never those the loader's workers fetched ahead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from trainer.data import ResumableSampler


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One global batch as one rank sees it."""

    offset: int                 # the data offset of the global batch
    global_indices: list[int]   # the whole global batch (every rank's samples)
    mine: list[int]             # this rank's share
    micro: list[list[int]]      # this rank's share in micro batches


class GlobalBatches:
    """Global batches of ``global_batch_size`` samples drawn from ``sampler``, split for
    rank ``rank`` of ``world_size`` into micro batches of ``micro_batch_size``."""

    def __init__(self, sampler: ResumableSampler, *, global_batch_size: int,
                 micro_batch_size: int, rank: int, world_size: int) -> None:
        self.sampler = sampler
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.rank, self.world_size = rank, world_size

    def offset(self) -> int:
        """Position in the job's sample stream: samples drawn by all ranks, all epochs."""
        return self.sampler.epoch * self.sampler.num_samples + self.sampler.consumed

    def take(self) -> StepBatch:
        """The next global batch; the position moves past it."""
        offset = self.offset()
        global_indices = self.sampler.next_indices(self.global_batch_size)
        mine = ResumableSampler.rank_slice(global_indices, self.rank, self.world_size)
        m = self.micro_batch_size
        return StepBatch(offset, global_indices, mine,
                         [mine[i:i + m] for i in range(0, len(mine), m)])


class DatasetFeed:
    """Micro batches read from a map-style dataset in the training loop, collated."""

    def __init__(self, dataset: Dataset, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.dataset, self.collate_fn = dataset, collate_fn

    def start(self, batches: GlobalBatches, bad: set[int], steps: int) -> None:
        """Nothing to prepare: samples are read when fetched."""

    def fetch(self, indices: list[int]) -> Any:
        """The samples of the dataset at ``indices``, collated."""
        return self.collate_fn([self.dataset[j] for j in indices])

    def stop(self) -> None:
        """Nothing to stop."""


class PlannedMicroBatches(Sampler[list[int]]):
    """This rank's micro batches of the next ``steps`` steps, from a copy of the job's
    position on: the ``batch_sampler`` the trainer hands to a user's DataLoader factory.

    It passes over the global batches at the data offsets in ``bad`` exactly as the loop
    does, so the loader yields, in order, the micro batches the loop will train. Whatever
    the loader's workers fetch ahead, the checkpointed position is the loop's.
    """

    def __init__(self, batches: GlobalBatches, bad: set[int], steps: int) -> None:
        self._state = batches.sampler.state_dict()
        self._num_samples, self._seed = batches.sampler.num_samples, batches.sampler.seed
        self._split = (batches.global_batch_size, batches.micro_batch_size, batches.rank,
                       batches.world_size)
        self._bad = frozenset(bad)
        self._steps = steps

    def __iter__(self) -> Iterator[list[int]]:
        sampler = ResumableSampler(self._num_samples, seed=self._seed)
        sampler.load_state_dict(self._state)
        global_batch, micro_batch, rank, world = self._split
        plan = GlobalBatches(sampler, global_batch_size=global_batch,
                             micro_batch_size=micro_batch, rank=rank, world_size=world)
        for _ in range(self._steps):
            while plan.offset() in self._bad:
                plan.take()
            yield from plan.take().micro

    def __len__(self) -> int:
        global_batch, micro_batch, _, world = self._split
        return self._steps * (global_batch // (micro_batch * world))


class LoaderFeed:
    """Micro batches from a user's ``DataLoader``, built by ``loader_fn(batch_sampler)``
    over :class:`PlannedMicroBatches` (users keep ``num_workers``, ``collate_fn``,
    ``pin_memory``). The loader is rebuilt whenever the position jumps (a restore, a
    rollback); its workers' seeds derive from ``seed``, the position and the rank unless the
    loader has a ``generator`` of its own, so creating it draws nothing from the global RNG.
    """

    def __init__(self, loader_fn: Callable[[Sampler[list[int]]], DataLoader], seed: int) -> None:
        self.loader_fn, self.seed = loader_fn, seed
        self._it: Iterator[Any] | None = None

    def start(self, batches: GlobalBatches, bad: set[int], steps: int) -> None:
        """Serve the micro batches of the next ``steps`` steps from the current position."""
        self.stop()
        if steps <= 0:
            return
        plan = PlannedMicroBatches(batches, bad, steps)
        loader = self.loader_fn(plan)
        if not isinstance(loader, DataLoader) or loader.batch_sampler is not plan:
            raise TypeError(
                "the data_loader factory must return DataLoader(dataset, batch_sampler=<the "
                "sampler it was given>, ...); batch_size, shuffle, sampler and drop_last are "
                "the trainer's (global_batch_size, micro_batch_size, seed)")
        if getattr(loader, "in_order", True) is False:
            raise ValueError("the trainer needs a DataLoader with in_order=True")
        if loader.generator is None:
            seed = (self.seed * 1_000_003 + batches.offset()) * 1009 + batches.rank
            loader.generator = torch.Generator().manual_seed(seed % 2 ** 63)
        self._it = iter(loader)

    def fetch(self, indices: list[int]) -> Any:
        """The next micro batch (the loader's, for ``indices``)."""
        assert self._it is not None, "LoaderFeed.start() first"
        try:
            return next(self._it)
        except StopIteration:
            raise RuntimeError(f"the DataLoader ended before the micro batch {indices[:4]}..."
                               " the trainer planned: does it drop or add batches?") from None

    def stop(self) -> None:
        """Shut down the loader's workers (if any)."""
        self._it = None


__all__ = ["DatasetFeed", "GlobalBatches", "LoaderFeed", "PlannedMicroBatches", "StepBatch"]
