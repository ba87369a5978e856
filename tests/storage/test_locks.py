"""Writer locks on a root: the POSIX flock with its owner record, and the object store's lease.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from ckpt._format.names import MANIFEST_NAME
from storage_backends import Entry, LockHeldError, lease
from storage_backends.fsspec_store import FsspecStorage
from storage_backends.locks import FlockWriterLock


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("same_namespace", [True, False], ids=["here", "other-pidns"])
def test_a_live_lease_is_taken_over_early_only_from_a_dead_process_of_this_pid_namespace(
        same_namespace):
    """A live lease is taken over before it expires only from a dead process of this host, boot and
    pid namespace: the pid of a process of another container on this node means nothing here, and
    its writer may be alive."""
    here = lease._this_machine()
    if "boot" not in here:
        pytest.skip("no boot id on this machine")
    pidns = here["pidns"] if same_namespace else here["pidns"] + 1
    holder = {**here, "pidns": pidns, "pid": _dead_pid(), "since": time.time(),
              "expires": time.time() + 600}
    storage = FsspecStorage(f"memory://ckpt-{uuid.uuid4().hex}/root")
    storage.write(lease.LEASE_NAME, [json.dumps(holder).encode()])
    if same_namespace:
        storage.lock({"host": "me", "pid": os.getpid(), "since": 0.0}).release()
    else:
        with pytest.raises(LockHeldError):
            storage.lock({"host": "me", "pid": os.getpid(), "since": 0.0})


def test_a_lease_taken_over_while_held_is_lost_and_commits_nothing():
    """A writer whose lease another writer took over sees its renewal refused: the lock is ``lost``,
    no longer ``valid()``, its commit is refused, and its release leaves the new holder's lease
    alone."""
    storage = FsspecStorage(f"memory://ckpt-{uuid.uuid4().hex}/root", lease_ttl=0.3)
    lock = storage.lock({"host": "me", "pid": os.getpid(), "since": 0.0})
    staging = storage.begin("step-00000001", "tok")
    rival = {"host": "rival", "pid": 2, "since": time.time(), "expires": time.time() + 600}
    storage.write(lease.LEASE_NAME, [json.dumps(rival).encode()])  # the rival's takeover
    deadline = time.monotonic() + 30
    while not lock.lost and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lock.lost and not lock.valid()
    with pytest.raises(OSError, match="lease on the root was lost"):
        storage.commit(staging, "step-00000001", b"{}", MANIFEST_NAME)
    lock.release()  # must not delete the rival's lease
    assert json.loads(storage.read(lease.LEASE_NAME))["host"] == "rival"


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_refused_lock_names_no_holder_from_an_odd_or_linked_owner_file_and_leaks_nothing(
        tmp_path):
    """A refused writer names no holder from an owner file that is no JSON object or is a planted
    link (it never reads a file outside the root), and a refused lock closes its descriptor (a
    writer retrying the lock must not run out of them)."""
    root = tmp_path / "root"
    root.mkdir()
    held = FlockWriterLock(str(root), {"host": "h", "pid": 1, "since": 0.0})
    try:
        (tmp_path / "outside.json").write_text(json.dumps({"host": "outside"}))
        owner = root / ".lock.owner"
        for planted in ("link", "list"):
            owner.unlink()
            if planted == "link":
                os.symlink(tmp_path / "outside.json", owner)
            else:
                owner.write_text("[1, 2]")
            before = _open_fds()
            with pytest.raises(LockHeldError) as info:
                FlockWriterLock(str(root), {"host": "me", "pid": 2, "since": 0.0})
            assert info.value.holder == {}, planted
            assert _open_fds() == before
    finally:
        held.release()


def test_a_lock_whose_owner_record_cannot_be_written_is_released(tmp_path):
    """A lock whose owner record cannot be written is released (the root does not stay locked by a
    writer that raised), and a leftover temporary record of an earlier process with this pid does
    not make every later lock fail."""
    root = tmp_path / "root"
    (root / ".lock.owner").mkdir(parents=True)  # os.replace of the record onto it fails
    with pytest.raises(OSError):
        FlockWriterLock(str(root), {"host": "me", "pid": 1, "since": 0.0})
    (root / ".lock.owner").rmdir()
    (root / f".lock.owner.{os.getpid()}").write_text("left by a crash")
    lock = FlockWriterLock(str(root), {"host": "me", "pid": 1, "since": 0.0})
    assert json.loads((root / ".lock.owner").read_text())["host"] == "me"
    lock.release()


def test_lease_and_commit_arguments_are_checked():
    """A lease's time to live must be positive, a commit must come from the staging location, and a
    name that is both an object and a prefix is listed once, as a directory."""
    storage = FsspecStorage(f"memory://ckpt-{uuid.uuid4().hex}/root", lease_ttl=0)
    with pytest.raises(ValueError, match="ttl must be positive"):
        storage.lock({"host": "me", "pid": 1, "since": 0.0})
    storage.begin("step-00000001", "tok")
    with pytest.raises(ValueError, match="is not the staging location"):
        storage.commit("step-00000002", "step-00000001", b"{}", MANIFEST_NAME)
    assert lease.children("", ["a/x", "a", "b"]) == [Entry("a", True), Entry("b", False)]
