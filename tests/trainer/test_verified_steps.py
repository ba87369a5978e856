"""Verified checkpoints in the elastic trainer: a checkpoint is marked verified only once the
steps after it were judged healthy, and the health rollback and a resume go to the newest
verified step.

The job is test_health's (a small MLP, 400 samples, global batch 8, a checkpoint every 5
steps) with a verified window of 3 steps. The loss of step 12, two steps after the
checkpoint of step 10, is NaN: step 10's window (11, 12, 13) never completes, so it is never
verified, and the rollback goes to step 5 (verified at step 8), not to step 10.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt
from tests.trainer.test_health import (EVERY, GLOBAL, MICRO, Blobs, event_lines,
                                       make_step_fn, model_fn, no_failure_order, observed,
                                       plain_process)
from trainer import CheckpointConfig, ElasticConfig, Hooks
from trainer.elastic import ElasticTrainer, read_jsonl
from trainer.health import HealthGuard, HealthyWindow, Verdict

__all__ = ["plain_process"]  # the autouse fixture: no torchrun variables in this process

WINDOW, NAN_STEP, STEPS = 3, 12, 20
TORCHRUN_STEPS = 15
NAN_BATCH = no_failure_order(NAN_STEP)[-1]
NAN_SAMPLE = NAN_BATCH[-1]  # in rank 1's half of the batch on two ranks


def verified_trainer(root: Path, tmp_path: Path, **config) -> ElasticTrainer:
    config.setdefault("health", HealthGuard(window=20, min_history=5))
    config.setdefault("checkpoint", CheckpointConfig(verified_window=WINDOW))
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
    assert ("10", str(NAN_STEP)) not in verified and ("10", "13") in verified, verified
    assert ("5", "8") in verified

    # On disk: step 10 is the new timeline's save (verified at 13); the final step 20 has
    # no steps after it; retention (keep_last=3) kept the newest verified step, 15.
    state = markers(root)
    assert sorted(state) == [10, 15, 20]
    assert state[10].verification.evidence["confirmed_at"] == 13
    assert state[15].status == "verified" and state[20].status == "unverified"
    evidence = state[15].verification.evidence
    assert evidence["window"] == WINDOW and evidence["confirmed_at"] == 18
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


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_ranks_roll_back_to_the_verified_step_when_one_rank_sees_nan(tmp_path):
    """torchrun, 2 ranks: only rank 1 computes the NaN of step 12; both go back to step 5,
    rank 0 wrote the markers (step 10's new save verified at 13, the old one never)."""
    assert NAN_BATCH.index(NAN_SAMPLE) >= GLOBAL // 2  # rank 1's share
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo)
    for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--log-dir={tmp_path / 'torchelastic'}", "--nproc-per-node=2", __file__,
           str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    summary = json.loads(next(line for line in proc.stdout.splitlines()
                              if line.startswith("SUMMARY "))[len("SUMMARY "):])
    assert (summary["final_step"], summary["rollbacks"]) == (TORCHRUN_STEPS, 1)
    for rank in (0, 1):
        [rb] = [r for r in read_jsonl(tmp_path / "ckpt" / ".elastic" / "attempt-0000" /
                                      f"rank-{rank:05d}.jsonl") if r["event"] == "rollback"]
        assert (rb["step"], rb["restored_step"]) == (NAN_STEP, 5)
    state = markers(tmp_path / "ckpt")
    assert state[10].verification.evidence["confirmed_at"] == 13
    assert state[5].status == "verified" and state[15].status == "unverified"


if __name__ == "__main__":  # one torchrun worker of the two-rank test
    logging.basicConfig(level=logging.WARNING)
    out = Path(sys.argv[1])
    job = verified_trainer(out / "ckpt", out, checkpoint=CheckpointConfig(
        verified_window=WINDOW, memory_tier=False))
    result = job.fit(TORCHRUN_STEPS)
    job.close()
    if int(os.environ.get("RANK", "0")) == 0:
        print("SUMMARY " + json.dumps(result.to_dict()), flush=True)
