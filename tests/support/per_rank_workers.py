"""Rank bodies for tests/save/test_per_rank_values.py (run by tests.support.ranks.run_ranks)."""

from __future__ import annotations

import torch

import ckpt


def carried_state(rank: int) -> tuple:
    """An LSTM-like (h, c) pair that differs by rank (shapes too), with bits a float compare
    would miss: -0.0 and a NaN payload."""
    g = torch.Generator().manual_seed(100 + rank)
    h = torch.randn(2, 3 + rank, 5, generator=g)
    c = torch.randn(2, 3 + rank, 5, generator=g, dtype=torch.float64)
    h[0, 0, 0] = -0.0
    h.view(torch.int32)[0, 0, 1] = 0x7FC00123  # a NaN with a payload
    return (h, c), 10 * rank + 0.5, f"rank {rank}"


def bits(t: torch.Tensor) -> list[int]:
    return t.reshape(-1).view(torch.uint8).tolist()


def save_and_restore_plain_values(rank: int, world: int, root: str, tables: bool) -> dict:
    """Each rank saves its own plain values in PerRank and restores them into fresh wrappers
    (holding None, or values of another shape): the bits of every rank's own."""
    (h, c), lr, text = carried_state(rank)
    state = {"w": torch.ones(4), "hidden": ckpt.PerRank((h, c)), "lr": ckpt.PerRank(lr),
             "text": ckpt.PerRank(text)}
    opts = ckpt.SaveOptions(rank_tables=tables)
    with ckpt.CheckpointManager(root, async_save=True, options=opts) as mgr:
        mgr.save(3, state, force=True)
        mgr.wait()
    fresh = {"w": torch.zeros(4), "hidden": ckpt.PerRank(None), "lr": ckpt.PerRank(0.0),
             "text": ckpt.PerRank((torch.zeros(1),))}
    with ckpt.CheckpointManager(root, async_save=False, options=opts) as mgr:
        step = mgr.restore(fresh)
    got_h, got_c = fresh["hidden"].value
    return {"step": step, "tuple": isinstance(fresh["hidden"].value, tuple),
            "h": bits(got_h) == bits(h), "c": bits(got_c) == bits(c),
            "dtypes": (got_h.dtype, got_c.dtype), "lr": fresh["lr"].value,
            "text": fresh["text"].value, "w": fresh["w"].tolist()}
