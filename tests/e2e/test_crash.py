"""Real crashes: writers SIGKILLed at every stage of a save, and training killed at random
times, then resumed. What was committed survives intact, nothing else is ever visible, and a
resumed run ends bit for bit where an uninterrupted one does."""

from __future__ import annotations

import random
import re
import signal
import time
from pathlib import Path

import pytest
import torch

import ckpt
from tests.support.workers import (TRAIN_EVERY, TRAIN_STEPS, ForkedWorker, assert_same,
                                   crash_state, zeroed)

pytestmark = pytest.mark.multiproc


def staging_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.startswith(".tmp-"))


# --------------------------------------------------------------- SIGKILL at each stage of a save


@pytest.mark.parametrize("point, committed", [
    ("before_data", [1]),
    ("after_file", [1]),
    ("before_commit", [1]),
    ("after_commit", [1, 2]),
])
def test_sigkill_during_save_leaves_only_committed_steps(tmp_path, point, committed):
    root = tmp_path / "root"
    # Step 1 writes one data file, so the 2nd hit of every point is the 1st one of step 2.
    worker = ForkedWorker("crash_save", root, fault=f"kill:{point}:2")
    rc = worker.finish()
    assert rc == -signal.SIGKILL, worker.output
    assert "committed 1 files=1" in worker.lines, worker.output
    assert "committed 2" not in worker.lines

    # What the dead writer left behind, before anyone cleans up.
    leftovers = staging_dirs(root)
    if point == "after_commit":
        assert leftovers == []
    else:
        (staging,) = leftovers
        assert not (staging / "manifest.json").exists()
        data = list(staging.glob("*.safetensors"))
        if point == "before_data":
            assert data == []
        else:  # after_file: at least the first file is durable; before_commit: all are
            assert len(data) >= 1
    assert not (root / "step-00000002").exists() or point == "after_commit"

    mgr = ckpt.CheckpointManager(root)  # (i) the dead process's lock is free again
    try:
        with pytest.raises(ckpt.CheckpointLockedError):
            ckpt.CheckpointManager(root)  # ... and now this manager holds it
        assert staging_dirs(root) == []  # (iv) leftovers removed on open
        assert mgr.steps() == committed  # (ii) only committed steps
        expected_step = committed[-1]
        template = zeroed(crash_state(expected_step))
        assert mgr.restore(template) == expected_step  # (iii) the newest committed step...
        assert_same(template, crash_state(expected_step))  # ... with exactly its values
        if point == "after_commit":  # the older step is intact too
            older = zeroed(crash_state(1))
            assert mgr.restore(older, step=1) == 1
            assert_same(older, crash_state(1))
    finally:
        mgr.close()


# ------------------------------------------------------------------- bit-exact resume of training


def train_run(root: Path, out: Path, *, fault: str | None = None, kill_after_step: int | None = None,
              delay: float = 0.0) -> tuple[int, ForkedWorker]:
    """Start the training worker; kill it (SIGKILL) once it printed ``step kill_after_step``
    (plus ``delay``), or let it run. Returns (exit status, worker)."""
    sleep = "0.02" if kill_after_step is not None else "0"
    worker = ForkedWorker("train", root, out, sleep, fault=fault)
    if kill_after_step is not None:
        worker.expect(f"step {kill_after_step}")
        time.sleep(delay)
        worker.kill()
    return worker.finish(), worker


def start_step(worker: ForkedWorker) -> int:
    (line,) = [x for x in worker.lines if x.startswith("start ")]
    return int(line.split()[1])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    base = tmp_path_factory.mktemp("reference")
    rc, worker = train_run(base / "root", base / "final.pt")
    assert rc == 0, worker.output
    assert start_step(worker) == 0
    return torch.load(base / "final.pt", weights_only=False)


def assert_matches_reference(out: Path, reference: dict) -> None:
    final = torch.load(out, weights_only=False)
    assert final["progress"]["step"] == TRAIN_STEPS
    for part in ("model", "opt", "sched", "progress", "next"):
        assert_same(final[part], reference[part], part)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_training_killed_at_a_random_time_resumes_bit_exact(tmp_path, reference, seed):
    rng = random.Random(seed)
    # From step 11 on, step 5 is committed (step 10's save waited for it).
    kill_after = rng.randint(11, TRAIN_STEPS - 15)
    root, out = tmp_path / "root", tmp_path / "final.pt"

    rc, first = train_run(root, out, kill_after_step=kill_after, delay=rng.uniform(0, 0.02))
    assert rc == -signal.SIGKILL, first.output
    assert not out.exists()
    reached = max(int(x.split()[1]) for x in first.lines if x.startswith("step "))
    assert kill_after <= reached < TRAIN_STEPS

    rc, second = train_run(root, out)
    assert rc == 0, second.output
    resumed_from = start_step(second)
    # Resumed from the newest commit: the save of the last multiple of 5 reached may still
    # have been in flight, the one before it was surely committed (the next save waits).
    assert resumed_from % TRAIN_EVERY == 0
    assert TRAIN_EVERY * (reached // TRAIN_EVERY) - TRAIN_EVERY <= resumed_from <= reached + 1
    assert resumed_from >= TRAIN_EVERY
    assert_matches_reference(out, reference)


@pytest.mark.slow
def test_training_killed_inside_a_save_resumes_bit_exact(tmp_path, reference):
    root, out = tmp_path / "root", tmp_path / "final.pt"
    # The 7th data file fsynced in this process: inside one of the first 7 saves, whatever
    # the number of files per save (2 writer threads here: the 4th save, step 20).
    rc, worker = train_run(root, out, fault="kill:after_file:7")
    assert rc == -signal.SIGKILL, worker.output
    assert not out.exists()
    (staging,) = staging_dirs(root)  # it died inside a save: its staging directory is left
    assert not (staging / "manifest.json").exists()
    died_in = int(re.match(r"\.tmp-step-(\d+)-", staging.name).group(1))

    rc, worker = train_run(root, out)
    assert rc == 0, worker.output
    assert start_step(worker) == died_in - TRAIN_EVERY  # the save before the broken one
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())
    assert_matches_reference(out, reference)
