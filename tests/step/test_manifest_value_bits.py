"""A flipped bit in a step's manifest where it holds a plain value (an epoch, a data position,
an optimizer's learning rate) is not restored silently: the manifest's own digest covers
those values as the chunks' digests cover the tensors' bytes, so the step is refused as
damaged (the restore falls back to the step before it; ``ckpt verify`` exits 1).
"""

from __future__ import annotations

import torch

import ckpt
from verify.cli import main


def flip_bit(path, old: bytes, bit: int) -> None:
    """Flip one bit of the last byte of ``old`` in the file (``old`` occurs there once)."""
    data = bytearray(path.read_bytes())
    at = data.find(old)
    assert at >= 0 and data.find(old, at + 1) < 0, old
    data[at + len(old) - 1] ^= 1 << bit
    path.write_bytes(bytes(data))


def test_a_flipped_bit_in_a_saved_value_is_not_restored(tmp_path):
    root = tmp_path / "root"
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        for epoch in (2, 3):
            mgr.save(epoch, {"model": model, "opt": opt, "epoch": epoch}, force=True)
    flip_bit(root / "step-00000003" / "manifest.json", b'"epoch":{"kind":"value","tree":3',
             2)  # 3 (0x33) reads as 7 (0x37)

    state = {"model": torch.nn.Linear(2, 2), "epoch": 0}
    state["opt"] = torch.optim.SGD(state["model"].parameters(), lr=0.5)
    with ckpt.CheckpointManager(root, read_only=True) as ro:
        restored = ro.restore(state)
    assert (restored, state["epoch"]) == (2, 2), (restored, state["epoch"])
    assert main(["verify", str(root), "--step", "3"]) == 1
