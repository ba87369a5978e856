"""The trainer's record of a resume says where it came from and which steps it gave up on
(the ``restored`` run record and the ``train.resume`` event take these fields)."""

from __future__ import annotations

import os

import torch

from trainer.checkpointing import TrainerCheckpointer


def _checkpointer(root, model: torch.nn.Module) -> TrainerCheckpointer:
    return TrainerCheckpointer(root, every=1, items={"model": model}, collective_timeout=30.0,
                               options={"async_save": False})


def test_restored_from_names_the_tier_and_the_skipped_steps(tmp_path):
    torch.manual_seed(0)
    saver = _checkpointer(tmp_path, torch.nn.Linear(32, 16))
    for step in (1, 2):
        saver.save(step, {"step": step}, force=True)
    saver.close()
    step2 = tmp_path / "step-00000002"
    for name in os.listdir(step2):  # step 2's data damaged: a bit flipped in every file
        if name != "manifest.json":
            with open(step2 / name, "r+b") as f:
                f.seek(os.path.getsize(step2 / name) // 2)
                byte = f.read(1)[0]
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte ^ 0x01]))
    loader = _checkpointer(tmp_path, torch.nn.Linear(32, 16))
    try:
        assert loader.restore() == 1
        got = loader.restored_from()
    finally:
        loader.close()
    assert got == {"tier": "storage", "bytes_from_storage": got["bytes_from_storage"],
                   "skipped_steps": [2]}
    assert got["bytes_from_storage"] > 0
