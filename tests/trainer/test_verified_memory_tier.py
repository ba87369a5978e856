"""Verified checkpoints with the memory tier on: the trainer's defaults (a verified window of
4 steps, every save also persisted to the root) still roll back to the newest verified step,
read from the node's memory; with ``persist_every=2`` the saves kept in memory only are
never verified (their marker would need the step in the root), so a rollback passes over
the newer memory-only save for the newest verified persisted one.

The job is test_verified_steps' (test_health's MLP, a checkpoint every 5 steps).
"""

from __future__ import annotations

import logging
import re

import ckpt
from tests.trainer.test_health import event_lines, make_step_fn, no_failure_order
from tests.trainer.test_verified_steps import markers, plain_process, verified_trainer
from trainer import CheckpointConfig

__all__ = ["plain_process"]  # the autouse fixture: no torchrun variables in this process


def restores(caplog) -> list[tuple[int, str]]:
    """(step, tier) of each ``ckpt.restore`` line, in order."""
    found = [re.search(r"ckpt\.restore step=(\d+) tier=(\w+)", r.getMessage())
             for r in caplog.records if r.name == "ckpt"]
    return [(int(m[1]), m[2]) for m in found if m]


def fit_with_nan(tmp_path, caplog, nan_step: int, persist_every: int, steps: int):
    caplog.set_level(logging.INFO, logger="ckpt.trainer")
    caplog.set_level(logging.INFO, logger="ckpt")
    caplog.set_level(logging.INFO, logger="trainer.elastic")
    shm = tmp_path / "shm"
    shm.mkdir()
    memory = ckpt.MemoryTierOptions(shm_dir=str(shm), job=f"verified-{persist_every}",
                                    persist_every=persist_every)
    t = verified_trainer(tmp_path / "ckpt", tmp_path,
                         make_step_fn("nan", marked=no_failure_order(nan_step)[-1][-1]),
                         checkpoint=CheckpointConfig(memory_tier=True, memory_options=memory))
    try:
        return t.fit(steps)
    finally:
        t.close()


def test_defaults_with_the_memory_tier_roll_back_to_the_verified_step_from_memory(
        tmp_path, caplog):
    """NaN at 12, two steps after the save of 10: 10 is never verified; the rollback takes
    5 (verified at 9) from this node's memory."""
    summary = fit_with_nan(tmp_path, caplog, nan_step=12, persist_every=1, steps=15)
    assert (summary.final_step, summary.rollbacks) == (15, 1)
    [rollback] = event_lines(caplog, "train.rollback")
    assert (rollback["step"], rollback["restored_step"]) == ("12", "5")
    assert (5, "memory") in restores(caplog)
    assert ("5", "9") in [(e["step"], e["confirmed_at"])
                          for e in event_lines(caplog, "train.verified")]
    assert markers(tmp_path / "ckpt")[10].verification.evidence["confirmed_at"] == 14


def test_memory_only_saves_are_never_verified_and_a_rollback_passes_over_them(
        tmp_path, caplog):
    """persist_every=2: 10 and 20 go to the root, 5 and 15 stay in memory. 5 is confirmed
    at 9 but cannot be marked (logged); 10 is verified at 14; NaN at 17 keeps 15 unverified,
    and the rollback takes 10, not the newer memory-only 15."""
    summary = fit_with_nan(tmp_path, caplog, nan_step=17, persist_every=2, steps=18)
    assert (summary.final_step, summary.rollbacks) == (18, 1)
    assert any("step 5 was confirmed healthy but is not in the root" in r.getMessage()
               for r in caplog.records)
    [rollback] = event_lines(caplog, "train.rollback")
    assert (rollback["step"], rollback["restored_step"]) == ("17", "10")
    assert restores(caplog)[-1] == (10, "memory")
    verified = [e["step"] for e in event_lines(caplog, "train.verified")]
    assert "5" not in verified and "15" not in verified and "10" in verified
