"""Restore and ``ckpt verify`` agree on a manifest whose chunks no longer describe their data
file: two same-shaped chunks with their boxes (or their byte ranges) swapped, in a manifest
that is otherwise self-consistent (every digest still matches its bytes). Verify reports the
step FAILED, and a restore refuses it and falls back to the step before, never loading the
tensor permuted: both apply one rule (ckpt._step.headers.header_disagreement)."""

from __future__ import annotations

import json

import pytest
import torch

import ckpt
from ckpt._format.sealed import sealed_json
from verify.cli import main as cli_main

OPTIONS = ckpt.SaveOptions(chunk_bytes=4096)  # 2048 floats: two chunks of 1024


def save_two_steps(root) -> tuple[torch.Tensor, torch.Tensor]:
    first = torch.arange(2048, dtype=torch.float32)
    second = first + 10_000
    with ckpt.CheckpointManager(root, options=OPTIONS) as mgr:
        mgr.save(1, {"w": first.clone()}).wait()
        mgr.save(2, {"w": second.clone()}).wait()
    return first, second


def rewrite_chunks(root, step: int, change) -> None:
    """Apply ``change(chunk_a, chunk_b)`` to the two chunks of ``w`` in the step's manifest."""
    path = root / f"step-{step:08d}" / "manifest.json"
    doc = json.loads(path.read_text())
    a, b = doc["tensors"]["w"]["chunks"]
    assert a["shape"] == b["shape"]
    change(a, b)
    path.write_bytes(sealed_json(doc))  # re-sealed: an edit, not damage


def swap_boxes(a: dict, b: dict) -> None:
    a["offsets"], b["offsets"] = b["offsets"], a["offsets"]


def swap_data(a: dict, b: dict) -> None:
    for field in ("file", "start", "length", "digest"):
        a[field], b[field] = b[field], a[field]


def verify_code(capsys, root, step: int) -> tuple[int, str]:
    code = cli_main(["verify", str(root), "--step", str(step), "--level", "digest"])
    out, err = capsys.readouterr()
    return code, out + err


@pytest.mark.parametrize("change", [swap_boxes, swap_data])
def test_verify_fails_and_restore_falls_back_past_swapped_chunks(tmp_path, capsys, change):
    root = tmp_path / "root"
    first, second = save_two_steps(root)
    rewrite_chunks(root, 2, change)
    code, text = verify_code(capsys, root, 2)
    assert code == 1 and "FAILED" in text and "safetensors header" in text, text
    into = {"w": torch.zeros(2048)}
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        assert mgr.restore(into) == 1
    assert torch.equal(into["w"], first)
    with pytest.raises(ckpt.CorruptCheckpointError, match="safetensors header"):
        ckpt.load({"w": torch.zeros(2048)}, root / "step-00000002")


def test_an_untouched_step_passes_both(tmp_path, capsys):
    root = tmp_path / "root"
    _, second = save_two_steps(root)
    code, text = verify_code(capsys, root, 2)
    assert code == 0, text
    into = {"w": torch.zeros(2048)}
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        assert mgr.restore(into) == 2
    assert torch.equal(into["w"], second)
