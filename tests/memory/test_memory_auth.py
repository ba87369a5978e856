"""What the memory tier restores is bound to the job by its memory key (the root's
``.ckpt-memory-key``): a step that another job wrote at the job's segment names (the same user,
the same memory job id, another root and so another key), or one whose tag is missing, is no
candidate, and nothing pickled in it is ever loaded. The grace before a dead job's segment is
removed runs from its owner's death; a manager that fails to open holds no lock."""

from __future__ import annotations

import json
import logging
import os
import stat
import time

import pytest
import torch

import ckpt
from ckpt._memory.auth import KEY_NAME
from ckpt._memory.tier import DEAD_FILE, OWNER_FILE, private_path
from tests.support import memory_auth_workers as workers
from tests.support.s3_fixture import _moto, s3  # noqa: F401  (fixtures)
from tests.support.ranks import forkserver, run_ranks

MARKER = "pickle-ran"


class Payload:
    """A pickled value that, when unpickled, leaves a file behind (code ran)."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __reduce__(self):
        return (open, (self.where, "w"))


def manager(root, shm, *, persist_every=2, job="shared", pickle=False):
    tier = ckpt.MemoryTierOptions(shm_dir=str(shm), node="n0", job=job,
                                  persist_every=persist_every, keep=4)
    return ckpt.CheckpointManager(root, memory_tier=tier, async_save=False,
                                  options=ckpt.SaveOptions(allow_pickle=pickle))


def segment(shm) -> str:
    return os.path.join(private_path(str(shm)), "ckpt-shared-n0-r0")


def test_a_step_another_job_wrote_at_the_jobs_names_is_not_restored(tmp_path, caplog):
    """Job B (another root, so another key; the same memory job id) publishes step 900, with
    a pickled value, into the segment job A left: A restores its own newest step 3 from
    memory, the pickled value is never unpickled, and a warning names step 900."""
    shm = tmp_path / "shm"
    shm.mkdir()
    with manager(tmp_path / "a", shm) as a:  # root: step 2; memory: 2 and 3
        for step in (1, 2, 3):
            a.save(step, {"w": torch.full((8,), float(step)), "extra": {"n": step}})
    marker = str(tmp_path / MARKER)
    with manager(tmp_path / "b", shm, pickle=True) as b:
        b.save(900, {"w": torch.full((8,), 666.0), "extra": Payload(marker)}, persist=False)
    assert os.path.exists(os.path.join(segment(shm), "step-00000900"))
    state = {"w": torch.zeros(8), "extra": {}}
    with caplog.at_level(logging.WARNING, logger="ckpt"), \
            manager(tmp_path / "a", shm, pickle=True) as a:
        assert a.restore(state) == 3
        assert a.last_restore.tier == "memory"
    assert torch.equal(state["w"], torch.full((8,), 3.0)) and state["extra"] == {"n": 3}
    assert not os.path.exists(marker)
    assert any("step-00000900" in r.getMessage() and "key" in r.getMessage()
               for r in caplog.records)


def test_a_step_whose_tag_is_missing_is_not_restored(tmp_path, caplog):
    shm = tmp_path / "shm"
    shm.mkdir()
    with manager(tmp_path / "a", shm, persist_every=100) as a:  # memory only: 1, 2, 3
        for step in (1, 2, 3):
            a.save(step, {"w": torch.full((8,), float(step))})
    os.remove(os.path.join(segment(shm), ".mac-step-00000003"))
    state = {"w": torch.zeros(8)}
    with caplog.at_level(logging.WARNING, logger="ckpt"), \
            manager(tmp_path / "a", shm, persist_every=100) as a:
        assert a.restore(state) == 2 and a.last_restore.tier == "memory"
    assert torch.equal(state["w"], torch.full((8,), 2.0))
    assert any("step 3" in r.getMessage() and "no tag" in r.getMessage()
               for r in caplog.records)


@pytest.mark.multiproc
def test_a_rank_step_another_job_signed_is_no_candidate(tmp_path):
    """Two ranks on two "nodes": job A keeps step 3 in memory only; job B (another root and
    key, the same memory job id and nodes) publishes step 900 into A's segments. A restores
    its own step 3 from memory on both ranks."""
    shm = tmp_path / "shm"
    shm.mkdir()
    nodes = ["n0", "n1"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert run_ranks(2, workers.save, a, str(shm), nodes, [1, 2, 3], 2) == [[2], [2]]
    run_ranks(2, workers.save, b, str(shm), nodes, [900], 1000)
    held = os.listdir(os.path.join(private_path(str(shm)), "ckpt-shared-n0-r0"))
    assert "step-00000900" in held and "step-00000003" in held
    out = run_ranks(2, workers.restore, a, str(shm), nodes)
    assert out == [{"step": 3, "tier": "memory", "exact": True}] * 2


def test_a_key_file_others_can_read_turns_the_tier_off_and_saves_go_on(tmp_path, caplog):
    """A memory key that others may read (or that is a link) is not trusted: the tier is off
    for the manager, a warning names the file and what to do, the root gets every save."""
    shm = tmp_path / "shm"
    shm.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    key = root / KEY_NAME
    key.write_bytes(os.urandom(32))
    os.chmod(key, 0o644)
    with caplog.at_level(logging.WARNING, logger="ckpt"), \
            manager(root, shm, persist_every=100) as mgr:
        mgr.save(1, {"w": torch.ones(8)})
        assert mgr.steps() == [1]
    assert any(str(key) in r.getMessage() and "remove it" in r.getMessage()
               for r in caplog.records)
    os.remove(key)
    with manager(root, shm, persist_every=100) as mgr:  # a writer makes a private one
        mgr.save(2, {"w": torch.ones(8)}, persist=False)
    st = os.lstat(key)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 32


def test_a_manager_that_fails_to_open_releases_the_roots_lock(tmp_path):
    """The segment is in use by a live manager of another root: opening this one fails with
    a clear error, and its root's writer lock is free at once (not when the failed object is
    collected)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    with manager(tmp_path / "live", shm):
        with pytest.raises(ckpt.CheckpointError, match="in use") as failed:
            manager(tmp_path / "other", shm)
        ckpt.CheckpointManager(tmp_path / "other").close()  # the lock is free
    assert failed.value is not None  # (the traceback, and the failed manager, still alive)


@pytest.mark.multiproc
def test_a_dead_jobs_segment_is_kept_for_the_grace_period_after_its_death(tmp_path):
    """A job that ran for two hours is SIGKILLed; another job opens a tier on the node right
    after: the dead job's segment stays (its grace runs from the death), and the restarted
    job restores its memory-only step. Once its owner has been dead past the grace period,
    a later run removes it."""
    shm, root = tmp_path / "shm", tmp_path / "old"
    shm.mkdir()
    ctx = forkserver()  # a process of its own, without a second import of torch
    theirs, ours = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=workers.hold_a_segment, args=(str(root), str(shm), ours),
                       daemon=True)
    proc.start()
    try:
        assert theirs.poll(120), "the job died before saving"
        path = theirs.recv()
        two_hours_ago = time.time() - 7200
        os.utime(os.path.join(path, OWNER_FILE), (two_hours_ago, two_hours_ago))
    finally:
        proc.kill()  # SIGKILL
        proc.join()

    def another_job_opens_a_tier() -> None:
        with manager(tmp_path / "new", shm, job="new", persist_every=100):
            pass

    another_job_opens_a_tier()
    assert os.path.isdir(path)
    state = {"w": torch.zeros(8)}
    tier = ckpt.MemoryTierOptions(shm_dir=str(shm), node="n0", job="old", persist_every=100)
    with ckpt.CheckpointManager(root, memory_tier=tier) as mgr:  # the restart
        assert mgr.restore(state) == 1 and mgr.last_restore.tier == "memory"
        assert not os.path.exists(os.path.join(path, DEAD_FILE))  # alive again
    assert torch.equal(state["w"], torch.full((8,), 7.0))
    another_job_opens_a_tier()  # dead again (closed with step 1 in memory only): marked
    assert os.path.isdir(path)
    os.utime(os.path.join(path, DEAD_FILE), (two_hours_ago, two_hours_ago))
    another_job_opens_a_tier()
    assert not os.path.exists(path)


def test_discovery_reads_only_exact_segment_names_and_signed_rank_steps(tmp_path, caplog):
    """Of this node's segments only the exact names count (not another name that starts the
    same way), and of their rank steps only those signed with the job's key."""
    from ckpt._memory.auth import sign_doc
    from ckpt._memory.discovery import local_holdings
    from ckpt._memory.tier import RANK_FORMAT, private_dir

    private = private_dir(str(tmp_path))
    key = os.urandom(32)

    def rank_step(segment: str, step: int, signed_with: bytes | None) -> None:
        d = os.path.join(private, segment, f"step-{step:08d}")
        os.makedirs(d, mode=0o700)
        os.chmod(os.path.join(private, segment), 0o700)
        doc = {"format": RANK_FORMAT, "step": step, "rank": 0, "world_size": 1, "token": "t",
               "created": 1.0, "tensors": {}, "items": {}, "aliases": {}, "metadata": {},
               "table": {}}
        with open(os.path.join(d, "rank.json"), "w") as f:
            json.dump(doc if signed_with is None else sign_doc(signed_with, doc), f)

    rank_step("ckpt-j-n-r0", 1, key)
    rank_step("ckpt-j-n-r0", 2, os.urandom(32))  # another job's key
    rank_step("ckpt-j-n-r0", 3, None)  # no tag
    rank_step("ckpt-j-n-r0x", 4, key)  # not a segment name
    rank_step("ckpt-j-n-replica-r0", 5, key)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        held = local_holdings(private, "j", "n", key=key)
    assert sorted((h.segment, h.step, h.replica) for h in held) == [
        ("ckpt-j-n-r0", 1, False), ("ckpt-j-n-replica-r0", 5, True)]
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "step-00000002" in warned and "step-00000003" in warned


def test_an_object_store_roots_memory_key_is_created_once_and_kept(s3, tmp_path):
    """On an object store the key is created once (a create-only write) and read back by the
    job's later runs: a step in memory only is restored after a restart."""
    shm = tmp_path / "shm"
    shm.mkdir()
    root = s3.root("run")
    tier = ckpt.MemoryTierOptions(shm_dir=str(shm), node="n0", job="s3job", persist_every=100)
    with ckpt.CheckpointManager(root, memory_tier=tier, storage_options=s3.storage_options,
                                async_save=False) as mgr:
        mgr.save(1, {"w": torch.full((8,), 5.0)})
        key = mgr._publisher.tier.key
    assert KEY_NAME in " ".join(s3.keys()) and len(key) == 32
    state = {"w": torch.zeros(8)}
    with ckpt.CheckpointManager(root, memory_tier=tier,
                                storage_options=s3.storage_options) as mgr:
        assert mgr._publisher.tier.key == key
        assert mgr.restore(state) == 1 and mgr.last_restore.tier == "memory"
    assert torch.equal(state["w"], torch.full((8,), 5.0))
