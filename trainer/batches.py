"""The job's stream of global batches, and this rank's share of each.

A global :class:`trainer.data.ResumableSampler` (checkpointed as the ``"data"`` item) hands
out the global batch of each step; every rank takes its contiguous slice and splits it into
micro batches. The stream's position (its *data offset*: samples drawn by all ranks, all
epochs) names a global batch independently of the world size, which is how a batch the
health guard marked bad is recognised again after a restart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset

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


def dataset_fetch(dataset: Dataset, collate_fn: Callable[[list[Any]], Any]
                  ) -> Callable[[list[int]], Any]:
    """``indices -> batch``: the samples of ``dataset`` at ``indices``, collated."""
    def fetch(indices: list[int]) -> Any:
        return collate_fn([dataset[j] for j in indices])
    return fetch


__all__ = ["GlobalBatches", "StepBatch", "dataset_fetch"]
