"""The segments this user left directly in the shared-memory directory, in the layout before
the private per-user directory (0755 directories, 0644 files: readable by every local user,
and read by nothing now), are collected like any other dead segment: removed once their
owner is dead, kept while a live process holds their lock, and another user's never touched."""

from __future__ import annotations

import fcntl
import os

import pytest

from ckpt._memory.private import OWNER_FILE, gc_segments, private_dir
from tests.support import other_user


def old_segment(shm: str, name: str, uid: int | None = None) -> str:
    """A segment as the older layout left it: ``<shm>/<name>`` 0755, a step file 0644."""
    path = os.path.join(shm, name)
    os.makedirs(os.path.join(path, "step-00000003"))
    for rel in (OWNER_FILE, "step-00000003/weights.safetensors"):
        with open(os.path.join(path, rel), "wb") as f:
            f.write(b"w" * 16)
    for dirpath, dirs, files in os.walk(path):
        os.chmod(dirpath, 0o755)
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o644)
            if uid is not None:
                os.chown(os.path.join(dirpath, f), uid, uid)
        if uid is not None:
            os.chown(dirpath, uid, uid)
    return path


def test_this_users_old_layout_segments_are_collected_and_no_one_elses(tmp_path):
    shm = str(tmp_path / "shm")
    os.mkdir(shm, 0o755)
    private_dir(shm)  # a job of the current layout has run here too
    dead = old_segment(shm, "ckpt-job-n0-r0")
    live = old_segment(shm, "ckpt-job-n0-r1")
    if os.geteuid() == 0:
        hers = old_segment(shm, "ckpt-job-n0-r2", uid=other_user.other_user().pw_uid)
    else:
        hers = None
    with open(os.path.join(live, OWNER_FILE), "rb") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live job of the older code
        assert gc_segments(shm, min_age=0.0) == [dead]
    assert not os.path.exists(dead)
    assert os.path.isdir(live)
    if hers is not None:
        assert os.path.isdir(hers) and os.listdir(os.path.join(hers, "step-00000003"))


def test_an_old_layout_segment_waits_out_the_grace_and_is_not_spared_for_its_job(tmp_path):
    shm = str(tmp_path / "shm")
    os.mkdir(shm, 0o755)
    dead = old_segment(shm, "ckpt-job-n0-r0")
    assert gc_segments(shm, min_age=3600.0) == []  # found dead now: the grace starts
    assert os.path.isdir(dead)
    # the same job, now on the current layout, no longer reads it: not spared for it
    assert gc_segments(shm, keep_job="job", min_age=0.0) == [dead]
    assert not os.path.exists(dead)
