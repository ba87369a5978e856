"""A health rollback past an unverified checkpoint starts a new timeline: the steps it
passed over are the old timeline's, and nothing after the rollback may take them for the
newest state of the job.

The job is test_verified_steps' (test_health's small MLP, a checkpoint every 5 steps, the
default verified window of 4 steps): the loss of step 12 is NaN, so step 10 is never
verified and the rollback goes to step 5. SIGTERM then comes during step 7 of the new
timeline: its stop checkpoint is the newest state of the job, and the next attempt resumes
from it, not from step 5 (the old timeline's step 10 is newer by number but was passed over).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

import ckpt
from tests.trainer.test_health import make_step_fn, no_failure_order, plain_process
from tests.trainer.test_verified_steps import restored_step, verified_trainer
from trainer import CheckpointConfig
from trainer.elastic import ElasticTrainer, read_jsonl

__all__ = ["plain_process"]  # the autouse fixture: no torchrun variables in this process

NAN_STEP, TERM_STEP, STEPS = 12, 7, 20


def preempted_after_rollback(step_fn, holder: list):
    """``step_fn`` that sends this process SIGTERM once, during step ``TERM_STEP`` of the
    first trainer in ``holder`` after its first rollback."""
    sent: list[int] = []

    def fn(model, batch):
        t = holder[0]
        if (not sent and len(holder) == 1 and t.health.rollbacks
                and t.step + 1 == TERM_STEP):
            sent.append(TERM_STEP)
            os.kill(os.getpid(), signal.SIGTERM)
        return step_fn(model, batch)
    return fn


@pytest.mark.parametrize("memory", [False, True], ids=["root", "memory-tier"])
def test_sigterm_after_a_rollback_resumes_from_the_new_timelines_stop_checkpoint(
        tmp_path, memory):
    """The preemption checkpoint of step 7 taken after the rollback (12 -> 5) is what the
    next attempt resumes from, and a plain load of the root returns it: the old timeline's
    step 10 is gone from the root. The resumed job ends with the uninterrupted job's
    weights (the same rollback, no preemption)."""
    nan_at_12 = make_step_fn("nan", marked=no_failure_order(NAN_STEP)[-1][-1])
    shm = tmp_path / "shm"
    shm.mkdir()

    def checkpoint() -> CheckpointConfig:
        return CheckpointConfig(memory_tier=memory, memory_options=ckpt.MemoryTierOptions(
            shm_dir=str(shm), job="rollback-timeline") if memory else None)

    reference = verified_trainer(tmp_path / "reference", tmp_path / "reference",
                                 step_fn=nan_at_12, checkpoint=checkpoint())
    reference.fit(STEPS)
    reference.close()

    root = tmp_path / "ckpt"
    holder: list[ElasticTrainer] = []
    holder.append(verified_trainer(root, tmp_path, checkpoint=checkpoint(),
                                   step_fn=preempted_after_rollback(nan_at_12, holder)))
    with pytest.raises(SystemExit):
        holder[0].fit(STEPS)
    holder[0].close()
    records = read_jsonl(sorted((root / ".elastic").glob("attempt-*"))[-1]
                         / "rank-00000.jsonl")
    [rollback] = [r for r in records if r["event"] == "rollback"]
    assert (rollback["step"], rollback["restored_step"]) == (NAN_STEP, 5)
    assert rollback["retired_steps"] == [10]
    [preempted] = [r for r in records if r["event"] == "preempted"]
    assert preempted["step"] == TERM_STEP
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        assert mgr.latest_step() == TERM_STEP, mgr.steps()

    holder.append(verified_trainer(root, tmp_path, checkpoint=checkpoint(),
                                   step_fn=nan_at_12))
    try:
        holder[1].fit(STEPS)
    finally:
        holder[1].close()
    assert restored_step(root) == TERM_STEP
    for k, v in holder[1].module.state_dict().items():
        assert torch.equal(v, reference.module.state_dict()[k]), k


def test_a_rollback_to_the_newest_step_retires_nothing(tmp_path):
    """Without a verified window the rollback restores the newest good step: there is no
    newer step to retire, and the record says so."""
    nan_at_12 = make_step_fn("nan", marked=no_failure_order(NAN_STEP)[-1][-1])
    t = verified_trainer(tmp_path / "ckpt", tmp_path, step_fn=nan_at_12,
                         checkpoint=CheckpointConfig(verified_window=None))
    try:
        t.fit(STEPS)
    finally:
        t.close()
    records = read_jsonl(Path(tmp_path / "ckpt" / ".elastic" / "attempt-0000"
                              / "rank-00000.jsonl"))
    [rollback] = [r for r in records if r["event"] == "rollback"]
    assert (rollback["restored_step"], rollback["retired_steps"]) == (10, [])


def test_the_summary_counts_the_steps_of_an_attempt_after_its_rollback():
    """An attempt that trained to step 11, rolled back to 5 and was preempted after step 7
    ended at step 7 (not 11, the highest step, of the timeline the rollback undid): resumed
    from 7, it lost no step."""
    from trainer.progress import _attempt_facts, _recovery

    t = iter(range(100))
    ended = [{"event": "start", "world": 1, "rank": 0, "process_start": 0.0, "pid": 1,
              "group_ready": 0.0, "time": next(t)},
             {"event": "restored", "step": 0, "rank": 0, "time": next(t)},
             *({"event": "step", "step": s, "rank": 0, "time": next(t)} for s in range(1, 12)),
             {"event": "rollback", "step": 12, "restored_step": 5, "rank": 0, "time": next(t)},
             *({"event": "step", "step": s, "rank": 0, "time": next(t)} for s in (6, 7)),
             {"event": "preempted", "step": 7, "rank": 0, "time": next(t)}]
    resumed = [{"event": "start", "world": 1, "rank": 0, "process_start": 50.0, "pid": 2,
                "group_ready": 50.0, "time": 50.0},
               {"event": "restored", "step": 7, "rank": 0, "time": 51.0}]
    recovery = _recovery(_attempt_facts(0, ended), _attempt_facts(1, resumed))
    assert (recovery.last_step, recovery.steps_lost) == (7, 0)


def test_a_verified_step_the_rollback_could_not_load_is_not_retired(tmp_path):
    """Step 10 is verified (at 14), then a bit of its data flips on disk; the loss of step 17
    is NaN, inside step 15's window. The rollback skips step 10 (it fails its digests),
    restores step 5 and retires step 15 only: step 10 stays in the root, as the restore
    reported it, for whoever looks into the fault."""
    nan_at_17 = make_step_fn("nan", marked=no_failure_order(17)[-1][-1])
    root = tmp_path / "ckpt"

    def flip_step_10(model, batch):
        if t.step + 1 == 16 and not flipped:
            [data] = (root / "step-00000010").glob("data-*")
            flipped.append(data)
            raw = bytearray(data.read_bytes())
            raw[-1] ^= 0x01
            data.write_bytes(bytes(raw))
        return nan_at_17(model, batch)

    flipped: list[Path] = []
    t = verified_trainer(root, tmp_path, step_fn=flip_step_10)
    try:
        t.fit(STEPS)
    finally:
        t.close()
    records = read_jsonl(root / ".elastic" / "attempt-0000" / "rank-00000.jsonl")
    [rollback] = [r for r in records if r["event"] == "rollback"]
    assert (rollback["step"], rollback["restored_step"]) == (17, 5)
    assert rollback["retired_steps"] == [15]
    assert (root / "step-00000010" / "manifest.json").exists()
