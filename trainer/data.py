"""Resumable, world-size-independent sampling over a map-style dataset."""

from __future__ import annotations

from typing import Any

import torch


class ResumableSampler:
    """Hands out global batches of dataset indices from a seeded per-epoch permutation.

    The state is global (not per rank): which epoch we are in and how many samples of
    that epoch's permutation have been consumed by all ranks together. Because of that a
    job can resume with a different world size and still see every sample exactly once
    per epoch; ranks only differ in which slice of the global batch they take.

    A batch that crosses the end of an epoch takes the tail of the current permutation
    and continues with the head of the next one, so batch sizes stay constant.
    """

    def __init__(self, num_samples: int, seed: int = 0, audit: bool = False) -> None:
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.epoch = 0
        self.consumed = 0
        self.audit: list[int] | None = [] if audit else None
        self._perm_epoch: int | None = None
        self._perm: list[int] = []

    def _permutation(self) -> list[int]:
        if self._perm_epoch != self.epoch:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            self._perm = torch.randperm(self.num_samples, generator=gen).tolist()
            self._perm_epoch = self.epoch
        return self._perm

    def next_indices(self, global_batch: int) -> list[int]:
        """Return the next `global_batch` indices and advance the state past them."""
        if global_batch <= 0:
            raise ValueError(f"global_batch must be positive, got {global_batch}")
        out: list[int] = []
        while len(out) < global_batch:
            perm = self._permutation()
            take = min(global_batch - len(out), self.num_samples - self.consumed)
            out.extend(perm[self.consumed:self.consumed + take])
            self.consumed += take
            if self.consumed == self.num_samples:
                self.epoch += 1
                self.consumed = 0
        if self.audit is not None:
            self.audit.extend(out)
        return out

    @staticmethod
    def rank_slice(indices: list[int], rank: int, world: int) -> list[int]:
        """Return rank `rank`'s contiguous share of a global batch split over `world` ranks."""
        if world <= 0 or not 0 <= rank < world:
            raise ValueError(f"bad rank/world: {rank}/{world}")
        if len(indices) % world:
            raise ValueError(f"global batch of {len(indices)} does not split over {world} ranks")
        per = len(indices) // world
        return indices[rank * per:(rank + 1) * per]

    def state_dict(self) -> dict[str, int]:
        """JSON-friendly state: plain ints only."""
        return {
            "num_samples": self.num_samples,
            "seed": self.seed,
            "epoch": self.epoch,
            "consumed": self.consumed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state produced by `state_dict()` (possibly after a JSON round trip)."""
        num_samples = int(state.get("num_samples", self.num_samples))
        if num_samples != self.num_samples:
            raise ValueError(
                f"sampler state is for {num_samples} samples, dataset has {self.num_samples}"
            )
        consumed = int(state["consumed"])
        if not 0 <= consumed < self.num_samples:
            raise ValueError(f"consumed={consumed} out of range for {self.num_samples} samples")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.consumed = consumed
        self._perm_epoch = None

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (f"ResumableSampler(num_samples={self.num_samples}, seed={self.seed}, "
                f"epoch={self.epoch}, consumed={self.consumed})")
