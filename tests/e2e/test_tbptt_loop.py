"""A word_language_model-style loop (an LSTM with truncated BPTT, the hidden state carried
across batches, index-based batches, a hand-written SGD step with lr decay, the best
validation loss) SIGKILLed three times and resumed each time: the final model, lr, best
loss, hidden state and random stream equal an uninterrupted run's bit for bit.
Loop in tests/support/tbptt_job.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckpt
from tests.support import tbptt_job
from tests.support.ranks import forkserver

pytestmark = [pytest.mark.multiproc]


def _run(root: Path | None, out: Path, kill_at: int | None = None,
         after_commit: bool = False) -> int:
    """One run of the loop in a process forked from the suite's fork server; its exit code."""
    out.mkdir(parents=True, exist_ok=True)
    p = forkserver().Process(target=tbptt_job.run,
                             args=(str(root) if root else None, str(out), kill_at,
                                   after_commit), daemon=True)
    p.start()
    p.join(120)
    if p.is_alive():
        p.kill()
        p.join()
    return p.exitcode


def _final(out: Path) -> tuple[dict, dict]:
    return torch.load(out / "final.pt", weights_only=True), json.loads(
        (out / "final.json").read_text())


def test_tbptt_loop_killed_three_times_resumes_bit_exact(tmp_path):
    assert _run(None, tmp_path / "straight") == 0
    want, want_loop = _final(tmp_path / "straight")

    root = tmp_path / "root"
    # 6 batches per epoch, saves every 3 steps: each kill resumes mid-epoch, where the
    # carried hidden state matters (steps 3, 9, 15), once right after the commit of step 9;
    # the lr decays between the kills (the ends of epochs 1 and 2)
    kills = [(5, False), (9, True), (16, False)]
    committed = []
    for kill_at, after_commit in kills:
        assert _run(root, tmp_path / f"killed{kill_at}", kill_at, after_commit) == -9
        with ckpt.CheckpointManager(root, read_only=True) as mgr:
            committed.append(mgr.latest_step())
    assert committed == [3, 9, 15]
    assert _run(root, tmp_path / "resumed") == 0
    got, got_loop = _final(tmp_path / "resumed")

    assert got_loop == want_loop and want_loop["lr"] < 20.0  # lr decayed at least once
    assert got["steps"] == want["steps"] == 18
    for key in want["model"]:
        assert torch.equal(got["model"][key], want["model"][key]), key
    for g, w in zip(got["hidden"], want["hidden"]):
        assert torch.equal(g, w)
    assert torch.equal(got["torch"], want["torch"])
