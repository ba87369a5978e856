"""What the framework integrations share (trainer/integrations/_steps.py), without the
frameworks: pointers, retention the framework decides, loading the newest good step."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import ckpt
from ckpt._step.pointer import read_pointer, write_pointer
from trainer.integrations._steps import StepStore, load_newest_good


def test_pointers_round_trip_and_nothing_else_reads_as_one(tmp_path):
    write_pointer(str(tmp_path / "last.ckpt"), 12)
    assert read_pointer(str(tmp_path / "last.ckpt")) == 12
    assert json.loads((tmp_path / "last.ckpt").read_text()) == {"format": "ckpt-pointer",
                                                                "step": 12}
    torch.save({"state_dict": {}}, tmp_path / "torch.ckpt")
    (tmp_path / "other.json").write_text(json.dumps({"format": "other", "step": 1}))
    (tmp_path / "negative.json").write_text(json.dumps({"format": "ckpt-pointer", "step": -1}))
    (tmp_path / "huge.json").write_text(" " * 5000 + "{}")
    os.symlink(tmp_path / "last.ckpt", tmp_path / "link.ckpt")
    for name in ("torch.ckpt", "other.json", "negative.json", "huge.json", "link.ckpt",
                 "missing.ckpt"):
        assert read_pointer(str(tmp_path / name)) is None, name
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []


def test_the_framework_decides_schedule_and_retention(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        StepStore(str(tmp_path / "root"), {"keep_last": 2})


def test_dropped_steps_go_but_never_the_newest_committed_one(tmp_path):
    root = str(tmp_path / "root")
    store = StepStore(root, {"async_save": False})
    try:
        for step in (2, 4, 6):
            assert store.save(step, {"w": torch.full((4,), float(step))})
        assert not store.save(6, {"w": torch.zeros(4)})  # the same step under a second name
        store.retire({2, 6})
        assert store.mgr.steps() == [4, 6]  # 6 is the newest: kept
    finally:
        store.close()
    assert ckpt.load(os.path.join(root, "step-00000006"))["w"].tolist() == [6.0] * 4


def test_loading_falls_back_past_corrupt_and_uncommitted_steps(tmp_path, caplog):
    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((64,), float(step))})
    doc = json.loads((root / "step-00000003/manifest.json").read_bytes())
    chunk = doc["tensors"]["w"]["chunks"][0]
    data = root / "step-00000003" / chunk["file"]
    raw = bytearray(data.read_bytes())
    raw[chunk["start"] + 4] ^= 0x02
    data.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, "ckpt"):
        step, saved = load_newest_good(str(root), None)
        assert step == 2 and saved["w"].tolist() == [2.0] * 64
        assert "skipping step 3" in caplog.text and "digest mismatch" in caplog.text
        caplog.clear()
        step, _ = load_newest_good(str(root), 7)  # a pointer to a step never committed
        assert step == 2 and "step 7" in caplog.text and "never committed" in caplog.text
        assert load_newest_good(str(root), 1)[0] == 1  # never a step after the one named
    (tmp_path / "empty").mkdir()
    assert load_newest_good(str(tmp_path / "empty"), None) is None


def test_ckpt_imports_and_works_without_the_frameworks(tmp_path):
    """The frameworks are optional: with lightning, transformers and accelerate made
    unimportable, ckpt, the trainer package and the CLI (export --to hf included) still work."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "for m in ('lightning', 'pytorch_lightning', 'transformers', 'accelerate'):\n"
        "    sys.modules[m] = None\n"
        "import torch, ckpt, trainer, trainer.integrations\n"
        "from verify import cli\n"
        "out = sys.argv[1]\n"
        "ckpt.save({'model': torch.nn.Linear(2, 2)}, out + '/root/step-00000001', step=1)\n"
        "sys.exit(cli.main(['export', out + '/root', '--to', 'hf', out + '/hf']))\n"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "hf/model.safetensors.index.json").exists()
