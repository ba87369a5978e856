"""Rank bodies for test_mutation_guards3.py (top-level functions: spawn imports them by name)."""

from __future__ import annotations

import torch

import ckpt
from ckpt._save.engine import Stager
from _scale_workers import Blob


def save_keys_in_rank_order_recording_staged(rank: int, world: int, root: str) -> dict:
    """A format-1 save whose ranks disagree on their per-rank items is tried first. Then
    save a replicated tensor and two per-rank items, rank 1 listing the state's keys in
    the opposite order, recording the tensors each rank stages to host; then restore."""
    torch.manual_seed(100 + rank)
    blob = Blob(rank, 16)
    saved = blob.value
    items = [("w", torch.arange(4096.0)), ("rng", ckpt.RNGState()),
             ("blob", ckpt.PerRank(blob))]
    state = dict(items if rank == 0 else reversed(items))
    staged: list[str] = []
    original = Stager.stage

    def recording(self, tensors, *args, **kwargs):
        staged.extend(tensors)
        return original(self, tensors, *args, **kwargs)

    mismatch = None
    with ckpt.CheckpointManager(root, async_save=False,
                                options=ckpt.SaveOptions(rank_tables=False)) as mgr:
        try:  # format 1, rank 1 without its per-rank Blob: refused on every rank, by name
            mgr.save(5, state if rank == 0 else {k: state[k] for k in ("w", "rng")},
                     force=True)
        except ckpt.CheckpointError as e:
            mismatch = str(e)
    Stager.stage = recording
    try:
        with ckpt.CheckpointManager(root, async_save=False) as mgr:
            mgr.save(1, state, force=True)
    finally:
        Stager.stage = original
    want = torch.rand(3)
    torch.manual_seed(999)
    blob.value = ""
    state["w"] = torch.zeros(4096)
    with ckpt.CheckpointManager(root) as mgr:
        step = mgr.restore(state)
    return {"mismatch": mismatch, "step": step, "staged": sorted(staged),
            "rng_exact": bool(torch.rand(3).equal(want)), "blob_exact": blob.value == saved,
            "w_exact": bool(state["w"].equal(torch.arange(4096.0)))}


def load_where_one_rank_refuses_pickle(rank: int, world: int, root: str) -> str:
    """Save one step holding a pickled value; rank 1 then loads without ``allow_pickle``
    (its own refusal is fatal), rank 0 with it. What each rank's ``load()`` raised."""
    with ckpt.CheckpointManager(root, async_save=False, allow_pickle=True) as mgr:
        mgr.save(1, {"w": torch.arange(8.0), "odd": {1, 2}}, force=True)
    with ckpt.CheckpointManager(root, read_only=True, allow_pickle=rank == 0) as mgr:
        try:
            mgr.load()
        except ckpt.CheckpointError as e:
            return f"{type(e).__name__}: {e}"
    return "loaded"


def save_an_item_only_rank_1_holds(rank: int, world: int, root: str) -> dict:
    """Rank 1 saves an item (a plain value and a tensor) rank 0 does not have: refused on
    every rank, by name, in both formats, nothing committed; the same keys everywhere save."""
    state = {"w": torch.ones(8)}
    if rank == 1:
        state.update(extra={"lr": 0.5}, t1=torch.arange(3.0))
    refused = []
    for tables in (False, True):
        with ckpt.CheckpointManager(root, async_save=False,
                                    options=ckpt.SaveOptions(rank_tables=tables)) as mgr:
            try:
                mgr.save(1, state, force=True)
                refused.append(None)
            except ckpt.CheckpointError as e:
                refused.append(str(e))
            steps = mgr.steps()
    return {"refused": refused, "steps": steps}
