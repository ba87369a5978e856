"""The trainer's checkpointer asks its manager both questions: whether a step's save is due
(the manager's step schedule) and the wait for the save in flight before it (the manager's
backpressure wait, counted once though the trainer waits before calling ``save``)."""

from __future__ import annotations

import threading

import torch

from tests.support.gated import GatedStorage
from trainer.checkpointing import TrainerCheckpointer


def checkpointer(root, every: int = 10) -> TrainerCheckpointer:
    return TrainerCheckpointer(root, every=every, items={"w": torch.arange(8.0)},
                               collective_timeout=60.0, options={})


def test_the_wait_before_a_due_save_is_the_managers_and_counts_once(tmp_path):
    storage = GatedStorage(tmp_path / "root")
    cp = checkpointer(storage)
    try:
        first = cp.save(10, {"step": 10})
        assert first is not None and not first.done()
        threading.Timer(0.2, storage.gate.set).start()
        cp.wait_previous(20)
        assert first.done()
        assert cp.save(20, {"step": 20}) is not None
        cp.wait()
        mgr = cp.manager
        assert mgr.backpressure_waits == 1
        assert mgr.metrics.snapshot()["backpressure_waits_total"] == 1
        assert mgr.steps() == [10, 20]
    finally:
        storage.gate.set()
        cp.close()


def test_due_is_the_managers_step_schedule(tmp_path):
    cp = checkpointer(tmp_path / "root", every=4)
    try:
        due = [step for step in range(1, 13) if cp.due(step)]
        saved = [step for step in range(1, 13) if cp.save(step, {"step": step}) is not None]
        assert due == saved == [4, 8, 12]
    finally:
        cp.close()
