"""A save staged straight into the memory tier's shared memory (ckpt/_memory/slabs.py): a
SIGKILL mid-publish leaves the previous step restorable and the new one never loaded; every
kept step restores bit-exact while the next save is written into the recycled spare; the
segment holds exactly the kept steps plus one spare, and the process no staging copy; a
spare or a step's file that was cut short is never written through again."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

import ckpt
from ckpt._memory.slabs import SPARE
from ckpt._memory.tier import PREFIX, SHM_DIR, private_path

SEGMENTS = private_path(SHM_DIR)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")


def state_of(step: int) -> dict[str, torch.Tensor]:
    """A state whose every byte depends on ``step``: odd sizes, several dtypes, an empty
    tensor and a non-contiguous view."""
    g = torch.Generator().manual_seed(step)
    wide = torch.randn(48, 33, generator=g)
    return {"w": torch.randn(300, 257, generator=g),
            "h": torch.randn(13, 7, generator=g).to(torch.bfloat16),
            "i": torch.randint(0, 1 << 30, (999,), generator=g),
            "empty": torch.zeros(0, 5),
            "t": wide.t(),
            "scalar": torch.tensor(float(step))}


def manager(root, job: str, keep: int = 2, **kw) -> ckpt.CheckpointManager:
    tier = ckpt.MemoryTierOptions(persist_every=1_000_000, job=job, keep=keep)
    return ckpt.CheckpointManager(root, memory_tier=tier,
                                  schedule=ckpt.Schedule(handle_sigterm=False), **kw)


def restored(root, job: str, step: int | None = None) -> tuple[int, dict, ckpt.api.RestoreInfo]:
    dest = {k: torch.empty_like(v) for k, v in state_of(0).items()}
    with manager(root, job) as mgr:
        got = mgr.restore(dest, step=step)
        return got, dest, mgr.last_restore


def exact(a: dict, b: dict) -> bool:
    return all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def job():
    name = f"test{uuid.uuid4().hex[:10]}"
    yield name
    if os.path.isdir(SEGMENTS):
        for entry in os.listdir(SEGMENTS):
            if entry.startswith(f"{PREFIX}{name}-"):
                subprocess.run(["rm", "-rf", os.path.join(SEGMENTS, entry)], check=False)


def segment_of(job: str) -> str:
    (name,) = [e for e in os.listdir(SEGMENTS) if e.startswith(f"{PREFIX}{job}-")]
    return os.path.join(SEGMENTS, name)


SAVER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[3])
    from tests.memory.test_memory_staging import manager, state_of
    mgr = manager(sys.argv[1], sys.argv[2], keep=1)
    for step in range(1, 4):
        mgr.save(step, state_of(step)).wait()
    mgr.close()
""")


@pytest.mark.parametrize("point", ["memory_placed", "memory_commit"])
def test_sigkill_mid_publish_keeps_the_previous_step(tmp_path, job, point):
    # keep=1: step 3 is staged into the slab that held step 1 (recycled when step 2
    # committed); the process is SIGKILLed while publishing it, before its commit.
    env = {**os.environ, "CKPT_FAULT": f"kill:{point}:3"}
    proc = subprocess.run([sys.executable, "-c", SAVER, str(tmp_path / "root"), job, REPO],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    segment = segment_of(job)
    assert any(n.startswith(".tmp-") for n in os.listdir(segment))  # the cut-short publish
    step, dest, info = restored(tmp_path / "root", job)
    assert (step, info.tier, info.bytes_from_storage) == (2, "memory", 0)
    assert exact(dest, state_of(2))
    # the next owner cleared what the crash left: step 2 and nothing else
    assert sorted(os.listdir(segment)) == [".mac-step-00000002", "owner.lock",
                                           "step-00000002"]


def test_kept_steps_restore_bit_exact_while_the_spare_is_rewritten(tmp_path, job):
    with manager(tmp_path / "root", job, keep=2) as mgr:
        for step in range(1, 6):
            mgr.save(step, state_of(step))
        mgr.wait()
    for step in (5, 4):
        got, dest, info = restored(tmp_path / "root", job, step=step)
        assert (got, info.tier) == (step, "memory")
        assert exact(dest, state_of(step))


def test_segment_holds_the_kept_steps_and_one_spare(tmp_path, job):
    """The resident copies: ``keep`` steps, one data file each, and the spare the next save
    is staged into; no staging buffer in the process."""
    with manager(tmp_path / "root", job, keep=2) as mgr:
        for step in range(1, 6):
            mgr.save(step, state_of(step)).wait()
        segment = mgr._publisher.tier.path
        steps = sorted(n for n in os.listdir(segment) if n.startswith("step-"))
        assert steps == ["step-00000004", "step-00000005"]
        data = [os.path.join(segment, s, n) for s in steps for n in
                os.listdir(os.path.join(segment, s)) if n.endswith(".safetensors")]
        spares = [os.path.join(segment, n) for n in os.listdir(segment) if n.startswith(SPARE)]
        assert len(data) == 2 and len(spares) == 1
        sizes = {os.path.getsize(p) for p in data + spares}
        assert len(sizes) == 1  # the same layout: one slab size
        state_bytes = sum(t.numel() * t.element_size() for t in state_of(0).values())
        assert state_bytes < sizes.pop() < state_bytes + 64 * 1024  # data + its header
        others = [n for n in os.listdir(segment) if not n.startswith(("step-", SPARE))]
        assert sorted(others) == [".mac-step-00000004", ".mac-step-00000005", "owner.lock"]
        assert mgr._saver.stager.nbytes() == 0  # the CPU state is staged in the slabs only
    assert not any(n.startswith(SPARE) for n in os.listdir(segment))  # closed: spare gone


def test_a_file_cut_short_is_never_written_through(tmp_path, job):
    """A truncated spare, or a truncated data file of a kept step, is not recycled (a write
    through its mapping past the end would kill the process with SIGBUS)."""
    with manager(tmp_path / "root", job, keep=1) as mgr:
        for step in (1, 2):
            mgr.save(step, state_of(step)).wait()
        segment = mgr._publisher.tier.path
        (spare,) = [n for n in os.listdir(segment) if n.startswith(SPARE)]
        os.truncate(os.path.join(segment, spare), 100)
        mgr.save(3, state_of(3)).wait()  # a new slab
        (data,) = [n for n in os.listdir(os.path.join(segment, "step-00000003"))
                   if n.endswith(".safetensors")]
        os.truncate(os.path.join(segment, "step-00000003", data), 100)
        for step in (4, 5, 6):  # step 3's slab is retired, not reused
            mgr.save(step, state_of(step)).wait()
    got, dest, info = restored(tmp_path / "root", job)
    assert (got, info.tier) == (6, "memory")
    assert exact(dest, state_of(6))


def test_sync_saves_and_prepare_stage_into_the_segment(tmp_path, job):
    with manager(tmp_path / "root", job, keep=1, async_save=False) as mgr:
        mgr.prepare(state_of(0))  # its slab becomes the spare the first save uses
        segment = mgr._publisher.tier.path
        (spare,) = [n for n in os.listdir(segment) if n.startswith(SPARE)]
        inode = os.stat(os.path.join(segment, spare)).st_ino
        mgr.save(1, state_of(1))
        (data,) = [n for n in os.listdir(os.path.join(segment, "step-00000001"))
                   if n.endswith(".safetensors")]
        assert os.stat(os.path.join(segment, "step-00000001", data)).st_ino == inode
        mgr.save(2, state_of(2))
    got, dest, _ = restored(tmp_path / "root", job)
    assert got == 2 and exact(dest, state_of(2))
