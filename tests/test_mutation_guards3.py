"""Guards found by mutation testing (h-mutate3): each test here kills a one-line mutant of
code landed in this session (format-2 saves that exchange no per-rank values, the manager's
shared fallback and retention, the CLI's checks) that the modules' own tests let survive.
The mutant is named in each docstring; applying it makes the test fail."""

from __future__ import annotations

import pytest

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
