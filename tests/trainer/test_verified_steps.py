"""Verified checkpoints in the elastic trainer: a checkpoint is marked verified only once the
steps after it were judged healthy, and the health rollback and a resume go to the newest
verified step; a resume after a stop checkpoint (the end of fit, SIGTERM) takes that one,
and a rollback in its window still goes to the newest verified step.

The job is test_health's (a small MLP, 400 samples, global batch 8, a checkpoint every 5
steps) with the default verified window, 4 steps. The loss of step 12, two steps after the
checkpoint of step 10, is NaN: step 10's window (11-14) never completes, so it is never
verified, and the rollback goes to step 5 (verified at step 9), not to step 10. The same on
two torchrun ranks, where only rank 1 sees the NaN: test_health.py's
test_two_ranks_agree_to_roll_back_when_one_rank_sees_nan.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt._format.sealed import sealed_json
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


def verified_trainer(root: Path, tmp_path: Path, step_fn=None, **config) -> ElasticTrainer:
    config.setdefault("health", HealthGuard(window=20, min_history=5))
    config.setdefault("checkpoint", CheckpointConfig())  # the default window
    return ElasticTrainer(model_fn, lambda p: torch.optim.SGD(p, lr=0.1), Blobs(),
                          step_fn or make_step_fn("nan", marked=NAN_SAMPLE),
                          checkpoint_root=root,
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

    # A new fit resumes from step 20, the first one's stop checkpoint (every step before it
    # was judged healthy), not the verified step 15; step 20 then waits for its own window.
    caplog.clear()
    again = verified_trainer(root, tmp_path, hooks=Hooks())
    try:
        again.fit(STEPS + WINDOW)
    finally:
        again.close()
    assert restored_step(root) == 20
    assert [e["step"] for e in event_lines(caplog, "train.verified")] == ["20"]
    assert markers(root)[20].verification.evidence["confirmed_at"] == STEPS + WINDOW


def restored_step(root: Path) -> int:
    """The step the newest attempt resumed from (its rank 0's ``restored`` record)."""
    newest = sorted((root / ".elastic").glob("attempt-*"))[-1] / "rank-00000.jsonl"
    [restored] = [r for r in read_jsonl(newest) if r["event"] == "restored"]
    return restored["step"]


def preempting(step_fn, at: int, holder: list):
    """``step_fn`` that sends this process SIGTERM once, during step ``at`` of the first
    trainer in ``holder``: the trainer finishes the step, checkpoints it and exits."""
    sent: list[int] = []

    def fn(model, batch):
        if not sent and len(holder) == 1 and holder[0].step + 1 == at:
            sent.append(at)
            os.kill(os.getpid(), signal.SIGTERM)
        return step_fn(model, batch)
    return fn


@pytest.mark.parametrize("at", [8, 10], ids=["between-saves", "on-a-scheduled-save"])
def test_a_preempted_run_resumes_from_its_stop_checkpoint_and_loses_no_step(tmp_path, at):
    """SIGTERM during step ``at``: the checkpoint of ``at`` (taken on the way out, or the
    scheduled save of step 10) is the stop checkpoint, newer than the newest verified step
    (0, or 5 once its window 6-9 passed); the next attempt resumes from ``at`` all the same
    and ends bit-identical to an uninterrupted run."""
    step_fn = make_step_fn(None)
    reference = verified_trainer(tmp_path / "reference", tmp_path / "reference",
                                 step_fn=step_fn)
    reference.fit(STEPS // 2)
    reference.close()
    holder: list[ElasticTrainer] = []
    root = tmp_path / "ckpt"
    holder.append(verified_trainer(root, tmp_path, step_fn=preempting(step_fn, at, holder)))
    with pytest.raises(SystemExit):
        holder[0].fit(STEPS // 2)
    holder[0].close()
    assert max(markers(root)) == at and markers(root)[at].status == "unverified"
    verified = [s for s, m in markers(root).items() if m.status == "verified"]
    assert verified == ([0] if at < 9 else [0, 5])  # 5's window ends with step 9
    holder.append(verified_trainer(root, tmp_path, step_fn=step_fn))
    try:
        holder[1].fit(STEPS // 2)
    finally:
        holder[1].close()
    assert restored_step(root) == at
    for k, v in holder[1].module.state_dict().items():
        assert torch.equal(v, reference.module.state_dict()[k]), k


def test_a_nan_after_resuming_from_a_stop_checkpoint_rolls_back_to_the_verified_step(
        tmp_path, caplog):
    """SIGTERM during step 12 (step 5 verified at 9, step 10 saved): the next attempt
    resumes from the stop checkpoint 12. The loss of step 14 is NaN, inside 12's window:
    12 is left unverified and the rollback goes to the newest verified step, 5."""
    caplog.set_level(logging.INFO, logger="ckpt.trainer")
    nan_at_14 = make_step_fn("nan", marked=no_failure_order(14)[-1][-1])
    holder: list[ElasticTrainer] = []
    root = tmp_path / "ckpt"
    holder.append(verified_trainer(root, tmp_path, step_fn=preempting(nan_at_14, 12, holder)))
    with pytest.raises(SystemExit):
        holder[0].fit(STEPS)
    holder[0].close()
    caplog.clear()
    holder.append(verified_trainer(root, tmp_path, step_fn=nan_at_14))
    try:
        summary = holder[1].fit(STEPS)
    finally:
        holder[1].close()
    assert summary.final_step == STEPS and math.isfinite(summary.final_loss)
    [resume] = event_lines(caplog, "train.resume")
    assert resume["step"] == "12"
    [unverified] = event_lines(caplog, "train.unverified")
    assert (unverified["step"], unverified["at_step"]) == ("12", "14")
    [rollback] = event_lines(caplog, "train.rollback")
    assert (rollback["step"], rollback["restored_step"]) == ("14", "5")


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


def crashing(step_fn, at: int, holder: list):
    """``step_fn`` that raises during step ``at`` of the newest trainer in ``holder``."""
    def fn(model, batch):
        if holder[-1].step + 1 == at:
            raise ValueError("the node went away")
        return step_fn(model, batch)
    return fn


def test_an_attempt_that_crashes_after_resuming_from_a_stop_checkpoint_is_not_trusted_again(
        tmp_path):
    """Attempt 0 is preempted at step 8; attempt 1 resumes from 8 and crashes at step 10,
    inside 8's window: attempt 2 resumes from the verified step 0, as after any crash in a
    window (only the attempt right after the one that took it resumes from a stop
    checkpoint)."""
    root, step_fn, holder = tmp_path / "ckpt", make_step_fn(None), []
    holder.append(verified_trainer(root, tmp_path, step_fn=preempting(step_fn, 8, holder)))
    with pytest.raises(SystemExit):
        holder[0].fit(STEPS)
    holder[0].close()
    holder.append(verified_trainer(root, tmp_path, step_fn=crashing(step_fn, 10, holder)))
    with pytest.raises(ValueError, match="went away"):
        holder[1].fit(STEPS)
    holder[1].close()
    assert restored_step(root) == 8
    holder.append(verified_trainer(root, tmp_path, step_fn=step_fn))
    try:
        holder[2].fit(9)
    finally:
        holder[2].close()
    assert restored_step(root) == 0


@pytest.mark.parametrize("forged,resumed,said", [
    ({"attempt": 0, "reason": "finished"}, 10, "is the finished stop checkpoint of attempt 0"),
    ({"attempt": "0", "reason": "finished"}, 5, "carries an invalid 'trainer_stop'"),
    ({"attempt": 7, "reason": "preempted"}, 5, "not of the previous one"),
], ids=["well-formed", "attempt-not-int", "other-attempt"])
def test_a_forged_stop_record_is_named_in_the_log(tmp_path, caplog, forged, resumed, said):
    """The attacker: whoever can write the root edits the stop record into the manifest of
    step 10, the newest step of an attempt that crashed at step 12 (inside 10's window; 5
    is verified). A malformed record, or one of another attempt, is refused with a log line
    (the resume goes to 5); a well-formed one is resumed from, and the log says so. Either
    way step 10 still waits for its window: nothing is marked verified without it."""
    caplog.set_level(logging.INFO, logger="trainer.elastic")
    root, step_fn, holder = tmp_path / "ckpt", make_step_fn(None), []
    holder.append(verified_trainer(root, tmp_path, step_fn=crashing(step_fn, 12, holder)))
    with pytest.raises(ValueError, match="went away"):
        holder[0].fit(STEPS)
    holder[0].close()
    manifest = root / "step-00000010" / "manifest.json"
    doc = json.loads(manifest.read_text())
    assert "trainer_stop" not in doc["metadata"]
    doc["metadata"]["trainer_stop"] = forged
    manifest.write_bytes(sealed_json(doc))  # an attacker computes the digest as well
    caplog.clear()
    holder.append(verified_trainer(root, tmp_path, step_fn=step_fn))
    try:
        holder[1].fit(11)
    finally:
        holder[1].close()
    assert restored_step(root) == resumed
    assert any(said in r.getMessage() for r in caplog.records), said
    assert markers(root)[10].status == "unverified"
