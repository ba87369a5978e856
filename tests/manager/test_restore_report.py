"""A restore says what it did: one INFO line (step, tier, bytes, seconds, the attempts it gave
up on and why) and the same in ``mgr.last_restore``. The memory tiers' side (tier=memory and
peer, under a process group) is in tests/memory/test_memory_with_probe.py."""

from __future__ import annotations

import logging
import os

import torch

import ckpt


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(64, 32)}


def _flip_data(step_dir: str) -> None:
    """Flip one bit in the middle of every data file of a step."""
    for name in os.listdir(step_dir):
        if name != "manifest.json":
            path = os.path.join(step_dir, name)
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) // 2)
                byte = f.read(1)[0]
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte ^ 0x01]))


def test_storage_restore_reports_the_step_the_bytes_and_the_skipped_step(tmp_path, caplog):
    root = str(tmp_path / "root")
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step), force=True)
    _flip_data(os.path.join(root, "step-00000002"))
    caplog.set_level(logging.INFO, logger="ckpt")
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        state = _state(0)
        assert mgr.restore(state) == 1
        info = mgr.last_restore
    assert torch.equal(state["model"].weight, _state(1)["model"].weight)
    assert (info.step, info.tier) == (1, "storage")
    # The bytes of step 1 read; the whole restore (step 2's failed attempt too) from the root.
    data = sum(os.path.getsize(os.path.join(root, "step-00000001", n))
               for n in os.listdir(os.path.join(root, "step-00000001")))
    assert 0 < info.bytes <= data < info.bytes_from_storage
    assert info.seconds > 0
    [(step, tier, why)] = info.skipped
    assert (step, tier) == (2, "storage") and "digest" in why and "\n" not in why
    [line] = [r.getMessage() for r in caplog.records
              if r.getMessage().startswith("ckpt.restore step=")]
    assert line.startswith(f"ckpt.restore step=1 tier=storage bytes={info.bytes} "
                           f"seconds={info.seconds:.3f} skipped=step 2 (storage): {why} ")


def test_a_clean_restore_reports_nothing_skipped(tmp_path, caplog):
    root = str(tmp_path / "root")
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(3, _state(3), force=True)
    caplog.set_level(logging.INFO, logger="ckpt")
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        assert mgr.restore(_state(0)) == 3
        info = mgr.last_restore
    assert (info.step, info.tier, info.skipped) == (3, "storage", ())
    assert info.bytes == info.bytes_from_storage > 0
    [line] = [r.getMessage() for r in caplog.records
              if r.getMessage().startswith("ckpt.restore step=")]
    assert f"step=3 tier=storage bytes={info.bytes} " in line and "skipped=none" in line
