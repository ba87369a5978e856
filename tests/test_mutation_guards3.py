"""Guards found by mutation testing (h-mutate3): each test here kills a one-line mutant of
code landed in this session (format-2 saves that exchange no per-rank values, the manager's
shared fallback and retention, the CLI's checks) that the modules' own tests let survive.
The mutant is named in each docstring; applying it makes the test fail."""

from __future__ import annotations

import pytest
import torch

import ckpt

import _mutation_workers3 as W
from _dist import run_ranks


@pytest.mark.multiproc
def test_per_rank_items_in_another_key_order_save_and_each_rank_stages_only_its_own(tmp_path):
    """Ranks may list the state's keys in any order: the per-rank item names they compare
    are sorted (mutant: ``per_rank = list(...)`` refuses this save), and a save without a
    memory tier stages to host only the boxes a rank writes (mutant: ``held`` without
    ``hold_all and`` stages every rank's copy of the replicated "w"). A format-1 save
    whose ranks disagree on their per-rank items is refused on every rank with a
    CheckpointError that says so (it was a bare KeyError: 'blob')."""
    seen = run_ranks(2, W.save_keys_in_rank_order_recording_staged, str(tmp_path), timeout=120)
    assert not (tmp_path / "step-00000005").exists()
    for rank, s in enumerate(seen):
        assert s["mismatch"] and "different per-rank items" in s["mismatch"], (rank, s)
        assert s["step"] == 1 and s["rng_exact"] and s["blob_exact"] and s["w_exact"], (rank, s)
    stages_w = [rank for rank, s in enumerate(seen) if "w" in s["staged"]]
    assert len(stages_w) == 1, seen  # one writer; the other rank holds no copy of it


@pytest.mark.multiproc
def test_a_rank_whose_peer_fails_for_good_on_load_says_so_and_tries_no_older_step(tmp_path):
    """``load()``: one rank's fatal error (here its refusal to unpickle) stops every rank
    on that step; the others name it (mutant: without ``if fatal: raise`` rank 0 skips the
    step as if it were corrupt and reports "no committed step could be loaded")."""
    got = run_ranks(2, W.load_where_one_rank_refuses_pickle, str(tmp_path), timeout=120)
    assert got[1].startswith("UnsupportedValueError: "), got
    assert got[0].startswith("CheckpointError: another rank failed to load step 1: "
                             "UnsupportedValueError"), got


def _two_steps(root) -> None:
    with ckpt.CheckpointManager(root, async_save=False, allow_pickle=True) as mgr:
        mgr.save(1, {"w": torch.arange(8.0)})
        mgr.save(2, {"w": torch.arange(8.0), "odd": {1, 2}})


def test_load_of_a_named_step_raises_that_steps_own_error_and_skips_nothing(tmp_path):
    """``load(step=...)`` raises the step's own error (mutant: dropping ``step is not None
    or`` skips it, so a missing step reads as CorruptCheckpointError "no committed step ...
    could be loaded", not CheckpointNotFoundError, and is recorded in ``mgr.skipped``)."""
    _two_steps(tmp_path)
    with ckpt.CheckpointManager(tmp_path, read_only=True, allow_pickle=True) as mgr:
        with pytest.raises(ckpt.CheckpointNotFoundError) as caught:
            mgr.load(step=7)
        assert "could be loaded" not in str(caught.value)
        assert mgr.skipped == []


def test_load_raises_this_ranks_fatal_error_as_it_is(tmp_path):
    """Without ``allow_pickle`` the newest step's pickled value is refused with
    UnsupportedValueError, and no older step is tried (mutant: dropping
    ``_describe(error)[0] == "fatal"`` turns it into "another rank failed to load")."""
    _two_steps(tmp_path)
    with ckpt.CheckpointManager(tmp_path, read_only=True) as mgr:
        with pytest.raises(ckpt.UnsupportedValueError) as caught:
            mgr.load()
        assert "another rank" not in str(caught.value) and mgr.skipped == []
