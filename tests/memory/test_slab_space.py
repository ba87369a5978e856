"""A slab that does not fit where the segment lives (the node's /dev/shm filled by another
process after the budget check, a file-size limit) is a CheckpointError that says what to
do, not a bare OSError out of save(); nothing of it is left in the segment."""

from __future__ import annotations

import os
import resource
import signal

import torch

from ckpt._memory.private import own_segment, private_dir


def test_a_slab_that_does_not_fit_is_a_checkpoint_error(tmp_path):
    segment = os.path.join(private_dir(str(tmp_path)), "ckpt-job-node-r0")
    own_segment(segment).close()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the fault is real: the kernel refuses to reserve pages past RLIMIT_FSIZE
        try:
            os.close(r)
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
            os.write(w, out.encode())
        finally:
            os._exit(0)
    os.close(w)
    out = os.read(r, 4096).decode()
    os.close(r)
    os.waitpid(pid, 0)
    assert out.startswith("CheckpointError"), out
    assert "memory tier" in out and "MemoryTierOptions(keep=)" in out
    assert sorted(os.listdir(segment)) == ["owner.lock"]  # no slab file left
