"""A process forked from the owner of a segment (a DataLoader worker, a multiprocessing child)
holds nothing of it: no descriptor into this user's private directory (the owner lock, the
slabs' files) and no mapping of a slab. So a restarted worker owns its segment at once while
the dead one's children still live, and a deleted slab's pages leave /dev/shm at once."""

from __future__ import annotations

import os
import signal
import time

from ckpt._memory.private import own_segment, private_dir


def owner_with_a_forked_child(segment: str) -> tuple[int, int, str]:
    """A process (forked from this one: no second import of torch) that owns ``segment``
    and made a slab, then forked a child of its own, as a DataLoader worker is: (owner's
    pid, child's pid, the slab's path)."""
    import torch

    from ckpt._memory.slabs import SlabPool

    r, w = os.pipe()
    owner = os.fork()
    if owner == 0:
        try:
            os.close(r)
            held = own_segment(segment)
            pool = SlabPool(segment, 2)
            slab = pool.acquire([("w", (0,), torch.zeros(1 << 20, dtype=torch.uint8))],
                                1 << 20, lambda nbytes: None)
            if os.fork() == 0:  # the child: it says so once it runs
                os.write(w, f"{os.getpid()} {slab.path}".encode())
                os.close(w)
                time.sleep(60)
                os._exit(0)
            os.close(w)
            time.sleep(60)
            del held
        finally:
            os._exit(0)
    os.close(w)
    child, slab = os.read(r, 4096).decode().split()
    os.close(r)
    return owner, int(child), slab


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
        with open(f"/proc/{owner}/maps") as f:
            assert slab in f.read()  # the owner's own mapping stays
        os.kill(owner, signal.SIGKILL)  # the owner dies; its child lives on
        os.waitpid(owner, 0)
        held = own_segment(segment, wait=0)  # the restarted worker owns the segment
        held.close()
    finally:
        for pid in (owner, child):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(owner, 0)
        except ChildProcessError:
            pass
