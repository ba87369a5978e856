"""Verified checkpoints in the elastic trainer: a checkpoint is marked verified only once the
steps after it were judged healthy, and the health rollback and a resume go to the newest
verified step.

The job is test_health's (a small MLP, 400 samples, global batch 8, a checkpoint every 5
steps) with the default verified window, 4 steps. The loss of step 12, two steps after the
checkpoint of step 10, is NaN: step 10's window (11-14) never completes, so it is never
verified, and the rollback goes to step 5 (verified at step 9), not to step 10. The same on
two torchrun ranks, where only rank 1 sees the NaN: test_health.py's
test_two_ranks_agree_to_roll_back_when_one_rank_sees_nan.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

import ckpt
from tests.trainer.test_health import (EVERY, GLOBAL, MICRO, Blobs, event_lines,
                                       make_step_fn, model_fn, no_failure_order, observed,
                                       plain_process)
from trainer import CheckpointConfig, ElasticConfig, Hooks
from trainer.checkpointing import DEFAULT_VERIFIED_WINDOW
from trainer.elastic import ElasticTrainer, read_jsonl
from trainer.health import HealthGuard, HealthyWindow, Verdict

__all__ = ["plain_process"]  # the autouse fixture: no torchrun variables in this process

WINDOW, NAN_STEP, STEPS = DEFAULT_VERIFIED_WINDOW, 12, 20
NAN_SAMPLE = no_failure_order(NAN_STEP)[-1][-1]


def verified_trainer(root: Path, tmp_path: Path, **config) -> ElasticTrainer:
    config.setdefault("health", HealthGuard(window=20, min_history=5))
    config.setdefault("checkpoint", CheckpointConfig())  # the default window
    return ElasticTrainer(model_fn, lambda p: torch.optim.SGD(p, lr=0.1), Blobs(),
                          make_step_fn("nan", marked=NAN_SAMPLE), checkpoint_root=root,
                          checkpoint_every=EVERY, global_batch_size=GLOBAL,
                          micro_batch_size=MICRO,
                          config=ElasticConfig(observability=observed(tmp_path), **config))


def markers(root: Path) -> dict[int, ckpt.inspect.MarkerState]:
    cps = ckpt.inspect.open(str(root))
    return {s: cps.marker(s) for s in cps.steps()}


def test_a_save_with_a_nan_two_steps_later_is_never_verified_and_the_rollback_skips_it(
        tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ckpt.trainer")
    root = tmp_path / "ckpt"
    t = verified_trainer(root, tmp_path)
    try:
        summary = t.fit(STEPS)
    finally:
        t.close()
    assert (summary.final_step, summary.rollbacks) == (STEPS, 1)
    assert math.isfinite(summary.final_loss)

    [unverified] = event_lines(caplog, "train.unverified")
    assert (unverified["step"], unverified["at_step"]) == ("10", str(NAN_STEP))
    [rollback] = event_lines(caplog, "train.rollback")
    assert (rollback["step"], rollback["restored_step"]) == (str(NAN_STEP), "5")
    verified = [(e["step"], e["confirmed_at"]) for e in event_lines(caplog, "train.verified")]
    assert ("10", str(NAN_STEP)) not in verified and ("10", "14") in verified, verified
    assert verified.count(("5", "9")) == 1  # restored already verified: not marked again

    # On disk: step 10 is the new timeline's save (verified at 14); the final step 20 has
    # no steps after it; retention (keep_last=3) kept the newest verified step, 15.
    state = markers(root)
    assert sorted(state) == [10, 15, 20]
    assert state[10].verification.evidence["confirmed_at"] == 14
    assert state[15].status == "verified" and state[20].status == "unverified"
    evidence = state[15].verification.evidence
    assert evidence["window"] == WINDOW == 4 and evidence["confirmed_at"] == 19
    assert "nonfinite_loss" in evidence["checks"] and math.isfinite(evidence["max_loss"])

    # A new run resumes from the newest verified step, not the newest step.
    again = verified_trainer(root, tmp_path, hooks=Hooks())
    try:
        again.fit(STEPS + 1)
    finally:
        again.close()
    newest = sorted((root / ".elastic").glob("attempt-*"))[-1] / "rank-00000.jsonl"
    [restored] = [r for r in read_jsonl(newest) if r["event"] == "restored"]
    assert restored["step"] == 15


@pytest.mark.parametrize("off", [{"health": None}, {"health": False},
                                 {"checkpoint": CheckpointConfig(verified_window=None)}],
                         ids=["no-guard", "guard-false", "window-none"])
def test_without_a_guard_or_a_window_nothing_is_verified_and_restores_take_the_newest(
        tmp_path, caplog, off):
    """No health guard (no verdicts, so no window whatever verified_window says, and no
    error), or verified_window=None: no marker is written and a resume restores the newest
    step. Healthy steps only (the NaN sample comes at step 12)."""
    caplog.set_level(logging.INFO, logger="ckpt.trainer")
    root = tmp_path / "ckpt"
    for steps in (8, 9):  # the second run resumes from the first one's final step 8
        t = verified_trainer(root, tmp_path, **off)
        try:
            t.fit(steps)
        finally:
            t.close()
    assert not event_lines(caplog, "train.verified")
    assert all(m.status == "unverified" for m in markers(root).values()), markers(root)
    newest = sorted((root / ".elastic").glob("attempt-*"))[-1] / "rank-00000.jsonl"
    [restored] = [r for r in read_jsonl(newest) if r["event"] == "restored"]
    assert restored["step"] == 8


def test_the_window_confirms_a_save_after_its_healthy_steps_only():
    guard = HealthGuard(min_history=1, grad_norm_limit=10.0)
    window = HealthyWindow(2, guard)

    def judge(step: int, loss: float = 1.0, norm: float = 1.0):
        return window.observe(guard.observe(step, loss, norm))

    window.saved(5)
    assert judge(6) == ([], [])
    confirmed, _ = judge(7)
    assert [s for s, _ in confirmed] == [5] and confirmed[0][1]["confirmed_at"] == 7
    window.saved(10)
    assert judge(11, norm=50.0) == ([], [10])            # accepted, but over the limit
    window.saved(15)
    assert judge(16, loss=float("nan")) == ([], [15])    # a bad step drops it
    window.saved(20)
    window.saved(25)
    window.rewind(20)                                     # a rollback to 20
    assert window.pending == [20]
    with pytest.raises(ValueError):
        HealthyWindow(0, guard)
    with pytest.raises(ValueError):
        HealthGuard(grad_norm_limit=float("inf"))
    assert Verdict(1, True, "ok", 1.0, None).ok
