"""Retention and verified steps: whatever the rules, the newest verified step stays (with its
marker, and for an incremental step the files of its bases), in the manager's retention and
in ``ckpt gc``; older verified steps go like any other."""

from __future__ import annotations

import os

import torch

import ckpt
from verify.cli import main as cli


def state(value: float, n: int = 4) -> dict:
    return {"w": torch.full((n,), value), "frozen": torch.arange(64, dtype=torch.float32)}


def marker(root, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}", "verified.json")


def test_keep_last_one_keeps_the_newest_verified_step(tmp_path):
    root = str(tmp_path / "r")
    with ckpt.CheckpointManager(root, keep_last=1, async_save=False) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
        mgr.mark_verified(2, {"window": 2})
        mgr.save(3, state(3))
        mgr.save(4, state(4))
        assert mgr.steps() == [2, 4]
        assert mgr.verified_steps() == [2] and os.path.exists(marker(root, 2))
        mgr.mark_verified(4)
        mgr.save(5, state(5))           # 2 is no longer the newest verified step: it goes
        assert mgr.steps() == [4, 5] and mgr.verified_steps() == [4]
        assert not os.path.exists(os.path.join(root, "step-00000002"))
        target = state(-1)
        assert mgr.restore(target, prefer="verified") == 4 and target["w"][0] == 4


def test_an_incremental_verified_step_keeps_the_files_of_its_base(tmp_path):
    root = str(tmp_path / "r")
    options = ckpt.SaveOptions(incremental=True, full_every=100)
    with ckpt.CheckpointManager(root, keep_last=1, async_save=False, options=options) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))                        # "frozen" reused from step 1's files
        mgr.mark_verified(2)
        mgr.save(3, state(3))
        mgr.save(4, state(4))
        assert mgr.steps() == [2, 4]                 # step 1 retired, its files referenced
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        target = state(-1)
        target["frozen"].zero_()
        assert mgr.restore(target, prefer="verified") == 2
        assert torch.equal(target["frozen"], torch.arange(64, dtype=torch.float32))


def test_gc_keeps_the_newest_verified_step(tmp_path, capsys):
    root = str(tmp_path / "r")
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        for s in (1, 2, 3, 4):
            mgr.save(s, state(s))
        mgr.mark_verified(1)
        mgr.mark_verified(2)
    assert cli(["gc", root, "--keep-last", "1", "--yes"]) == 0
    capsys.readouterr()
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        assert mgr.steps() == [2, 4] and mgr.verified_steps() == [2]
