"""The memory tier where it meets restarts, rollbacks and damage, with the defaults users get
(``CheckpointManager(memory_tier=...)``, every save also in the root):

* a process that closes on SIGTERM keeps its segment, and the restart restores from memory
  bit-exact; a clean end removes it; a kept segment whose owner stays dead is collected after
  the grace;
* after a rollback (a restore that went back to a verified step, a retire of the newer steps)
  a restart never resumes from the undone line's steps the memory tier held.

Real processes (forked from the suite's fork server); a per-test job id."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
import uuid

import pytest
import torch

import ckpt
from ckpt._memory.tier import AUTO_GC_AGE, DEAD_FILE, PREFIX, SHM_DIR, gc_segments, private_path
from tests.support.ranks import run_ranks
from tests.support.workers import ForkedCode

SEGMENTS = private_path(SHM_DIR)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")

# Saves steps 1..5 of a model whose weights are a function of the step (keep=3 in memory,
# every save in the root), then: "sigterm" waits for SIGTERM (the manager's handler closes
# it); "finish" closes; "back-verified" marks step 3 verified, restores preferring it and
# retires 4 and 5 (the trainer's health rollback); "back-retire" restores step 3 and retires
# 4 and 5 (the rollback the manager documents); "memory-only" restores preferring the verified
# step 3, the only one in the root (4 and 5 in memory only, nothing to retire); each then dies
# by SIGKILL before another save. "restore": restores the newest step, says where from.
WORKER = textwrap.dedent("""
    import json, os, signal, sys, time, torch, ckpt
    root, job, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    def weights(step):
        return torch.randn(64, 32, generator=torch.Generator().manual_seed(step))
    model = torch.nn.Linear(32, 64, bias=False)
    state = {"model": model}
    persist = 1000 if mode == "memory-only" else 1
    tier = ckpt.MemoryTierOptions(job=job, keep=5 if mode == "memory-only" else 3,
                                  persist_every=persist)
    mgr = ckpt.CheckpointManager(root, memory_tier=tier)
    if mode == "restore":
        step = mgr.restore(state)
        info = mgr.last_restore
        print(json.dumps({"step": step, "tier": info.tier, "bytes": info.bytes_from_storage,
                          "exact": bool(torch.equal(model.weight.detach(), weights(step)))}))
        mgr.close()
        sys.exit(0)
    for step in range(1, 6):
        with torch.no_grad():
            model.weight.copy_(weights(step))
        mgr.save(step, state, persist=True if step == 3 and persist > 1 else None)
    mgr.wait()
    if mode == "sigterm":
        open(os.path.join(root, "..", "ready"), "w").close()
        time.sleep(600)
    if mode in ("back-verified", "memory-only"):
        mgr.mark_verified(3)
        assert mgr.restore(state, prefer="verified") == 3
    if mode == "back-retire":
        assert mgr.restore(state, step=3) == 3
    if mode in ("back-verified", "back-retire"):
        mgr.retire(s for s in mgr.steps() if s > 3)
    if mode != "finish":
        os.kill(os.getpid(), signal.SIGKILL)  # a crash before the next save
    mgr.close()
""")


@pytest.fixture
def job():
    name = f"test{uuid.uuid4().hex[:10]}"
    yield name
    for entry in segments(name):
        subprocess.run(["rm", "-rf", entry], check=False)


def segments(job: str) -> list[str]:
    if not os.path.isdir(SEGMENTS):
        return []
    return sorted(os.path.join(SEGMENTS, e) for e in os.listdir(SEGMENTS)
                  if e.startswith(f"{PREFIX}{job}-"))


def run_worker(root, job, mode) -> tuple[int, str]:
    """WORKER in a process of its own; its exit status and output."""
    proc = ForkedCode(WORKER, root, job, mode, env={**os.environ, "PYTHONPATH": REPO})
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out + err


def restored(root, job) -> dict:
    code, out = run_worker(root, job, "restore")
    assert code == 0, out
    return json.loads(out.strip().splitlines()[-1])


def sigterm_after_saving(tmp_path, job) -> str:
    """Run the "sigterm" worker, SIGTERM it once its saves are done; its kept segment."""
    root = tmp_path / "run" / "root"
    root.parent.mkdir()
    proc = ForkedCode(WORKER, root, job, "sigterm", env={**os.environ, "PYTHONPATH": REPO})
    ready = tmp_path / "run" / "ready"
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the worker did not save"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert ckpt.CheckpointManager(root, read_only=True).steps() == [1, 2, 3, 4, 5]
    [segment] = segments(job)
    return segment


@pytest.mark.multiproc
def test_a_restart_after_sigterm_restores_from_memory_and_a_clean_end_removes_it(tmp_path,
                                                                                  job):
    """A job that closes on SIGTERM (its newest step persisted too) keeps its segment: the
    restart reads step 5 from memory, bit-exact, none of it from the root. A job that ends
    cleanly removes its segment (the root holds its newest step)."""
    sigterm_after_saving(tmp_path, job)
    assert restored(tmp_path / "run" / "root", job) == {
        "step": 5, "tier": "memory", "bytes": 0, "exact": True}
    done = f"{job}done"
    try:
        code, out = run_worker(tmp_path / "done", done, "finish")
        assert code == 0, out
        assert segments(done) == []
    finally:
        for s in segments(done):
            subprocess.run(["rm", "-rf", s], check=False)


@pytest.mark.multiproc
def test_a_segment_kept_at_sigterm_is_collected_once_its_owner_stays_dead(tmp_path, job):
    """The segment kept for a restart that never comes is removed by the collection once its
    owner has been dead for AUTO_GC_AGE, not before."""
    segment = sigterm_after_saving(tmp_path, job)
    assert gc_segments(job=job, min_age=AUTO_GC_AGE) == []  # the death is noted now
    assert os.path.exists(segment)
    long_ago = time.time() - AUTO_GC_AGE - 60
    os.utime(os.path.join(segment, DEAD_FILE), (long_ago, long_ago))
    assert gc_segments(job=job, min_age=AUTO_GC_AGE) == [segment]
    assert not os.path.exists(segment)


@pytest.mark.parametrize("leaving", ["sys.exit(0)", "sys.exit(None)", "an error"])
def test_a_with_block_left_by_an_error_keeps_the_segment_and_one_left_by_exit_0_does_not(
        tmp_path, job, leaving):
    """A ``with`` block left by an exception closes before the end of training (the segment
    stays for the restart); ``sys.exit(0)`` after the final save is a clean end."""
    tier = ckpt.MemoryTierOptions(job=job)  # every save to the root too
    with pytest.raises((SystemExit, RuntimeError)):
        with ckpt.CheckpointManager(tmp_path / "root", memory_tier=tier,
                                    async_save=False) as mgr:
            mgr.save(1, {"w": torch.ones(8)})
            if leaving == "an error":
                raise RuntimeError("the training loop failed")
            raise SystemExit(0 if leaving == "sys.exit(0)" else None)
    assert bool(segments(job)) == (leaving == "an error")


@pytest.mark.multiproc
@pytest.mark.parametrize("how", ["back-verified", "back-retire", "memory-only"])
def test_a_restart_after_a_rollback_resumes_from_the_rollback_step(tmp_path, job, how):
    """Save 1..5, roll back to 3 (a restore preferring the verified step 3 or a restore of
    step 3, then a retire of 4 and 5; or, with 4 and 5 in memory only, the restore alone),
    crash before the next save: the restart restores step 3 from memory, never the undone
    line's step 5."""
    root = tmp_path / "root"
    code, out = run_worker(root, job, how)
    assert code == -signal.SIGKILL, out
    assert restored(root, job) == {"step": 3, "tier": "memory", "bytes": 0, "exact": True}


def _tier(shm: str, rank: int) -> ckpt.MemoryTierOptions:
    return ckpt.MemoryTierOptions(shm_dir=shm, node=f"n{rank}", job="back", keep=5,
                                  persist_every=1000, replicas=1)


def _w(step: int, rank: int) -> torch.Tensor:
    return torch.full((64,), float(step * 10 + rank))


def save_then_go_back(rank: int, world: int, root: str, shm: str, save: bool,
                      go_back: bool) -> dict:
    """A rank on node n<rank>: saves 1..5 (3 to the root too, the rest in memory and the
    other node's replica) and waits for the replicas, if ``save`` (and closes, unless it
    goes back too); marks step 3 verified and restores preferring it, then stops without
    closing (as a crash would), if ``go_back``. Returns the step restored and the steps its
    node's segments hold."""
    import torch.distributed as dist

    mgr = ckpt.CheckpointManager(root, memory_tier=_tier(shm, rank), async_save=False)
    if save:
        for step in range(1, 6):
            mgr.save(step, {"w": _w(step, rank)}, force=True,
                     persist=True if step == 3 else None)
        assert mgr.wait_replicated(60)
        dist.barrier()
    if not go_back:
        mgr.close()
        return {}
    if rank == 0:
        mgr.mark_verified(3)
    dist.barrier()
    step = mgr.restore({"w": torch.zeros(64)}, prefer="verified")
    held = {name: sorted(int(s[5:]) for s in os.listdir(os.path.join(private_path(shm), name))
                         if s.startswith("step-"))
            for name in os.listdir(private_path(shm)) if f"-n{rank}-" in name}
    return {"step": step, "held": held}


def restore_on_nodes(rank: int, world: int, root: str, shm: str) -> dict:
    state = {"w": torch.zeros(64)}
    with ckpt.CheckpointManager(root, memory_tier=_tier(shm, rank), async_save=False) as mgr:
        step = mgr.restore(state)
        return {"step": step, "tier": str(mgr.last_restore.tier),
                "exact": bool(torch.equal(state["w"], _w(step, rank)))}


@pytest.mark.multiproc
@pytest.mark.parametrize("fresh", [False, True], ids=["saving-process", "next-attempt"])
def test_going_back_clears_the_undone_steps_from_every_node_and_replica(tmp_path, fresh):
    """Two ranks on two nodes, each rank's steps replicated on the other node; steps 4 and 5
    in memory only. A restore that goes back to the verified step 3, in the processes that
    saved or in the next attempt's (whose receivers hold no replica segment yet), removes 4
    and 5 from both nodes' segments and replicas at once: the restarted ranks restore step 3
    from memory (left in the replicas, step 5 would be restored whole from them)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    root = str(tmp_path / "root")
    if fresh:
        run_ranks(2, save_then_go_back, root, str(shm), True, False)
    out = run_ranks(2, save_then_go_back, root, str(shm), not fresh, True)
    assert [o["step"] for o in out] == [3, 3]
    for o in out:
        assert len(o["held"]) == 2  # the rank's own segment and the replica its node holds
        assert all(steps == [1, 2, 3] for steps in o["held"].values()), o["held"]
    assert run_ranks(2, restore_on_nodes, root, str(shm)) == [
        {"step": 3, "tier": "memory", "exact": True}] * 2
