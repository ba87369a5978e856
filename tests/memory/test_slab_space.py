"""A slab that does not fit where the segment lives (the node's /dev/shm filled by another
process after the budget check, a file-size limit) is a CheckpointError that says what to
do, not a bare OSError out of save(); nothing of it is left in the segment."""

from __future__ import annotations

import os
import resource
import signal

import torch

from ckpt._memory.private import own_segment, private_dir
from tests.support.ranks import forkserver


def _fill_past_the_limit(segment: str, conn) -> None:
    """Under a file-size limit of 1 MiB, ask the segment for a 4 MiB slab; send what
    happened. The fault is real: the kernel refuses to reserve pages past RLIMIT_FSIZE."""
    from ckpt._memory.slabs import SlabPool
    from ckpt.errors import CheckpointError

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    try:
        SlabPool(segment, 2).acquire(
            [("w", (0,), torch.zeros(4 << 20, dtype=torch.uint8))], 1 << 20,
            lambda nbytes: None)
        out = "no error"
    except CheckpointError as e:
        out = f"CheckpointError {e}"
    except BaseException as e:  # noqa: BLE001 (reported to the test)
        out = f"{type(e).__name__} {e}"
    conn.send(out)


def test_a_slab_that_does_not_fit_is_a_checkpoint_error(tmp_path):
    segment = os.path.join(private_dir(str(tmp_path)), "ckpt-job-node-r0")
    own_segment(segment).close()
    # A process of its own for the limit, from the suite's fork server (single-threaded,
    # torch imported): a fork of the test process may inherit a lock another thread holds.
    ctx = forkserver()
    ours, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_fill_past_the_limit, args=(segment, theirs), daemon=True)
    proc.start()
    theirs.close()
    try:
        assert ours.poll(120), f"the process sent nothing (exit code {proc.exitcode})"
        out = ours.recv()
    finally:
        proc.kill()
        proc.join()
    assert out.startswith("CheckpointError"), out
    assert "memory tier" in out and "MemoryTierOptions(keep=)" in out
    assert sorted(os.listdir(segment)) == ["owner.lock"]  # no slab file left
