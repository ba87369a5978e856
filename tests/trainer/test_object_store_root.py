"""The elastic trainer on an object-store root (S3, moto's server) with its defaults: no run
directory unless one is given (``ObservabilityConfig.run_dir``: the default is beside a local
root only), a health guard and a verified window.

A preempted attempt's stop checkpoint must be what the next attempt resumes from there too:
without a run directory the attempts are numbered by the audit files (when there are any),
and a resume takes the newest stop checkpoint whichever attempt took it. Without a run
directory the checkpoints' metadata is what tells a restart of the batches a rollback
marked bad.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.support.s3_fixture import _moto, s3  # noqa: F401  (fixtures)
from tests.trainer.test_health import (BAD_STEP, check_trained_order, crash_once_at,
                                       event_lines, make_step_fn, plain_process)
from tests.trainer.test_health import STEPS as EPOCH
from tests.trainer.test_verified_steps import STEPS, preempting, verified_trainer
from trainer import CheckpointConfig
from trainer.elastic import ElasticTrainer, read_audit

__all__ = ["plain_process"]  # the autouse fixture: no torchrun variables in this process

pytestmark = pytest.mark.s3

AT = 8  # between the saves of 5 and 10; the newest verified step is 0 (5's window ends at 9)


def test_a_preempted_run_on_s3_resumes_from_its_stop_checkpoint(s3, tmp_path,  # noqa: F811
                                                                 caplog):
    """SIGTERM during step 8: the next attempt resumes from the stop checkpoint of step 8
    (not from step 0, the newest verified) and ends with the uninterrupted run's weights."""
    caplog.set_level(logging.INFO, logger="ckpt.trainer")
    step_fn = make_step_fn(None)
    root = s3.root("job")

    def trainer(fn) -> ElasticTrainer:
        t = verified_trainer(root, tmp_path, step_fn=fn, checkpoint=CheckpointConfig(
            manager_options={"storage_options": s3.storage_options}))
        assert t.run_dir is None  # the default for an object-store root
        return t

    holder: list[ElasticTrainer] = []
    holder.append(trainer(preempting(step_fn, AT, holder)))
    with pytest.raises(SystemExit):
        holder[0].fit(STEPS // 2)
    holder[0].close()
    caplog.clear()
    holder.append(trainer(step_fn))
    try:
        holder[1].fit(STEPS // 2)
    finally:
        holder[1].close()
    [resume] = event_lines(caplog, "train.resume")
    assert resume["step"] == str(AT)
    # No run directory: the audit files number the attempts, each keeping its own records.
    assert holder[1].attempt == 1
    audited = read_audit(tmp_path / "audit")
    assert {s: r["attempt"] for s, r in audited.items()} == {
        s: 0 if s <= AT else 1 for s in range(1, STEPS // 2 + 1)}
    reference = verified_trainer(tmp_path / "reference", tmp_path / "reference",
                                 step_fn=step_fn)
    reference.fit(STEPS // 2)
    reference.close()
    for k, v in holder[1].module.state_dict().items():
        assert torch.equal(v, reference.module.state_dict()[k]), k


def test_a_restart_on_s3_passes_over_the_batch_a_rollback_marked_bad(s3, tmp_path,  # noqa: F811
                                                                    caplog):
    """A NaN at step 13 rolls back to the verified step 5; the crash at step 18 comes once
    the new timeline's step 10 is verified. The restart resumes from step 10, whose
    metadata marks the batch of step 13 bad (the only record of it: no run directory), and
    passes over it without a second rollback."""
    caplog.set_level(logging.INFO, logger="ckpt.trainer")
    nan_step = make_step_fn("nan")
    root = s3.root("job")
    checkpoint = CheckpointConfig(manager_options={"storage_options": s3.storage_options})
    holder: list[ElasticTrainer] = []
    holder.append(verified_trainer(root, tmp_path, step_fn=crash_once_at(18, nan_step, holder),
                                   checkpoint=checkpoint))
    assert holder[0].run_dir is None
    with pytest.raises(ValueError, match="went away"):
        holder[0].fit(EPOCH)
    assert holder[0].metrics.snapshot()["rollbacks_total"] == 1
    holder[0].close()
    caplog.clear()
    holder.append(verified_trainer(root, tmp_path, step_fn=nan_step, checkpoint=checkpoint))
    try:
        assert holder[1].fit(EPOCH).final_step == EPOCH
    finally:
        holder[1].close()
    [resume] = event_lines(caplog, "train.resume")
    assert (resume["step"], resume["known_bad_batches"]) == ("10", "1")
    assert not event_lines(caplog, "train.rollback")
    assert [s["step"] for s in event_lines(caplog, "train.skip")] == [str(BAD_STEP)]
    check_trained_order(tmp_path, skipped_steps=[BAD_STEP])
