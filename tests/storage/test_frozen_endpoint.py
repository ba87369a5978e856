"""An S3 endpoint that stops answering (a moto server process frozen with SIGSTOP) in the
middle of a save: the save fails within the storage's deadline instead of waiting for ever,
the training loop's next save is not held up past that deadline either, and once the
endpoint answers again the next save commits, taking the lapsed lease again. A writer that
finds another writer on the root after its lease lapsed is refused with a clear error.

Times are printed (run with -s), not asserted: each wait below is guarded by three times the
deadline only so that a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

import ckpt
from tests.support.moto_process import frozen_moto, moto_bucket  # noqa: F401  (fixtures)

pytestmark = pytest.mark.s3
pytest.importorskip("s3fs", reason="the S3 extra (s3fs, botocore) is not installed")

DEADLINE = 2.0
GUARD = 3 * DEADLINE
TTL = 1.5
# Short deadlines so that the test is quick; 5 MiB parts so that one part crosses well
# within the deadline on a loaded machine.
OPTIONS = {"deadline": DEADLINE, "connect_timeout": 0.5, "read_timeout": 1.0,
           "lease_ttl": TTL, "block_size": 5 << 20}


def manager(endpoint, **kwargs) -> ckpt.CheckpointManager:
    return ckpt.CheckpointManager(endpoint.root("run"), async_save=True,
                                  storage_options={**endpoint.storage_options, **OPTIONS},
                                  **kwargs)


def within(seconds: float, fn) -> tuple[float, BaseException | None]:
    """Run ``fn`` on a thread; (its time, what it raised). Fails the test if it is still
    running after ``seconds`` (the guard that keeps a hang from stalling the suite)."""
    outcome: list = []

    def run() -> None:
        t0 = time.monotonic()
        try:
            fn()
            outcome.append((time.monotonic() - t0, None))
        except BaseException as e:  # noqa: BLE001  (handed to the test)
            outcome.append((time.monotonic() - t0, e))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still blocked after {seconds:g} s"
    return outcome[0]


def wait_for_upload(endpoint, prefix: str) -> None:
    deadline = time.monotonic() + 30
    while not endpoint.uploads(prefix):
        assert time.monotonic() < deadline, f"no upload under {prefix}"
        time.sleep(0.005)


def test_a_save_against_a_frozen_endpoint_fails_within_its_deadline_and_the_next_commits(
        moto_bucket, caplog):
    endpoint = moto_bucket
    caplog.set_level(logging.INFO, logger="ckpt")
    small = {"w": torch.randn(1000)}
    big = torch.randn(4 << 20)  # 16 MiB: a multipart upload of 4 parts, in step 2 only
    with manager(endpoint) as mgr:
        mgr.save(1, small).wait()
        handle = mgr.save(2, {**small, "big": big})
        wait_for_upload(endpoint, "run/step-00000002/")
        endpoint.freeze()
        frozen_for = time.monotonic()
        failed_after, error = within(GUARD, handle.wait)
        assert isinstance(error, ckpt.StorageError), error
        assert "deadline" in str(error) and "nothing was committed" in str(error)
        # The loop goes on and saves again while the endpoint is still frozen.
        next_after, error = within(GUARD, lambda: mgr.save(3, small).wait())
        assert isinstance(error, ckpt.StorageError), error
        time.sleep(max(0.0, DEADLINE + TTL - (time.monotonic() - frozen_for)))  # lapsed
        endpoint.thaw()
        thawed_after = time.monotonic() - frozen_for
        mgr.save(4, {"w": small["w"] + 4}).wait(timeout=60)
        assert mgr.steps() == [1, 4]
        regained = [r.getMessage() for r in caplog.records if "regained" in r.getMessage()]
        assert regained and "had lapsed" in regained[0], [r.getMessage() for r in caplog.records]
        for step, want in ((1, small["w"]), (4, small["w"] + 4)):
            into = {"w": torch.zeros(1000)}
            assert mgr.restore(into, step=step) == step
            assert torch.equal(into["w"], want)
    print(f"\nfrozen mid-upload: save failed after {failed_after:.2f} s, the next save "
          f"returned after {next_after:.2f} s (deadline {DEADLINE:g} s); thawed after "
          f"{thawed_after:.2f} s; {regained[0]}")


def test_a_writer_whose_lease_lapsed_is_refused_when_another_writer_took_the_root(
        moto_bucket):
    endpoint = moto_bucket
    state = {"w": torch.randn(1000)}
    mine = manager(endpoint)
    try:
        mine.save(1, state).wait()
        endpoint.freeze()
        time.sleep(DEADLINE + TTL + 0.5)  # a renewal runs out of its deadline: the lease lapses
        endpoint.thaw()
        with manager(endpoint) as theirs:  # takes over the expired lease
            theirs.save(2, state).wait()
            _, error = within(GUARD, lambda: mine.save(3, state).wait())
            assert isinstance(error, ckpt.CheckpointLockedError), error
            assert "was not committed" in str(error) and "lease" in str(error)
            assert theirs.steps() == [1, 2]
    finally:
        try:
            mine.close()
        except ckpt.CheckpointError:
            pass
