"""Writer threads count the CPUs the process may really use: a cgroup CPU quota
(``docker --cpus``, a Kubernetes limit) leaves the affinity mask listing every core of the
host, yet throttles the process to the quota; a save staged from a GPU takes one thread per
usable core, not per core of the machine.

Faults for real: a cgroup with a 1-CPU quota (v1 ``cpu`` or v2, whichever this machine
lets root create) that a process (forked from the suite's preloaded server) enters, and
this thread's own affinity mask.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckpt._save.concurrency import cores_available, writer_threads
from ckpt.options import SaveOptions
from tests.support.ranks import forkserver


def _probe(procs: str, queue) -> None:
    """In a process forked from the suite's preloaded server: enter the cgroup, report."""
    try:
        import torch

        from ckpt._save.concurrency import cpu_quota

        with open(procs, "w") as f:
            f.write(str(os.getpid()))
        torch.set_num_threads(1)
        queue.put({"affinity": len(os.sched_getaffinity(0)), "quota": cpu_quota(),
                   "cores": cores_available(),
                   "gpu": writer_threads(SaveOptions(), from_gpu=True)})
    except BaseException as e:  # the test reports it rather than waiting for a result
        queue.put({"error": repr(e)})


def _one_cpu_cgroup(tmp_name: str) -> tuple[Path, str] | None:
    """A new cgroup limited to one CPU, and how to enter it; None where none can be made."""
    v1 = Path("/sys/fs/cgroup/cpu")
    v2 = Path("/sys/fs/cgroup")
    candidates = []
    if (v1 / "cpu.cfs_quota_us").exists():
        candidates.append((v1 / tmp_name, {"cpu.cfs_period_us": "100000",
                                          "cpu.cfs_quota_us": "100000"}))
    control = v2 / "cgroup.subtree_control"
    if control.exists() and "cpu" in control.read_text().split():
        candidates.append((v2 / tmp_name, {"cpu.max": "100000 100000"}))
    for path, files in candidates:
        try:
            path.mkdir()
        except OSError:
            continue
        try:
            for name, value in files.items():
                (path / name).write_text(value)
            return path, str(path / "cgroup.procs")
        except OSError:
            path.rmdir()
    return None


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")
def test_a_one_cpu_quota_leaves_one_core_whatever_the_affinity_mask():
    made = _one_cpu_cgroup(f"ckpt-test-quota-{os.getpid()}")
    if made is None:
        pytest.skip("no cgroup with a CPU quota can be created here (needs root and a "
                    "writable cpu controller)")
    group, procs = made
    try:
        ctx = forkserver()
        queue = ctx.Queue()
        proc = ctx.Process(target=_probe, args=(procs, queue))
        proc.start()
        seen = queue.get(timeout=120)
        proc.join(30)
    finally:
        group.rmdir()  # empty again: the probe has exited
    print(f"\n  in a 1-CPU cgroup: {seen}")
    assert "error" not in seen, seen["error"]
    assert seen["quota"] == pytest.approx(1.0)
    assert seen["cores"] == 1
    assert seen["gpu"] == 1


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_a_gpu_staged_save_takes_one_writer_per_core_of_the_affinity_mask():
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs two cores in the affinity mask")
    os.sched_setaffinity(0, {min(before)})  # this thread: taskset -c <one core>
    try:
        assert cores_available() == 1
        assert writer_threads(SaveOptions(), from_gpu=True) == 1
        assert writer_threads(SaveOptions(write_threads=3), from_gpu=True) == 3  # as given
    finally:
        os.sched_setaffinity(0, before)
