"""The manager's public wait for the save in flight and its step rule: one wait, counted once
as backpressure whether the loop waits first or ``save`` does, reported while it lasts; and
``save_due`` answering what ``save`` will do."""

from __future__ import annotations

import logging
import os
import signal
import threading

import pytest
import torch

import ckpt
from tests.support.gated import GatedStorage


class OpenAfter(logging.Handler):
    """Opens ``gate`` once ``count`` ``ckpt.save_slow`` warnings were logged."""

    def __init__(self, gate: threading.Event, count: int) -> None:
        super().__init__(logging.WARNING)
        self.gate, self.count, self.messages = gate, count, []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("ckpt.save_slow"):
            self.messages.append(message)
            if len(self.messages) >= self.count:
                self.gate.set()


def backpressure_total(mgr: ckpt.CheckpointManager) -> float:
    return mgr.metrics.snapshot()["backpressure_waits_total"]


def test_the_wait_before_a_save_counts_once_and_the_save_does_not_wait_again(tmp_path):
    storage = GatedStorage(tmp_path / "root")
    state = {"x": torch.arange(10.0)}
    with ckpt.CheckpointManager(storage) as mgr:
        try:
            assert mgr.wait_for_save_in_flight(1) == 0.0  # nothing in flight
            first = mgr.save(1, state)
            assert not first.done()  # its writes wait for the gate
            opener = threading.Timer(0.2, storage.gate.set)
            opener.start()
            mgr.wait_for_save_in_flight(2)
            assert first.done() and first.wait().step == 1
            assert mgr.backpressure_waits == 1
            assert backpressure_total(mgr) == 1
            mgr.save(2, state)  # found nothing in flight: no second count
            assert mgr.backpressure_waits == 1
            assert backpressure_total(mgr) == 1
            mgr.wait()
            assert mgr.steps() == [1, 2]
        finally:
            storage.gate.set()


@pytest.mark.parametrize("waiter", ["wait_for_save_in_flight", "save"])
def test_a_long_wait_is_reported_every_interval(tmp_path, waiter):
    storage = GatedStorage(tmp_path / "root")
    state = {"x": torch.arange(10.0)}
    handler = OpenAfter(storage.gate, count=2)
    logging.getLogger("ckpt").addHandler(handler)
    try:
        with ckpt.CheckpointManager(storage) as mgr:
            try:
                mgr.save(3, state)
                if waiter == "save":  # save's own wait is the same one
                    mgr._saver.report_every = 0.05  # (10 s by default)
                    mgr.save(4, state)
                else:
                    mgr.wait_for_save_in_flight(4, report_every=0.05)
                assert mgr.backpressure_waits == 1
            finally:
                storage.gate.set()
    finally:
        logging.getLogger("ckpt").removeHandler(handler)
    assert len(handler.messages) >= 2
    assert handler.messages[0].startswith("ckpt.save_slow step=4 waiting_for=3 waited_s=")


def test_without_an_interval_nothing_is_reported(tmp_path):
    storage = GatedStorage(tmp_path / "root")
    handler = OpenAfter(storage.gate, count=1)
    logging.getLogger("ckpt").addHandler(handler)
    try:
        with ckpt.CheckpointManager(storage) as mgr:
            try:
                mgr.save(1, {"x": torch.ones(4)})
                threading.Timer(0.2, storage.gate.set).start()
                mgr.wait_for_save_in_flight(2, report_every=None)
            finally:
                storage.gate.set()
    finally:
        logging.getLogger("ckpt").removeHandler(handler)
    assert handler.messages == []


def test_the_failed_save_in_flight_raises_its_error_from_the_wait(tmp_path):
    storage = GatedStorage(tmp_path / "root", fail=True)
    mgr = ckpt.CheckpointManager(storage)
    try:
        mgr.save(1, {"x": torch.ones(4)})
        storage.gate.set()
        with pytest.raises(ckpt.CheckpointError) as caught:
            mgr.wait_for_save_in_flight(2)
        assert "No space left on device" in str(caught.value) + str(caught.value.__cause__)
        assert mgr.wait_for_save_in_flight(2) == 0.0  # raised once, as wait() does
        assert mgr.steps() == []
    finally:
        storage.fail = False
        mgr.close()


@pytest.mark.parametrize("bad", [0, -1.0, "10", True])
def test_a_bad_interval_is_refused(tmp_path, bad):
    with ckpt.CheckpointManager(tmp_path / "root") as mgr:
        with pytest.raises(ValueError, match="report_every"):
            mgr.wait_for_save_in_flight(1, report_every=bad)


def test_save_due_is_what_save_does(tmp_path):
    state = {"x": torch.ones(4)}
    with ckpt.CheckpointManager(tmp_path / "root", every_steps=5) as mgr:
        due = [step for step in range(1, 17) if mgr.save_due(step)]
        saved = [step for step in range(1, 17) if mgr.save(step, state) is not None]
        mgr.wait()
    assert due == saved == [5, 10, 15]


def test_save_due_after_sigterm_with_save_on_preemption(tmp_path):
    schedule = ckpt.Schedule(every_steps=5, save_on_preemption=True)
    with ckpt.CheckpointManager(tmp_path / "root", schedule=schedule) as mgr:
        assert not mgr.save_due(7)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler only notes it (save_on_preemption)
        assert mgr.preempted
        assert mgr.save_due(7)  # the next save saves whatever the step, then exits
