"""A save's step number comes after the newest saved step: lower ones and repeats are refused
with StepOrderError, except a repeat with overwrite=True, steps retired, and steps that a
restore skipped as bad."""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

import ckpt


def manager(root) -> ckpt.CheckpointManager:
    return ckpt.CheckpointManager(str(root), async_save=False, metrics=False,
                                  schedule=ckpt.Schedule(handle_sigterm=False))


def state(value: float) -> dict:
    return {"w": torch.full((64,), value)}


def test_a_step_below_the_newest_is_refused_and_nothing_is_written(tmp_path):
    with manager(tmp_path) as mgr:
        mgr.save(10, state(1.0))
        mgr.save(20, state(2.0))
        with pytest.raises(ckpt.StepOrderError) as refused:
            mgr.save(15, state(3.0))
        assert mgr.steps() == [10, 20]
    message = str(refused.value)
    assert "step 20" in message and "mgr.retire(s for s in mgr.steps() if s >= 15)" in message
    assert isinstance(refused.value, ValueError)


def test_a_restarted_counter_in_an_old_root_is_refused_by_a_new_manager(tmp_path):
    with manager(tmp_path) as mgr:
        mgr.save(100, state(1.0))
    with manager(tmp_path) as mgr:  # a new run, its counter back at the start
        with pytest.raises(ckpt.StepOrderError, match="newer step, 100"):
            mgr.save(1, state(2.0))
        live = state(0.0)
        assert mgr.restore(live) == 100


def test_the_same_step_twice_needs_overwrite(tmp_path):
    with manager(tmp_path) as mgr:
        mgr.save(5, state(1.0))
        with pytest.raises(ckpt.StepOrderError, match="already saved.*overwrite=True"):
            mgr.save(5, state(2.0))
        live = state(0.0)
        mgr.restore(live)
        assert live["w"][0].item() == 1.0  # the refused save replaced nothing
        mgr.save(5, state(2.0), overwrite=True)
        mgr.restore(live)
        assert live["w"][0].item() == 2.0 and mgr.steps() == [5]


def test_retired_steps_no_longer_count(tmp_path):
    with manager(tmp_path) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, state(float(step)))
        live = state(0.0)
        mgr.restore(live, step=10)  # roll back on purpose
        mgr.retire(s for s in mgr.steps() if s >= 11)
        mgr.save(11, state(11.0))
        assert mgr.steps() == [10, 11]


def test_steps_retired_by_another_process_are_seen_before_refusing(tmp_path):
    with manager(tmp_path) as mgr:
        mgr.save(10, state(1.0))
        mgr.save(20, state(2.0))
        step_20 = os.path.join(str(tmp_path), "step-00000020")
        shutil.rmtree(step_20)  # as `ckpt gc` would, from elsewhere
        mgr.save(15, state(1.5))
        assert mgr.steps() == [10, 15]


def test_after_a_restore_skips_a_damaged_step_its_number_can_be_saved_again(tmp_path):
    with manager(tmp_path) as mgr:
        mgr.save(10, state(1.0))
        mgr.save(20, state(2.0))
    data, = glob.glob(f"{tmp_path}/step-00000020/data-*")
    with open(data, "r+b") as f:  # flip a bit of the tensor's bytes (at the file's end)
        f.seek(-8, os.SEEK_END)
        byte = f.read(1)
        f.seek(-8, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))
    with manager(tmp_path) as mgr:
        live = state(0.0)
        assert mgr.restore(live) == 10 and [s for s, _ in mgr.skipped] == [20]
        mgr.save(15, state(1.5))  # below the damaged step 20: the run goes on from 10
        mgr.save(20, state(2.5))  # and replaces it
        assert mgr.restore(live) == 20 and live["w"][0].item() == 2.5


def test_overwrite_also_saves_below_the_newest_on_purpose(tmp_path):
    with manager(tmp_path) as mgr:
        mgr.save(10, state(1.0))
        mgr.save(20, state(2.0))
        mgr.save(15, state(1.5), overwrite=True)
        assert mgr.steps() == [10, 15, 20]


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_memory_only_steps_a_restore_passed_over_no_longer_count(tmp_path):
    """A rollback: step 4, in memory only, fails the forward check (NaN weights); the
    restore falls back to step 2 and the loop saves step 4 again."""
    (tmp_path / "shm").mkdir()
    tier = ckpt.MemoryTierOptions(shm_dir=str(tmp_path / "shm"), node="n0", job="order",
                                  persist_every=100)
    probe = ckpt.Probe(inputs=torch.ones(3, 4))
    torch.manual_seed(0)
    model = Tiny()
    with ckpt.CheckpointManager(str(tmp_path / "root"), async_save=False, memory_tier=tier,
                                options=ckpt.SaveOptions(probe=probe)) as mgr:
        mgr.save(2, {"model": model})  # memory only
        with torch.no_grad():
            model.fc.weight.fill_(float("nan"))
        mgr.save(4, {"model": model})  # memory only, bad
        assert mgr.restore({"model": model}, verify="forward") == 2
        mgr.save(3, {"model": model})  # the loop goes on from step 2
        mgr.save(4, {"model": model})
