"""``ckpt diff --exit-code`` says whether steps differ; per-rank items are spelled
``ITEM@RANK/...`` everywhere the command shows or matches names; ``ckpt gc --keep-last``
keeps what the recorded policy's keep_best keeps."""

from __future__ import annotations

import json
import random

import pytest
import torch

import ckpt
from verify.cli import main as cli_main


def cli(capsys, *args) -> tuple[int, str]:
    code = cli_main([str(a) for a in args])
    out, _ = capsys.readouterr()
    return code, out


def save_steps(root, tables: bool = False) -> None:
    """Steps 1 and 2: the model differs, 'same' does not; the RNG moved between them."""
    opts = ckpt.SaveOptions(rank_tables=tables)
    with ckpt.CheckpointManager(root, async_save=False, options=opts) as mgr:
        for step in (1, 2):
            random.random()
            torch.rand(1)
            state = {"model": torch.full((8,), float(step)), "same": torch.ones(4),
                     "rng": ckpt.RNGState(), "hidden": ckpt.PerRank((torch.full((2,), step),))}
            mgr.save(step, state, force=True)


def test_diff_exit_code_is_1_when_steps_differ_and_0_when_they_do_not(tmp_path, capsys):
    save_steps(tmp_path)
    code, out = cli(capsys, "diff", tmp_path, 1, 2)
    assert code == 0, out  # without --exit-code: 0 either way, as git diff
    code, out = cli(capsys, "diff", tmp_path, 1, 2, "--exit-code")
    assert code == 1 and "model" in out, out
    code, out = cli(capsys, "diff", tmp_path, 1, 2, "--exit-code", "--filter", "same")
    assert code == 0, out
    code, out = cli(capsys, "diff", tmp_path, 1, 1, "--exit-code", "--json")
    assert code == 0 and json.loads(out)["differ"] is False
    code, out = cli(capsys, "diff", tmp_path, 1, 2, "--exit-code", "--json")
    assert code == 1 and json.loads(out)["differ"] is True


@pytest.mark.parametrize("tables", [False, True], ids=["format1", "rank_tables"])
def test_per_rank_names_are_spelled_item_at_rank_everywhere(tmp_path, capsys, tables):
    save_steps(tmp_path, tables)
    code, out = cli(capsys, "diff", tmp_path, 1, 2, "--json")
    doc = json.loads(out)
    tensors = [t["key"] for t in doc["tensors"]]
    values = [v["path"] for v in doc["values"]]
    assert "rng@0/torch" in tensors and "hidden@0/0" in tensors, tensors
    assert any(p.startswith("rng@0/python") for p in values), values
    names = tensors + values
    assert not any(n.startswith(("rng/", "hidden/")) or "rank0" in n for n in names), names

    code, out = cli(capsys, "diff", tmp_path, 1, 2, "--json", "--filter", "rng@0/*")
    doc = json.loads(out)
    picked = [t["key"] for t in doc["tensors"]] + [v["path"] for v in doc["values"]]
    assert picked and all(p.startswith("rng@0/") for p in picked), picked
    assert "rng@0/torch" in picked and any(p.startswith("rng@0/python") for p in picked)

    code, out = cli(capsys, "inspect", tmp_path, "--step", 2)
    assert code == 0 and "rng@0/torch" in out and "rng@0/python" in out, out
    assert "rank0" not in out and "rng/" not in out, out
    code, out = cli(capsys, "inspect", tmp_path, "--step", 2, "--json")
    assert "rng@0" in json.loads(out)["state"], out


def test_gc_keep_last_keeps_the_recorded_keep_best_step_and_says_so(tmp_path, capsys):
    policy = ckpt.RetentionPolicy(keep_last=3, keep_best=ckpt.KeepBest(1, "loss"))
    with ckpt.CheckpointManager(tmp_path, async_save=False, retention=policy) as mgr:
        for step, loss in [(1, 5.0), (2, 0.5), (3, 3.0), (4, 4.0), (5, 4.5), (6, 4.2)]:
            mgr.save(step, {"w": torch.full((4,), float(step))}, force=True,
                     metrics={"loss": loss})
    code, out = cli(capsys, "gc", tmp_path, "--keep-last", 1, "--yes")
    assert code == 0, out
    assert "keep_best=1 by loss" in out and "kept: [2, 6]" in out, out
    code, out = cli(capsys, "gc", tmp_path, "--keep-last", 0)
    assert code == 0 and "would keep: [2, 6]" in out, out
    with ckpt.CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.steps() == [2, 6]
