"""A save to the memory tier alone, of state in host memory, is in memory when save() returns,
also when SIGTERM arrives while it is published."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import ckpt
from tests.support.ranks import run_forked

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")


def _tier(job: str) -> ckpt.MemoryTierOptions:
    return ckpt.MemoryTierOptions(persist_every=1000, job=job)  # the root: 1 save in 1000


def _weights(step: int) -> torch.Tensor:
    return torch.full((256, 64), float(step))


def _save_then_die(root: str, job: str) -> None:
    """Save steps 1..3 (to memory only), the third with the writer thread held busy, as a
    writer the scheduler has not run yet is; SIGKILL the process the moment save(3)
    returns."""
    mgr = ckpt.CheckpointManager(root, memory_tier=_tier(job), async_save=True)
    for step in (1, 2):
        mgr.save(step, {"w": _weights(step)}).wait()
    never = threading.Event()
    mgr._saver.writer.submit_call(0, 0.0, lambda pool: never.wait())  # the writer is busy
    mgr.save(3, {"w": _weights(3)})
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_process_killed_as_a_memory_only_save_returns_restarts_from_that_step(tmp_path):
    job = f"inline{os.getpid()}"
    root = str(tmp_path / "root")
    assert run_forked(_save_then_die, root, job, timeout=120) == -signal.SIGKILL
    state = {"w": torch.zeros(256, 64)}
    mgr = ckpt.CheckpointManager(root, memory_tier=_tier(job))
    try:
        assert mgr.restore(state) == 3
        assert mgr.last_restore.tier == "memory" and torch.equal(state["w"], _weights(3))
        assert 3 not in mgr.steps()  # memory alone held it
    finally:
        segment = mgr._publisher.tier.path
        mgr.close()
        shutil.rmtree(segment, ignore_errors=True)


def test_sigterm_while_a_memory_only_save_is_published_exits_after_it(tmp_path):
    """SIGTERM reaches the manager's handler (on the main thread, the one publishing) midway
    through the publish of a memory-only save: the save is published first, then the
    process exits with 143, and the restart restores that step from memory."""
    job = f"term{os.getpid()}"
    root = str(tmp_path / "root")
    child = textwrap.dedent(f"""
        import torch, ckpt
        mgr = ckpt.CheckpointManager({root!r}, memory_tier=ckpt.MemoryTierOptions(
            persist_every=1000, job={job!r}))
        for step in (1, 2, 3):
            mgr.save(step, {{"w": torch.full((256, 64), float(step))}})
        raise SystemExit("not terminated")
    """)
    env = {**os.environ, "CKPT_FAULT": "term:memory_commit:3"}  # in step 3's publish
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    state = {"w": torch.zeros(256, 64)}
    mgr = ckpt.CheckpointManager(root, memory_tier=_tier(job))
    try:
        assert mgr.restore(state) == 3
        assert mgr.last_restore.tier == "memory" and torch.equal(state["w"], _weights(3))
    finally:
        segment = mgr._publisher.tier.path
        mgr.close()
        shutil.rmtree(segment, ignore_errors=True)


def test_a_failed_publish_raised_at_close_still_lets_the_segment_go(tmp_path, monkeypatch):
    """The publish of a memory-only save fails; close() raises its error and still lets go of
    the segment (its owner lock and threads), which the next manager then owns."""
    import ckpt._memory.tier as tier_module

    job = f"fail{os.getpid()}"
    root = str(tmp_path / "root")
    mgr = ckpt.CheckpointManager(root, memory_tier=_tier(job))
    mgr.save(1, {"w": _weights(1)}).wait()

    def failing(name: str) -> None:
        if name == "memory_commit":
            raise OSError(5, "injected: the publish failed")

    monkeypatch.setattr(tier_module, "fault_point", failing)
    mgr.save(2, {"w": _weights(2)})
    monkeypatch.undo()
    with pytest.raises(ckpt.CheckpointError, match="publishing step 2 .* injected"):
        mgr.close()
    state = {"w": torch.zeros(256, 64)}
    again = ckpt.CheckpointManager(root, memory_tier=_tier(job))
    try:
        assert again.restore(state) == 1 and again.last_restore.tier == "memory"
        again.save(2, {"w": _weights(2)}).wait()
    finally:
        segment = again._publisher.tier.path
        again.close()
        shutil.rmtree(segment, ignore_errors=True)


def test_a_memory_only_saves_result_counts_its_publish_as_blocking(tmp_path):
    """Published on the caller's thread, a memory-only save blocks for its copy and its
    publish: its result says so, as its handle does (metrics and logs read the result)."""
    mgr = ckpt.CheckpointManager(tmp_path / "root", memory_tier=_tier(f"blk{os.getpid()}"),
                                 async_save=True)
    try:
        for step in (1, 2, 3):
            handle = mgr.save(step, {"w": _weights(step)})
            result = handle.wait()
            assert handle.done() and 0 < result.blocking_seconds <= handle.blocking_seconds
            assert result.blocking_seconds >= result.write_seconds  # the publish is in it
    finally:
        segment = mgr._publisher.tier.path
        mgr.close()
        shutil.rmtree(segment, ignore_errors=True)
