"""The retention policy: keep_last, keep_every and keep_best together (each adds steps), the
newest good step always kept, and the record a manager leaves for ``ckpt gc``."""

from __future__ import annotations

import json
import math

import pytest
import torch

import ckpt
from ckpt._retention.policy import RECORD_KEY, KeepBest, RetentionPolicy


def kept(steps, keep_last=None, keep_every=None, best=None, *, metrics=None, newest=None):
    return RetentionPolicy(keep_last, keep_every, best).retained(steps, metrics, newest=newest)


def test_each_rule_adds_its_steps_and_the_newest_is_always_kept(tmp_path):
    policy = RetentionPolicy(keep_last=2, keep_every=4, keep_best=KeepBest(1, "loss"))
    with ckpt.CheckpointManager(tmp_path, async_save=False, retention=policy) as mgr:
        for step in range(1, 11):
            mgr.save(step, {"w": torch.full((4,), float(step))},
                     metrics={"loss": abs(step - 3) + 0.5})
        # last 2: 9, 10; every 4th: 4, 8; the best loss: 3
        assert mgr.steps() == [3, 4, 8, 9, 10]
    with ckpt.CheckpointManager(tmp_path / "best", async_save=False, retention=RetentionPolicy(
            keep_best=KeepBest(1, "loss"))) as mgr:
        for step in range(1, 5):
            mgr.save(step, {"w": torch.zeros(2)}, metrics={"loss": float(step)})
        assert mgr.steps() == [1, 4]  # the best, and the newest (not by count: no keep_last)


def test_without_keep_last_or_keep_best_every_step_is_kept():
    steps = list(range(1, 11))
    assert kept(steps, None, 4) == set(steps)
    assert kept(steps, 3, None) == {8, 9, 10}
    best = KeepBest(1, "loss")
    metrics = {s: {"loss": 1.0 if s == 2 else 5.0} for s in steps}
    assert kept(steps, 1, 5, best, metrics=metrics, newest=10) == {2, 5, 10}


def test_keep_last_zero_keeps_none_by_count():
    """``ckpt gc --keep-last 0`` (the manager refuses 0): only keep_every's steps, and the
    newest when given (``steps[-0:]`` would be every step)."""
    steps = list(range(1, 7))
    assert kept(steps, 0, None) == set()
    assert kept(steps, 0, 3) == {3, 6}
    assert kept(steps, 0, None, newest=6) == {6}


def test_keep_last_above_the_number_of_steps_keeps_them_all():
    """``steps[len(steps) - 3:]`` of two steps is the last one alone: keep_last=3 must keep
    both of two steps, and ``ckpt gc --keep-last 5`` all of three."""
    assert kept([0, 5], 3, None, newest=5) == {0, 5}
    assert kept([1, 2, 3], 5, None) == {1, 2, 3}
    assert kept([1, 2, 3], 3, None) == {1, 2, 3}


def test_keep_best_ranks_only_finite_numbers_and_a_tie_keeps_the_newer_step():
    best = KeepBest(2, "acc", "max")
    metrics = {1: {"acc": 0.9}, 2: {"acc": "nan"}, 3: {"acc": True}, 4: {}, 5: {"acc": 0.9},
               6: {"acc": math.inf}, 7: {"acc": 0.5}}
    assert kept(range(1, 8), 0, None, best, metrics=metrics) == {1, 5}
    assert kept(range(1, 8), 0, None, KeepBest(1, "acc", "max"), metrics=metrics) == {5}
    assert kept([1, 2], 0, None, best) == set()  # no metrics at all: nothing ranks


@pytest.mark.parametrize("args, message", [
    ((-1, None, None), "keep_last must be an integer >= 0"),
    ((True, None, None), "keep_last must be an integer >= 0"),
    ((None, 0, None), "keep_every must be a positive integer"),
    ((None, 2.0, None), "keep_every must be a positive integer"),
])
def test_a_policy_refuses_rules_that_are_not_counts(args, message):
    with pytest.raises(ValueError, match=message):
        RetentionPolicy(*args)


def test_keep_best_is_a_positive_count_of_a_named_metric_ranked_min_or_max():
    with pytest.raises(TypeError, match="keep_best must be a KeepBest"):
        RetentionPolicy(1, None, 3)
    with pytest.raises(ValueError, match="best_mode must be 'min' or 'max'"):
        KeepBest(1, "loss", "lowest")
    with pytest.raises(ValueError, match="keep_best must be a positive integer"):
        KeepBest(True, "loss")
    with pytest.raises(ValueError, match="keep_best needs best_metric"):
        KeepBest(1, "")


def test_the_record_round_trips_and_anything_else_is_refused():
    policy = RetentionPolicy(2, 5, KeepBest(1, "val_loss", "max"))
    record = json.loads(json.dumps(policy.to_record()))
    assert RetentionPolicy.from_record(record) == policy
    assert RetentionPolicy.from_record(RetentionPolicy(0).to_record()) == RetentionPolicy(0)
    for bad in (None, [], {**record, "keep_newest": 3}, {"keep_last": 2},
                {**record, "keep_best": {"n": 1}}, {**record, "keep_last": "2"},
                {**record, "keep_best": {"n": 0, "metric": "x", "mode": "min"}}):
        with pytest.raises((ValueError, TypeError)):
            RetentionPolicy.from_record(bad)


def test_a_manager_records_a_policy_that_retires_and_none_that_keeps_all(tmp_path):
    policy = RetentionPolicy(keep_last=2, keep_best=KeepBest(1, "val_loss"))
    with ckpt.CheckpointManager(tmp_path / "a", async_save=False, retention=policy) as mgr:
        mgr.save(1, {"w": torch.zeros(2)}, metadata={"note": "kept"})
        meta = mgr.manifest(1).metadata
    assert meta["note"] == "kept"
    assert RetentionPolicy.from_record(meta[RECORD_KEY]) == policy
    with ckpt.CheckpointManager(tmp_path / "b", async_save=False,
                                retention=RetentionPolicy(keep_every=3)) as mgr:
        mgr.save(1, {"w": torch.zeros(2)})
        assert mgr.retention.keeps_all and RECORD_KEY not in mgr.manifest(1).metadata
