"""When retention runs: after a save's step is committed and its handle is done (the step is
durable then; retiring older ones is housekeeping), on the writer thread, before the next
save starts; ``wait()`` and a synchronous save return with it applied."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import ckpt
from ckpt._manager import saver as saver_module


@pytest.fixture
def held_retention(monkeypatch):
    """Every retention waits for ``release`` before it deletes anything; ``started`` is set
    when one is waiting."""
    started, release = threading.Event(), threading.Event()
    original = saver_module.collect

    def collect(storage, keep, *args, **kwargs):
        started.set()
        assert release.wait(30), "the test never released the retention"
        return original(storage, keep, *args, **kwargs)

    monkeypatch.setattr(saver_module, "collect", collect)
    yield started, release
    release.set()


def state(step: int) -> dict:
    return {"w": torch.full((1024,), float(step))}


def test_a_saves_handle_is_done_when_its_step_is_committed_not_after_the_retention(
        tmp_path, held_retention):
    started, release = held_retention
    with ckpt.CheckpointManager(tmp_path, async_save=True, keep_last=1) as mgr:
        mgr.save(1, state(1)).wait(30)
        assert started.wait(30)  # the retention after step 1 (nothing to retire) is held
        release.set()
        mgr.wait(30)
        started.clear()
        release.clear()
        handle = mgr.save(2, state(2))
        handle.wait(10)  # does not wait for the retention that is held
        assert handle.done() and started.wait(30)
        assert mgr.steps() == [1, 2]  # step 2 is committed; step 1 is not retired yet
        release.set()
        mgr.wait(30)  # waits for the retention too
        assert mgr.steps() == [2]


def test_the_next_save_starts_only_once_the_retention_before_it_is_done(tmp_path,
                                                                        held_retention):
    started, release = held_retention
    with ckpt.CheckpointManager(tmp_path, async_save=True, keep_last=1) as mgr:
        release.set()
        mgr.save(1, state(1)).wait(30)
        mgr.wait(30)
        release.clear()
        started.clear()
        mgr.save(2, state(2)).wait(30)
        assert started.wait(30)
        saving = threading.Thread(target=lambda: mgr.save(3, state(3)))
        saving.start()
        saving.join(0.5)
        # save(3) itself waits, before it copies anything: one retention never runs beside
        # the next save (an object store's save retires a step it replaces before it
        # starts, from the same listing)
        assert saving.is_alive() and mgr.steps() == [1, 2]
        release.set()
        saving.join(30)
        assert not saving.is_alive()
        mgr.wait(30)
        assert mgr.steps() == [3]


def test_a_synchronous_save_returns_with_the_retention_applied(tmp_path, monkeypatch):
    original = saver_module.collect

    def slow_collect(storage, keep, *args, **kwargs):
        time.sleep(0.3)  # a large step's files take a while to delete
        return original(storage, keep, *args, **kwargs)

    monkeypatch.setattr(saver_module, "collect", slow_collect)
    with ckpt.CheckpointManager(tmp_path, async_save=False, keep_last=1) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step))
            assert mgr.steps() == [step]


def test_a_retention_that_fails_leaves_the_committed_step_and_the_next_save_retires(
        tmp_path, monkeypatch, caplog):
    original = saver_module.collect
    calls = []

    def collect(storage, keep, *args, **kwargs):
        calls.append(set(keep))
        if len(calls) == 2:
            raise ValueError("an unreadable old manifest")
        return original(storage, keep, *args, **kwargs)

    monkeypatch.setattr(saver_module, "collect", collect)
    with ckpt.CheckpointManager(tmp_path, async_save=True, keep_last=1) as mgr:
        for step in (1, 2):
            handle = mgr.save(step, state(step))
            handle.wait(30)
            mgr.wait(30)
        assert handle.exception() is None  # the save committed: its retention's error is not its
        assert mgr.steps() == [1, 2] and "retention failed after step 2" in caplog.text
        mgr.save(3, state(3))
        mgr.wait(30)
        assert mgr.steps() == [3]


def test_marking_a_step_verified_waits_for_the_retention_in_flight(tmp_path, held_retention):
    """The retention sweeps the step directories, so a marker written beside it could be
    swept as a stray file: marking waits for it."""
    started, release = held_retention
    with ckpt.CheckpointManager(tmp_path, async_save=True, keep_last=2) as mgr:
        mgr.save(1, state(1)).wait(30)
        assert started.wait(30)
        marking = threading.Thread(target=lambda: mgr.mark_verified(1, {"window": 1}))
        marking.start()
        marking.join(0.5)
        assert marking.is_alive() and mgr.verified_steps() == []
        release.set()
        marking.join(30)
        assert not marking.is_alive() and mgr.verified_steps() == [1]


def test_a_save_still_writing_when_the_manager_closes_commits_and_is_retained(
        tmp_path, monkeypatch):
    """close() stops the writer while the save is written: its retention, queued once the
    step is committed, runs all the same, and the save does not fail."""
    from storage_backends.posix import PosixStorage

    original = PosixStorage.write

    def slow_write(self, path, buffers):
        time.sleep(0.3)  # still writing when close() begins
        return original(self, path, buffers)

    mgr = ckpt.CheckpointManager(tmp_path, async_save=True, keep_last=1)
    mgr.save(1, state(1)).wait(30)
    mgr.wait(30)
    monkeypatch.setattr(PosixStorage, "write", slow_write)
    handle = mgr.save(2, state(2))
    mgr.close()  # raises the save's error, if it failed
    assert handle.exception() is None
    with ckpt.CheckpointManager(tmp_path, read_only=True) as ro:
        assert ro.steps() == [2]


def test_a_next_save_kept_waiting_by_a_slow_retention_says_so(tmp_path, held_retention,
                                                              caplog):
    started, release = held_retention
    with ckpt.CheckpointManager(tmp_path, async_save=True, keep_last=1) as mgr:
        mgr.save(1, state(1)).wait(30)
        assert started.wait(30)
        mgr._saver.report_every = 0.05  # (10 s by default)
        threading.Timer(0.5, release.set).start()
        with caplog.at_level("WARNING", logger="ckpt"):
            mgr.save(2, state(2))
        assert mgr.backpressure_waits == 1
        assert "ckpt.save_slow step=2 waiting_for=retention" in caplog.text


def test_a_save_error_already_raised_is_not_raised_again_while_the_next_save_waits(
        tmp_path, held_retention):
    """A failed save whose error the caller already got (a save to memory alone published
    on the caller's thread) while the retention of an earlier commit still runs: the next
    save waits for the retention and does not raise that error a second time."""
    import concurrent.futures as cf

    from ckpt._save.handle import SaveHandle

    started, release = held_retention
    with ckpt.CheckpointManager(tmp_path, async_save=True, keep_last=1) as mgr:
        mgr.save(1, state(1)).wait(30)
        assert started.wait(30)
        failed: cf.Future = cf.Future()
        failed.set_exception(OSError("the segment could not be written"))
        handle = SaveHandle(2, failed, 0.0)
        handle.error_reported = True
        mgr._saver.inflight = handle
        threading.Timer(0.3, release.set).start()
        assert mgr._saver.wait_for_previous(3, report_every=None) > 0  # waited, raised nothing
        assert mgr._saver.backpressure_waits == 1
