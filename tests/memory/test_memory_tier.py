"""The node-local memory tier: saves published into /dev/shm, restored from there
by a later process without the persistent root, digests checked with fall-through to the root,
persist_every, and removal of dead jobs' segments. Real processes; a per-test job id."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import uuid

import pytest
import torch

import ckpt
from ckpt.errors import CheckpointError
from tests.support.workers import ForkedCode
from ckpt._memory.tier import DEAD_FILE, PREFIX, SHM_DIR, gc_segments, private_path

SEGMENTS = private_path(SHM_DIR)  # this user's segments

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")

# A worker: saves steps 1..N of a model whose weights are a function of the step, or restores.
WORKER = textwrap.dedent("""
    import os, sys, time, json, torch, ckpt
    root, job, mode, n, persist = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    def weights(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(64, 32, generator=g)
    model = torch.nn.Linear(32, 64, bias=False)
    state = {"model": model}
    tier = ckpt.MemoryTierOptions(persist_every=persist, job=job)
    mgr = ckpt.CheckpointManager(root, memory_tier=tier)
    if mode == "restore":
        step = mgr.restore(state)
        info = mgr.last_restore
        print(json.dumps({"step": step, "tier": info.tier, "bytes": info.bytes_from_storage,
                          "exact": bool(torch.equal(model.weight.detach(), weights(step)))}))
        mgr.close()
        sys.exit(0)
    for step in range(1, n + 1):
        with torch.no_grad():
            model.weight.copy_(weights(step))
        mgr.save(step, state)
    mgr.wait()
    if mode == "hang":  # wait to be SIGKILLed, mid-run, segment owned
        open(os.path.join(root, "..", "ready"), "w").close()
        time.sleep(600)
    mgr.close()
""")


@pytest.fixture
def job(tmp_path):
    name = f"test{uuid.uuid4().hex[:10]}"
    yield name
    for entry in os.listdir(SEGMENTS):
        if entry.startswith(f"{PREFIX}{name}"):
            subprocess.run(["rm", "-rf", os.path.join(SEGMENTS, entry)], check=False)


def segments(job: str) -> list[str]:
    if not os.path.isdir(SEGMENTS):
        return []
    return sorted(os.path.join(SEGMENTS, e) for e in os.listdir(SEGMENTS)
                  if e.startswith(f"{PREFIX}{job}-"))


def run_worker(root, job, mode, n=0, persist=1) -> ForkedCode:
    """WORKER in a process of its own (forked from the suite's fork server); one that does
    not hang must exit 0, its output read."""
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = ForkedCode(WORKER, root, job, mode, n, persist, env=env)
    if mode == "hang":
        return proc
    proc.stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    return proc


def restored(root, job) -> dict:
    import json
    return json.loads(run_worker(root, job, "restore").stdout.strip().splitlines()[-1])


def step_data_files(root, step) -> list[str]:
    d = os.path.join(root, f"step-{step:08d}")
    return [os.path.join(d, f) for f in os.listdir(d) if f != "manifest.json"]


@pytest.mark.multiproc
def test_second_process_restores_from_memory_without_reading_the_root(tmp_path, job):
    root = tmp_path / "root"
    run_worker(root, job, "save", n=3, persist=2)  # exits cleanly; step 3 is in memory only
    # The root holds step 2; remove its data: nothing can be read from the root.
    for f in step_data_files(root, 2):
        os.remove(f)
    # This (pytest) process is the second one: it restores from the saver's segment.
    model = torch.nn.Linear(32, 64, bias=False)
    tier = ckpt.MemoryTierOptions(persist_every=2, job=job)
    with ckpt.CheckpointManager(root, memory_tier=tier) as mgr:
        assert mgr.restore({"model": model}) == 3
        assert (mgr.last_restore.tier, mgr.last_restore.bytes_from_storage) == ("memory", 0)
    assert torch.equal(model.weight, torch.randn(64, 32, generator=torch.Generator().manual_seed(3)))


def save_steps(root, job, steps, persist) -> dict[int, torch.Tensor]:
    """Save in this process; the manager is closed (its segment's owner lock released)."""
    model, weights = torch.nn.Linear(32, 64, bias=False), {}
    tier = ckpt.MemoryTierOptions(persist_every=persist, job=job)
    with ckpt.CheckpointManager(root, memory_tier=tier) as mgr:
        for step in steps:
            with torch.no_grad():
                model.weight.add_(1.0)
            weights[step] = model.weight.detach().clone()
            mgr.save(step, {"model": model})
    return weights


def test_flipped_bit_in_memory_is_detected_and_the_root_used(tmp_path, job):
    root = tmp_path / "root"
    saved = save_steps(root, job, [1, 2, 3], persist=2)  # root: 2; memory: 2, 3
    [seg] = segments(job)
    step3 = os.path.join(seg, "step-00000003")
    data = [os.path.join(step3, f) for f in os.listdir(step3) if f != "manifest.json"]
    flip(max(data, key=os.path.getsize))
    model = torch.nn.Linear(32, 64, bias=False)
    tier = ckpt.MemoryTierOptions(persist_every=2, job=job)
    with ckpt.CheckpointManager(root, memory_tier=tier) as mgr:
        assert mgr.restore({"model": model}) == 3 - 1  # memory's step 3 is bad: not loaded
        assert mgr.last_restore.tier == "memory"  # step 2 from memory still good
        # Flip step 2 in memory too: the root's step 2 is next.
        step2 = os.path.join(seg, "step-00000002")
        for name in os.listdir(step2):
            if name != "manifest.json":
                flip(os.path.join(step2, name))
        assert mgr.restore({"model": model}) == 2
        assert mgr.last_restore.tier == "storage" and mgr.last_restore.bytes_from_storage > 0
    assert torch.equal(model.weight, saved[2])


def test_truncated_file_in_memory_is_detected_and_the_root_used(tmp_path, job):
    root = tmp_path / "root"
    saved = save_steps(root, job, [1, 2, 3], persist=2)  # root: 2; memory: 2, 3
    [seg] = segments(job)
    step3 = os.path.join(seg, "step-00000003")
    for name in os.listdir(step3):
        if name != "manifest.json":
            path = os.path.join(step3, name)
            os.truncate(path, os.path.getsize(path) // 2)
    model = torch.nn.Linear(32, 64, bias=False)
    tier = ckpt.MemoryTierOptions(persist_every=2, job=job)
    with ckpt.CheckpointManager(root, memory_tier=tier) as mgr:
        assert mgr.restore({"model": model}) == 2  # memory's step 3 is short: not loaded
        assert mgr.last_restore.tier == "memory"
    assert torch.equal(model.weight, saved[2])


def bytes_read_by_this_process() -> int:
    """What the kernel counts as returned by this process's read calls (every thread)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_bytes_from_storage_are_the_bytes_read_from_the_root(tmp_path, job):
    """From memory: none (the reads went to the segment); from the root: what its read calls
    returned, checked against the kernel's own count of the process's reads."""
    root = tmp_path / "root"
    state = {"w": torch.randn(1 << 20)}  # 4 MiB
    with ckpt.CheckpointManager(root, memory_tier=ckpt.MemoryTierOptions(job=job)) as mgr:
        mgr.save(1, state, persist=True)
        mgr.save(2, state, persist=False)  # the newest step in memory only: segment kept
    assert len(segments(job)) == 1
    files = sum(os.path.getsize(f) for f in step_data_files(root, 1))
    dest = {"w": torch.zeros(1 << 20)}
    with ckpt.CheckpointManager(root, memory_tier=ckpt.MemoryTierOptions(job=job)) as mem, \
            ckpt.CheckpointManager(root, read_only=True) as disk:
        for mgr in (mem, disk, mem, disk):  # the first two warm up (imports, caches)
            dest["w"].zero_()
            before = bytes_read_by_this_process()
            assert mgr.restore(dest) == (2 if mgr is mem else 1)
            read = bytes_read_by_this_process() - before
            assert torch.equal(dest["w"], state["w"])
        info_mem, info_disk = mem.last_restore, disk.last_restore
    assert (info_mem.tier, info_mem.bytes_from_storage, info_mem.ranks) == (
        "memory", 0, (("memory", 0),))
    assert info_disk.tier == "storage" and info_disk.bytes_from_storage >= files
    # The last restore (from the root): the kernel saw those bytes and little else.
    assert 0 <= read - info_disk.bytes_from_storage < 64 << 10


def flip(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))


@pytest.mark.multiproc
def test_sigkilled_worker_restarts_from_memory(tmp_path, job):
    root = tmp_path / "run" / "root"
    root.parent.mkdir()
    # persist_every=2: steps 2 and 4 reach the root; step 5 is in memory only.
    proc = run_worker(root, job, "hang", n=5, persist=2)
    ready = tmp_path / "run" / "ready"
    try:
        while not ready.exists():
            assert proc.poll() is None, "worker died before saving"
            try:
                proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert ckpt.CheckpointManager(root, read_only=True).steps() == [2, 4]
    for f in step_data_files(root, 4) + step_data_files(root, 2):
        os.remove(f)  # the restart must not need the root
    out = restored(root, job)
    assert out == {"step": 5, "tier": "memory", "bytes": 0, "exact": True}


def test_persist_every_puts_only_every_kth_save_in_the_root(tmp_path, job):
    model = torch.nn.Linear(4, 4)
    tier = ckpt.MemoryTierOptions(persist_every=3, keep=2, job=job)
    with ckpt.CheckpointManager(tmp_path, memory_tier=tier) as mgr:
        for step in range(1, 8):
            mgr.save(step, {"model": model})
        mgr.wait()
        assert mgr.steps() == [3, 6]
        assert mgr._publisher.tier.steps() == [6, 7]
    # step 7 is in memory only: the segment is kept at close for a restart
    assert len(segments(job)) == 1


def test_segment_removed_at_close_once_the_final_step_is_persisted(tmp_path, job):
    tier = ckpt.MemoryTierOptions(persist_every=2, job=job)
    with ckpt.CheckpointManager(tmp_path, memory_tier=tier) as mgr:
        mgr.save(1, {"model": torch.nn.Linear(4, 4)})
        mgr.save(2, {"model": torch.nn.Linear(4, 4)})
        assert len(segments(job)) == 1
    assert segments(job) == []


def test_budget_exceeded_raises_a_clear_error(tmp_path, job):
    tier = ckpt.MemoryTierOptions(budget=1000, job=job)
    with ckpt.CheckpointManager(tmp_path, memory_tier=tier) as mgr:
        with pytest.raises(CheckpointError, match="budget"):
            mgr.save(1, {"model": torch.nn.Linear(64, 64)})


def test_segments_of_dead_jobs_are_removed_by_gc_and_later_runs(tmp_path, job):
    dead, other = f"{job}dead", f"{job}old"
    try:
        # Closed with steps in memory only: segments kept, no live owner (as after a crash).
        save_steps(tmp_path / "a", dead, [1], persist=100)
        save_steps(tmp_path / "b", other, [1], persist=100)
        [dead_seg], [old_seg] = segments(dead), segments(other)
        tier = ckpt.MemoryTierOptions(job=job)
        with ckpt.CheckpointManager(tmp_path / "live", memory_tier=tier) as mgr:
            mgr.save(1, {"model": torch.nn.Linear(4, 4)})
            mgr.wait()
            # A later run removes dead segments past the grace period only: counted from
            # when a run first found their owner dead.
            tier = ckpt.MemoryTierOptions(job=f"{job}later")
            with ckpt.CheckpointManager(tmp_path / "later", memory_tier=tier):
                pass
            assert os.path.exists(old_seg) and os.path.exists(dead_seg)
            os.utime(os.path.join(old_seg, DEAD_FILE), (0, 0))
            with ckpt.CheckpointManager(tmp_path / "later", memory_tier=tier):
                pass
            assert not os.path.exists(old_seg) and os.path.exists(dead_seg)
            # gc (what `ckpt gc --memory` runs) removes the dead job, never a live owner's.
            assert gc_segments(job=dead) == [dead_seg]
            assert not os.path.exists(dead_seg)
            assert gc_segments(job=job) == [] and len(segments(job)) == 1
    finally:
        for j in (dead, other, f"{job}later"):
            for s in segments(j):
                subprocess.run(["rm", "-rf", s], check=False)


def test_cli_gc_memory_removes_dead_segments_only_with_yes(tmp_path, job, capsys):
    from verify.cli import main

    save_steps(tmp_path / "dead", job, [1], persist=100)  # closed: no live owner
    [seg] = segments(job)
    assert main(["gc", "--memory", "--job", job]) == 0
    assert seg in capsys.readouterr().out and os.path.exists(seg)  # dry run
    assert main(["gc", "--memory", "--job", job, "--yes"]) == 0
    assert not os.path.exists(seg)


def test_full_dev_shm_raises_before_writing(tmp_path, job, monkeypatch):
    import ckpt._memory.tier as mt

    with ckpt.CheckpointManager(tmp_path, memory_tier=ckpt.MemoryTierOptions(job=job)) as mgr:
        real = os.statvfs(SHM_DIR)
        full = os.statvfs_result((real.f_bsize, real.f_frsize, real.f_blocks, 0, 0)
                                 + tuple(real)[5:])
        monkeypatch.setattr(mt.os, "statvfs", lambda path: full)
        with pytest.raises(CheckpointError, match="shm-size"):
            mgr.save(1, {"model": torch.nn.Linear(4, 4)})
        assert mgr._publisher.tier.steps() == [] and mgr.steps() == []


def test_node_names_and_the_replication_ring(monkeypatch):
    from ckpt._memory.tier import node_name, replica_name, segment_name
    from ckpt._memory.replication import ring_targets

    monkeypatch.delenv("CKPT_NODE", raising=False)
    monkeypatch.setenv("GROUP_RANK", "3")  # renumbered after a node's loss: not in the name
    assert "_n3" not in node_name() and node_name("a-b/c") == "a_b_c"
    monkeypatch.setenv("CKPT_NODE", "rack-1")
    assert segment_name("job", 5) == "ckpt-job-rack_1-r5"
    assert replica_name("job", "rack-1", 2) == "ckpt-job-rack_1-replica-r2"
    # Two nodes of two ranks, then three nodes of one: the same local rank on the next node.
    nodes, local = ["a", "a", "b", "b"], [0, 1, 0, 1]
    assert [ring_targets(r, nodes, local, 1) for r in range(4)] == [[2], [3], [0], [1]]
    assert ring_targets(0, ["a", "b", "c"], [0, 0, 0], 2) == [1, 2]
    assert ring_targets(0, ["a", "b", "c"], [0, 0, 0], 5) == [1, 2]  # no more than the others
    assert ring_targets(0, ["a", "a"], [0, 1], 1) == []  # one node: nowhere to replicate


# -- persist: the final step reaches the root; the schedule by step number survives restarts --

def test_persist_true_writes_an_unscheduled_save_to_the_root_and_false_keeps_it_in_memory(
        tmp_path, job):
    model = torch.nn.Linear(4, 4)
    tier = ckpt.MemoryTierOptions(persist_every=3, keep=8, job=job)
    with ckpt.CheckpointManager(tmp_path, memory_tier=tier) as mgr:
        mgr.save(1, {"model": model}, persist=True)  # off the schedule (3, 6)
        mgr.save(2, {"model": model})
        mgr.save(3, {"model": model}, persist=False)  # on it, but memory only
        mgr.save(4, {"model": model}, persist=True)  # the final step
        mgr.wait()
        assert mgr.steps() == [1, 4]
        assert mgr._publisher.tier.steps() == [1, 2, 3, 4]
    assert segments(job) == []  # the final step is in the root: the segment is removed
    with ckpt.CheckpointManager(tmp_path / "plain") as plain:
        with pytest.raises(ValueError, match="memory_tier=True"):
            plain.save(1, {"model": model}, persist=False)


RESUMER = textwrap.dedent("""
    import sys, torch, ckpt
    root, job, last = sys.argv[1], sys.argv[2], int(sys.argv[3])
    state = {"model": torch.nn.Linear(4, 4)}
    tier = ckpt.MemoryTierOptions(persist_every=2, job=job)
    with ckpt.CheckpointManager(root, memory_tier=tier, every_steps=2) as mgr:
        start = mgr.restore(state) or 0
        print(start, mgr.last_restore.tier if mgr.last_restore else None)
        for step in range(start + 1, last + 1):
            mgr.save(step, state)
""")


@pytest.mark.multiproc
def test_persist_schedule_continues_across_a_restart(tmp_path, job):
    """every_steps=2, persist_every=2: steps 4, 8, ... reach the root, whichever process
    saves them. The first process saves 2, 4, 6 and exits (6 in memory only); the second
    resumes from 6 out of memory and saves 8 (to the root: 8 is on the schedule) and 10."""
    env = {**os.environ, "PYTHONPATH": REPO}

    def run(last: int) -> str:
        done = ForkedCode(RESUMER, tmp_path, job, last, env=env)
        stdout, stderr = done.communicate(timeout=120)
        assert done.returncode == 0, stderr
        return stdout.split()

    assert run(6) == ["0", "None"]
    assert ckpt.CheckpointManager(tmp_path, read_only=True).steps() == [4]
    assert run(10) == ["6", "memory"]
    assert ckpt.CheckpointManager(tmp_path, read_only=True).steps() == [4, 8]


def test_a_step_whose_only_copy_in_memory_is_bad_raises_never_a_fresh_start(tmp_path, job):
    """Step 3 lives only in memory (persist_every=2 put step 2 in the root; its data is
    removed here too): with step 3's segment corrupt, restore must raise, not return None
    (which a caller takes for "no checkpoint yet" and trains from scratch)."""
    root = tmp_path / "root"
    save_steps(root, job, [1, 2, 3], persist=2)
    for f in step_data_files(root, 2):
        os.remove(f)
    [seg] = segments(job)
    for step in (2, 3):
        d = os.path.join(seg, f"step-{step:08d}")
        for name in os.listdir(d):
            if name != "manifest.json":
                flip(os.path.join(d, name))
    model = torch.nn.Linear(32, 64, bias=False)
    tier = ckpt.MemoryTierOptions(persist_every=2, job=job)
    with ckpt.CheckpointManager(root, memory_tier=tier) as mgr:
        with pytest.raises(CheckpointError, match="no committed step") as info:
            mgr.restore({"model": model})
    assert "step 3 (memory tier)" in str(info.value)


def test_the_memory_tiers_reader_never_follows_a_planted_link(tmp_path):
    """The memory tier's reader never follows a symbolic link planted in a segment: a restore must
    not read whatever file this user can."""
    from ckpt._memory.shm_reader import ShmReader

    segment, secret = tmp_path / "segment", tmp_path / "secret"
    (segment / "step-00000001").mkdir(parents=True)
    secret.write_bytes(b"not a checkpoint's bytes")
    (segment / "step-00000001" / "data.bin").write_bytes(b"0123456789")
    os.symlink(secret, segment / "step-00000001" / "planted.bin")
    reader = ShmReader.of_root(str(segment), None)
    try:
        assert reader.read("step-00000001/data.bin", 2, 3) == b"234"
        with pytest.raises(FileNotFoundError, match="planted.bin"):
            reader.read("step-00000001/planted.bin")
    finally:
        reader.close()


def test_the_memory_tiers_reader_reports_a_file_that_ends_early_never_zero_fills(tmp_path):
    """The memory tier's reader raises EOFError for a file that ends before the bytes asked for: a
    segment file truncated after the verify pass is never applied with the buffer's old bytes in
    place of the missing ones."""
    from ckpt._memory.shm_reader import ShmReader

    (tmp_path / "step-00000001").mkdir()
    (tmp_path / "step-00000001" / "data.bin").write_bytes(b"0123456789")
    reader = ShmReader.of_root(str(tmp_path), None)
    try:
        out = bytearray(b"x" * 8)
        reader.read_into("step-00000001/data.bin", 0, memoryview(out))
        assert out == b"01234567"
        with pytest.raises(EOFError, match="ends before byte 14"):
            reader.read_into("step-00000001/data.bin", 6, memoryview(out))
        handle = reader.open_reader("step-00000001/data.bin")  # the apply pass's reads
        with pytest.raises(EOFError, match="ends before byte 12"):
            handle.read_into(4, memoryview(out))
        handle.close()
    finally:
        reader.close()
