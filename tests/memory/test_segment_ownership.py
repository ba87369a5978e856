"""Another local user cannot reach the job's memory tier: a segment she plants at the job's
names (a self-consistent step 900 from her own run), a directory she creates where the job's
segments go, a lock she takes on the job's lock file and reads of its files all fail to
affect the job. The job restores its own newest step, says clearly when it cannot use its
memory tier, and deletes nothing of hers.

The job runs as root here (the test process), she as ``ckptother``
(tests/support/other_user.py); root ignores permission bits, so what protects the job is the
memory tier's own checks of who owns what it uses."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import uuid

import pytest
import torch

import ckpt
from ckpt._memory.tier import SHM_DIR, private_path
from tests.support import other_user

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")

# Her run: a manager of her own whose memory tier uses the job's id and node, one step 900
# kept in memory, its segment then copied to each target she names (what she could plant).
HER_RUN = """
import glob, json, os, shutil, sys, torch, ckpt
root, shm, job, targets = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
os.makedirs(shm, exist_ok=True)
tier = ckpt.MemoryTierOptions(shm_dir=shm, job=job, node="n0", persist_every=1000)
with ckpt.CheckpointManager(root, memory_tier=tier) as mgr:
    mgr.save(900, {"w": torch.full((8,), 666.0)}, persist=False)
[seg] = glob.glob(os.path.join(shm, "**", f"ckpt-{job}-n0-r0"), recursive=True)
out = {}
for target in targets:
    try:
        shutil.copytree(seg, target)
        out[target] = "planted"
    except OSError as e:
        out[target] = type(e).__name__
print(json.dumps(out))
"""

# Her attempts on the job's files: list, read, lock (held until she is killed).
HER_ATTEMPTS = """
import fcntl, json, os, sys, time
listing, reads, lock = sys.argv[1], sys.argv[2:-1], sys.argv[-1]
out = {}
def attempt(what, fn):
    try:
        fn()
        out[what] = "done"
    except OSError as e:
        out[what] = type(e).__name__
attempt("list", lambda: os.listdir(listing))
for path in reads:
    attempt(path, lambda: open(path, "rb").read())
held = []
def take():
    f = open(lock, "r")
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    held.append(f)
attempt("lock", take)
print(json.dumps(out), flush=True)
time.sleep(600 if held else 0)
"""


@pytest.fixture
def shared():
    other_user.other_user()
    path = other_user.shared_dir()
    her = os.path.join(path, "her")
    os.mkdir(her)
    shutil.chown(her, other_user.NAME, other_user.NAME)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def weights(step: int) -> torch.Tensor:
    return torch.full((8,), float(step))


def options(job: str, shm: str = SHM_DIR, persist_every: int = 2) -> ckpt.MemoryTierOptions:
    return ckpt.MemoryTierOptions(shm_dir=shm, job=job, node="n0", persist_every=persist_every)


def run_her(code: str, *args: str, scratch: str) -> dict:
    done = subprocess.run(other_user.python(code, *args, scratch=scratch), capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.multiproc
def test_a_segment_she_plants_at_the_jobs_names_is_never_restored(tmp_path, shared):
    """Her self-consistent step 900, made by her own run with the job's memory id and node,
    copied to the job's segment name in /dev/shm: the job restores its own step 3 and her
    copies are left alone. She cannot put anything into the job's own segment directory."""
    job = f"own{uuid.uuid4().hex[:10]}"
    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, memory_tier=options(job, persist_every=1)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": weights(step)})
    plants = [os.path.join(SHM_DIR, f"ckpt-{job}-n0-r0"),  # the name the job's segment had
              os.path.join(private_path(SHM_DIR), f"ckpt-{job}-n0-r0")]
    her = os.path.join(shared, "her")
    try:
        out = run_her(HER_RUN, os.path.join(her, "root"), os.path.join(her, "shm"), job,
                      *plants, scratch=shared)
        assert out[plants[1]] == "PermissionError"  # the job's private directory
        state = {"w": torch.zeros(8)}
        with ckpt.CheckpointManager(root, memory_tier=options(job)) as mgr:
            assert mgr.restore(state) == 3
        assert torch.equal(state["w"], weights(3))
        # Nothing of hers was deleted (the job's start collects dead segments).
        assert out[plants[0]] == "planted" and os.listdir(plants[0])
        assert any("ckpt-" in name for name in os.listdir(os.path.join(her, "shm")))
    finally:
        shutil.rmtree(plants[0], ignore_errors=True)


@pytest.mark.parametrize("made", ["directory", "link"])
def test_a_directory_she_made_where_the_jobs_segments_go_turns_the_tier_off_clearly(
        tmp_path, shared, made, caplog):
    """She makes the job's private directory first (her own directory, or a link to one),
    and the old-style segment name: the job says its memory tier is off and what to do,
    saves to its root, restores its own newest step, and writes nothing into her
    directories (which stay)."""
    job = f"pre{uuid.uuid4().hex[:10]}"
    shm = os.path.join(shared, "shm")  # a /dev/shm of this test's own: world-writable
    os.mkdir(shm)
    os.chmod(shm, 0o1777)
    private = private_path(shm)
    segment = os.path.join(shm, f"ckpt-{job}-n0-r0")
    hers = os.path.join(shared, "her", "decoy")
    make = (f"import os; os.mkdir({hers!r}, 0o777); os.mkdir({segment!r}, 0o777); "
            + (f"os.mkdir({private!r}, 0o777)" if made == "directory"
               else f"os.symlink({hers!r}, {private!r})"))
    done = subprocess.run(other_user.python(make + "; print('{}')", scratch=shared),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    root = tmp_path / "root"
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        with ckpt.CheckpointManager(root, memory_tier=options(job, shm)) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, {"w": weights(step)})
        state = {"w": torch.zeros(8)}
        with ckpt.CheckpointManager(root, memory_tier=options(job, shm)) as mgr:
            assert mgr.restore(state) == 3 and mgr.last_restore.tier == "storage"
    assert torch.equal(state["w"], weights(3))
    assert ckpt.CheckpointManager(root, read_only=True).steps()[-1] == 3
    off = [r.getMessage() for r in caplog.records if "is off" in r.getMessage()]
    assert off and private in off[0] and "MemoryTierOptions(shm_dir=" in off[0]
    assert os.listdir(hers) == [] and os.listdir(segment) == []  # nothing of the job there
    assert os.lstat(private).st_uid == other_user.other_user().pw_uid  # hers, left alone


@pytest.mark.multiproc
def test_she_cannot_read_list_or_lock_the_jobs_segment(tmp_path, shared):
    """With the job's newest step in memory only, she tries to list its segments, read its
    files and flock its owner.lock: all refused; the job opens its memory tier again and
    restores that step from memory."""
    job = f"lck{uuid.uuid4().hex[:10]}"
    shm = os.path.join(shared, "shm")
    os.mkdir(shm)
    os.chmod(shm, 0o1777)
    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, memory_tier=options(job, shm)) as mgr:
        for step in (1, 2, 3):  # root: 2; memory: 2, 3
            mgr.save(step, {"w": weights(step)})
        mgr.wait()
        segment = mgr._publisher.tier.path
    files = [os.path.join(dirpath, name) for dirpath, _, names in os.walk(segment)
             for name in names]
    assert any("step-00000003" in f for f in files)
    her = subprocess.Popen(other_user.python(HER_ATTEMPTS, os.path.dirname(segment), *files,
                                             os.path.join(segment, "owner.lock"),
                                             scratch=shared),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = her.stdout.readline()
        assert line, her.stderr.read()
        out = json.loads(line)
        assert out["list"] == "PermissionError" and out["lock"] == "PermissionError"
        assert all(out[f] == "PermissionError" for f in files)
        state = {"w": torch.zeros(8)}
        with ckpt.CheckpointManager(root, memory_tier=options(job, shm)) as mgr:
            assert mgr.restore(state) == 3 and mgr.last_restore.tier == "memory"
        assert torch.equal(state["w"], weights(3))
    finally:
        her.kill()  # runuser passes it on (the lock, if she got it, goes with her)
        her.wait()


# Her swap: the job's private directory moved aside, a link to another directory of the
# job's user put in its place (the job would then remove a segment there by its path).
HER_SWAP = """
import json, os, sys
private, aside, target = sys.argv[1:]
try:
    os.rename(private, aside)
    os.symlink(target, private)
    print(json.dumps({"swapped": True}))
except OSError as e:
    print(json.dumps({"swapped": type(e).__name__}))
"""


@pytest.mark.multiproc
def test_a_shm_dir_others_may_rename_in_turns_the_tier_off(tmp_path, shared, caplog):
    """The job is given a shared-memory directory that every user may write and that is not
    sticky: she could rename the job's private directory there and put a link to another of
    the job's directories in its place, between its checks and the job's later removal by
    path. The job turns its memory tier off and says why; the other directory is intact."""
    job = f"swp{uuid.uuid4().hex[:10]}"
    shm = os.path.join(shared, "shm")
    os.mkdir(shm)
    os.chmod(shm, 0o777)  # world-writable, not sticky
    precious = tmp_path / "elsewhere" / f"ckpt-{job}-n0-r0" / "precious"
    precious.parent.mkdir(parents=True)
    precious.write_bytes(b"the job user's other data")
    root = tmp_path / "root"
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        with ckpt.CheckpointManager(root, memory_tier=options(job, shm)) as mgr:
            for step in (1, 2):
                mgr.save(step, {"w": weights(step)})
            run_her(HER_SWAP, private_path(shm), os.path.join(shm, "aside"),
                    str(tmp_path / "elsewhere"), scratch=shared)
    assert precious.read_bytes() == b"the job user's other data"
    off = [r.getMessage() for r in caplog.records if "is off" in r.getMessage()]
    assert off and shm in off[0] and "sticky" in off[0]
    assert ckpt.CheckpointManager(root, read_only=True).steps()[-1] == 2
