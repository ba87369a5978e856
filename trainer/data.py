"""Resumable, world-size-independent sampling over a map-style dataset, and the idiom that
makes a plain ``torch.utils.data.DataLoader`` resume exactly (:class:`ResumableLoader`)."""

from __future__ import annotations

import hashlib
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Sampler


class ResumableSampler(Sampler[int]):
    """Hands out global batches of dataset indices from a seeded per-epoch permutation.

    The state is global (not per rank): which epoch we are in and how many samples of
    that epoch's permutation have been consumed by all ranks together. Because of that a
    job can resume with a different world size and still see every sample exactly once
    per epoch; ranks only differ in which slice of the global batch they take.

    A batch that crosses the end of an epoch takes the tail of the current permutation
    and continues with the head of the next one, so batch sizes stay constant.

    It is also a ``torch.utils.data.Sampler``: ``DataLoader(dataset, sampler=s, ...)``
    iterates the rest of the current epoch. A DataLoader fetches ahead of the loop, so the
    sampler alone cannot know what was trained on: wrap the loader in
    :class:`ResumableLoader` and save that, which counts the batches the loop consumed.
    Saving a sampler that a DataLoader iterates without one raises instead of saving a
    position past the batches really used.
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
        self._counted = False    # a ResumableLoader advances the position
        self._uncounted = False  # __iter__ handed out indices that nothing counted

    def __iter__(self) -> Iterator[int]:
        """The rest of the current epoch's permutation, from the saved position on."""
        epoch, start = self.epoch, self.consumed
        if not self._counted:
            self._uncounted = True
        gen = torch.Generator().manual_seed(self.seed + epoch)
        yield from torch.randperm(self.num_samples, generator=gen)[start:].tolist()
        if not self._counted and self.epoch == epoch:
            self.epoch, self.consumed = epoch + 1, 0  # a fresh permutation next time

    def advance(self, n: int) -> None:
        """Count ``n`` more samples of the current epoch as consumed (the loop trained on
        them); at the end of the permutation the next epoch starts."""
        self.consumed = min(self.consumed + n, self.num_samples)
        if self.consumed == self.num_samples:
            self.end_epoch()

    def end_epoch(self) -> None:
        """Start the next epoch (a loader with ``drop_last`` ends before the permutation)."""
        self.epoch += 1
        self.consumed = 0

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
        """JSON-friendly state: plain ints only.

        Raises:
            RuntimeError: a DataLoader iterated this sampler with no :class:`ResumableLoader`
                counting what the loop consumed, so the position is unknown.
        """
        if self._uncounted:
            raise RuntimeError(
                "this ResumableSampler was iterated (by a DataLoader?) with nothing counting "
                "the batches the loop consumed, so its position is unknown: save "
                "trainer.ResumableLoader(loader) instead of the sampler")
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
        self._uncounted = False

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (f"ResumableSampler(num_samples={self.num_samples}, seed={self.seed}, "
                f"epoch={self.epoch}, consumed={self.consumed})")


class ResumableLoader:
    """A ``DataLoader`` over a :class:`ResumableSampler` that saves the position of the
    *loop*, not of the workers: the one idiom for a plain DataLoader to resume exactly.

    Iterate it instead of the loader; it counts the batches handed to the loop (the workers
    may have fetched more) and advances the sampler by them, so ``state_dict()`` names the
    first batch not yet trained on. Put it in the checkpoint state as ``"data": loader``.
    Breaking out of the loop and iterating again continues where the loop stopped.

    When the DataLoader has no ``generator=``, the loader gets a private one, re-seeded from
    the sampler's seed and epoch at each ``iter()``: creating the iterator then draws
    nothing from the global torch RNG that :class:`ckpt.RNGState` restores, whatever the
    order of ``restore()`` and ``iter()``, and the workers' seeds are those of the epoch.

    Args:
        loader: a DataLoader built with ``sampler=ResumableSampler(...)`` and a
            ``batch_size`` (or ``batch_sampler=BatchSampler(ResumableSampler(...), ...)``);
            batches must come in order (the default ``in_order=True``).

    Example::

        sampler = trainer.ResumableSampler(len(dataset), seed=0)
        loader = trainer.ResumableLoader(DataLoader(dataset, sampler=sampler, batch_size=32,
                                                    num_workers=2))
        state = {"model": model, "optim": optim, "rng": ckpt.RNGState(), "data": loader}
        mgr.restore(state)
        for epoch in range(loader.epoch, epochs):  # not range(epochs): resumes mid-run
            for batch in loader:
                ...
    """

    def __init__(self, loader: DataLoader) -> None:
        batch_sampler = getattr(loader, "batch_sampler", None)
        sampler = getattr(batch_sampler, "sampler", None)
        batch_size = getattr(batch_sampler, "batch_size", None)
        if not isinstance(sampler, ResumableSampler) or not isinstance(batch_size, int):
            raise TypeError(
                "ResumableLoader needs a DataLoader built with sampler=ResumableSampler(...) "
                "and batch_size=N (or batch_sampler=BatchSampler(ResumableSampler(...), N, "
                "drop_last)); for other samplers use torchdata's StatefulDataLoader")
        if getattr(loader, "in_order", True) is False:
            raise ValueError("ResumableLoader needs in-order batches (in_order=True)")
        self.loader = loader
        self.sampler = sampler
        self.batch_size = batch_size
        sampler._counted = True
        self._private_generator = loader.generator is None
        if self._private_generator:
            loader.generator = torch.Generator()

    def __iter__(self) -> Iterator[Any]:
        sampler = self.sampler
        if self._private_generator:
            self.loader.generator.manual_seed(_epoch_seed(sampler.seed, sampler.epoch))
        epoch = sampler.epoch
        for batch in self.loader:
            if sampler.epoch != epoch:
                return  # another iterator of this loader moved the position on
            sampler.advance(self.batch_size)
            yield batch
            if sampler.epoch != epoch:
                return  # the position reached the end of the epoch
        if sampler.epoch == epoch:
            sampler.end_epoch()  # drop_last left a partial batch unused

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self.sampler.epoch

    def state_dict(self) -> dict[str, int]:
        """The sampler's position after the batches the loop consumed (plain ints)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (the next ``iter()`` starts there)."""
        self.sampler.load_state_dict(state)


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit seed per (seed, epoch), for the loader's private generator."""
    digest = hashlib.blake2b(f"ckpt-loader/{seed}/{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
