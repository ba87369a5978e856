"""A process forked from the owner of a segment (a DataLoader worker, a multiprocessing child)
holds nothing of it: no descriptor into this user's private directory (the owner lock, the
slabs' files) and no mapping of a slab. So a restarted worker owns its segment at once while
the dead one's children still live, and a deleted slab's pages leave /dev/shm at once."""

from __future__ import annotations

import os
import signal
import time

from ckpt._memory.private import own_segment, private_dir
from tests.support.ranks import forkserver


def _owner(segment: str, conn) -> None:
    """Own ``segment``, make a slab, fork a child as a DataLoader worker is, and send
    (child's pid, the slab's path); then wait to be killed."""
    import torch

    from ckpt._memory.slabs import SlabPool

    torch.set_num_threads(1)
    held = own_segment(segment)
    pool = SlabPool(segment, 2)
    slab = pool.acquire([("w", (0,), torch.zeros(1 << 20, dtype=torch.uint8))],
                        1 << 20, lambda nbytes: None)
    if os.fork() == 0:  # the child: it says so once it runs
        try:
            conn.send((os.getpid(), slab.path))
            time.sleep(60)
        finally:
            os._exit(0)
    time.sleep(60)
    del held


def owner_with_a_forked_child(segment: str):
    """The owner of ``segment``, started from the suite's fork server (a single-threaded
    process that imported torch already: a fork of the test process itself may inherit a
    lock another thread holds), and its forked child: (owner process, child's pid, the
    slab's path)."""
    ctx = forkserver()
    ours, theirs = ctx.Pipe(duplex=False)
    owner = ctx.Process(target=_owner, args=(segment, theirs), daemon=True)
    owner.start()
    theirs.close()
    if not ours.poll(120):
        owner.kill()
        raise AssertionError(f"the segment's owner sent nothing (exit code {owner.exitcode})")
    child, slab = ours.recv()
    ours.close()
    return owner, child, slab


def test_a_forked_child_holds_no_descriptor_or_mapping_of_the_segment(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    private = os.path.realpath(private_dir(str(shm)))
    segment = os.path.join(private, "ckpt-job-node-r0")
    owner, child, slab = owner_with_a_forked_child(segment)
    try:
        fds = [os.readlink(f"/proc/{child}/fd/{n}") for n in os.listdir(f"/proc/{child}/fd")]
        assert not [f for f in fds if f.startswith(private)]
        with open(f"/proc/{child}/maps") as f:
            assert slab not in f.read()
        with open(f"/proc/{owner.pid}/maps") as f:
            assert slab in f.read()  # the owner's own mapping stays
        owner.kill()  # the owner dies; its child lives on
        owner.join()
        held = own_segment(segment, wait=0)  # the restarted worker owns the segment
        held.close()
    finally:
        owner.kill()
        owner.join()
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
