"""The retention policy: keep_last, keep_every and keep_best together (each adds steps), and
the newest step always kept."""

from __future__ import annotations

import torch

import ckpt
from ckpt._manager.manager import retention


def test_each_rule_adds_its_steps_and_the_newest_is_always_kept(tmp_path):
    with ckpt.CheckpointManager(tmp_path, async_save=False, keep_last=2, keep_every=4,
                                keep_best=1, best_metric="loss") as mgr:
        for step in range(1, 11):
            mgr.save(step, {"w": torch.full((4,), float(step))},
                     metrics={"loss": abs(step - 3) + 0.5})
        # last 2: 9, 10; every 4th: 4, 8; the best loss: 3
        assert mgr.steps() == [3, 4, 8, 9, 10]
    with ckpt.CheckpointManager(tmp_path / "best", async_save=False, keep_best=1,
                                best_metric="loss") as mgr:
        for step in range(1, 5):
            mgr.save(step, {"w": torch.zeros(2)}, metrics={"loss": float(step)})
        assert mgr.steps() == [1, 4]  # the best, and the newest (not by count: no keep_last)


def test_without_keep_last_or_keep_best_every_step_is_kept():
    steps = list(range(1, 11))
    assert retention(steps, None, 4) == set(steps)
    assert retention(steps, 3, None) == {8, 9, 10}
    assert retention(steps, 1, 5, newest=10, best={2}) == {2, 5, 10}


def test_keep_last_zero_keeps_none_by_count():
    """``ckpt gc --keep-last 0`` (the manager refuses 0): only keep_every's steps, and the
    newest when given (``steps[-0:]`` would have been every step)."""
    steps = list(range(1, 7))
    assert retention(steps, 0, None) == set()
    assert retention(steps, 0, 3) == {3, 6}
    assert retention(steps, 0, None, newest=6) == {6}


def test_keep_last_above_the_number_of_steps_keeps_them_all():
    """``steps[len(steps) - 3:]`` of two steps is the last one alone: a manager with
    keep_last=3 retired its first step on the second's commit (tests/test_health.py's
    rollback found no step before the NaN one), and ``ckpt gc --keep-last 5`` of three steps
    retired the oldest (that bug predates the rule's move into retention())."""
    assert retention([0, 5], 3, None, newest=5) == {0, 5}
    assert retention([1, 2, 3], 5, None) == {1, 2, 3}
    assert retention([1, 2, 3], 3, None) == {1, 2, 3}
