"""A bit flipped in a step's manifest or rank document in the memory tier is reported as
damage (with what happens next and what to do), not as a step another job wrote: the
document's own digest (``ckpt/_format/sealed.py``) is checked before its tag."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import ckpt
from ckpt._memory.auth import KEY_NAME
from ckpt._memory.discovery import local_holdings
from ckpt._memory.tier import RANK_DOC, private_path
from tests.memory.test_memory_tier import flip  # one bit in the middle of a file
from tests.support import memory_auth_workers
from tests.support.ranks import run_ranks


def test_a_flipped_bit_in_a_steps_manifest_in_memory_is_reported_as_damage(tmp_path):
    """A single process's step whose manifest in memory has a flipped bit: the restore gives
    up the memory copy saying it was damaged (not that another job wrote it), and takes the
    same step from the root."""
    shm = tmp_path / "shm"
    shm.mkdir()
    tier = ckpt.MemoryTierOptions(shm_dir=str(shm), node="n0", job="j")
    with ckpt.CheckpointManager(tmp_path / "root", memory_tier=tier) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((8,), float(step))})
        mgr.wait()
        flip(os.path.join(mgr._publisher.tier.path, "step-00000002", "manifest.json"))
        state = {"w": torch.zeros(8)}
        assert mgr.restore(state) == 2
        info = mgr.last_restore
    assert info.tier == "storage" and torch.equal(state["w"], torch.full((8,), 2.0))
    [(step, where, why)] = info.skipped
    assert (step, where) == (2, "memory")
    assert "damaged in memory" in why and "digest" in why and "not this job's" not in why


@pytest.mark.multiproc
def test_a_flipped_bit_in_a_rank_steps_document_is_reported_as_damage(tmp_path, caplog):
    """Two ranks' rank steps in memory; one bit flipped in rank 0's newest ``rank.json``:
    discovery skips that step with a warning that says it was damaged, not another job's,
    and still lists the others."""
    shm = tmp_path / "shm"
    shm.mkdir()
    root = tmp_path / "root"
    run_ranks(2, memory_auth_workers.save, str(root), str(shm), ["n0", "n0"], [1, 2], 1000)
    segment = os.path.join(private_path(str(shm)), "ckpt-shared-n0-r0")
    doc = os.path.join(segment, "step-00000002", RANK_DOC)
    flip(doc)
    key = (root / KEY_NAME).read_bytes()
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        held = local_holdings(private_path(str(shm)), "shared", "n0", key=key)
    assert sorted((h.origin, h.step) for h in held) == [(0, 1), (1, 1), (1, 2)]
    [warning] = [r.getMessage() for r in caplog.records if doc in r.getMessage()]
    assert "damaged in memory" in warning and "not this job's" not in warning
