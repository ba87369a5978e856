"""A restore from this node's memory tier spreads each data file's reads over the cores: the
bytes are in memory, so a read is a copy bound by the CPU, not by a disk. Each block is still
digested where it lands, and a step that fails its digests is passed over for the one
before, whose load overwrites everything the failed one wrote."""

from __future__ import annotations

import os
import shutil
import threading
import uuid

import pytest
import torch

import ckpt
import ckpt._load.read_run as read_run
from ckpt.errors import CheckpointError
from ckpt._memory.shm_reader import ShmReader
from ckpt._memory.tier import PREFIX, SHM_DIR, private_path

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")

SEGMENTS = private_path(SHM_DIR)
TENSORS, ROWS = 8, 256  # 8 tensors of 256 x 256 fp32 (256 KiB each): one slab, 2 MiB


@pytest.fixture
def job():
    name = f"test{uuid.uuid4().hex[:10]}"
    yield name
    for entry in os.listdir(SEGMENTS) if os.path.isdir(SEGMENTS) else []:
        if entry.startswith(f"{PREFIX}{name}"):
            shutil.rmtree(os.path.join(SEGMENTS, entry), ignore_errors=True)


@pytest.fixture
def two_cores(monkeypatch):
    """Two cores whatever this machine has, so that the spread is the same everywhere."""
    monkeypatch.setattr(read_run, "_cores", lambda: 2)


#: How long the first thread to read a data file waits for a second one (never, when the
#: file's reads are not spread; else as long as the pool takes to hand out the next run).
RENDEZVOUS_S = 5.0


@pytest.fixture
def reading_threads(monkeypatch):
    """path -> the reading threads that read a data file from the memory tier into place
    (``read_into``); ("verify", path) -> those that streamed it through a block to check it
    first. The first thread to read a file waits until another reads it too (at most
    ``RENDEZVOUS_S``): a thread that is done with its run never takes the next one, so
    spread runs show as several threads however fast each is."""
    seen: dict = {}
    met: dict = {}
    lock = threading.Lock()
    read_into, read_blocks = ShmReader.read_into, ShmReader.read_blocks

    def note(key) -> None:
        if ("/data-" not in (key[1] if isinstance(key, tuple) else key)
                or threading.current_thread() is threading.main_thread()):
            return  # the calling thread reads the data files' headers only
        me = threading.get_ident()
        with lock:
            threads = seen.setdefault(key, set())
            first = not threads
            threads.add(me)
            event = met.setdefault(key, threading.Event())
            if len(threads) > 1:
                event.set()
        if first:
            event.wait(RENDEZVOUS_S)

    def counted_read_into(self, path, start, out):
        note(path)
        return read_into(self, path, start, out)

    def counted_read_blocks(self, path, start, length, buffer):
        note(("verify", path))
        return read_blocks(self, path, start, length, buffer)

    monkeypatch.setattr(ShmReader, "read_into", counted_read_into)
    monkeypatch.setattr(ShmReader, "read_blocks", counted_read_blocks)
    return seen


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {f"w{i}": torch.randn(ROWS, 256, generator=g) for i in range(TENSORS)}


def manager(root, job) -> ckpt.CheckpointManager:
    return ckpt.CheckpointManager(
        root, memory_tier=ckpt.MemoryTierOptions(persist_every=10**6, job=job),
        options=ckpt.SaveOptions(write_threads=2), async_save=False,
        schedule=ckpt.Schedule(handle_sigterm=False))


def save(root, job, steps) -> None:
    with manager(root, job) as mgr:
        for step in steps:
            mgr.save(step, weights(step))


def data_file(job: str, step: int) -> str:
    [segment] = [os.path.join(SEGMENTS, e) for e in os.listdir(SEGMENTS)
                 if e.startswith(f"{PREFIX}{job}-")]
    step_dir = os.path.join(segment, f"step-{step:08d}")
    [name] = [f for f in os.listdir(step_dir) if f.startswith("data-")]
    return os.path.join(step_dir, name)


def flip_near_end(path: str) -> None:
    """Flip a bit 100 bytes before the end of ``path``: in the last tensor's chunk."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


def test_one_data_file_is_read_by_several_threads(tmp_path, job, two_cores, reading_threads):
    save(tmp_path / "root", job, [1])
    state = {k: torch.zeros_like(v) for k, v in weights(1).items()}
    with manager(tmp_path / "root", job) as mgr:
        assert mgr.restore(state) == 1
        assert mgr.last_restore.tier == "memory"
    assert all(torch.equal(state[k], v) for k, v in weights(1).items())
    [threads] = [t for path, t in reading_threads.items() if "/data-" in path]
    assert len(threads) == 2
    assert not [key for key in reading_threads if key[0] == "verify"]  # one pass


def test_a_flipped_bit_in_the_last_run_falls_back_to_the_step_before(tmp_path, job,
                                                                    two_cores,
                                                                    reading_threads):
    """The flip lies in the second thread's run: its chunk fails, the first thread's run
    was written already; step 1 from memory then overwrites every tensor."""
    save(tmp_path / "root", job, [1, 2])
    flip_near_end(data_file(job, 2))
    state = {k: torch.zeros_like(v) for k, v in weights(1).items()}
    with manager(tmp_path / "root", job) as mgr:
        assert mgr.restore(state) == 1
        assert mgr.last_restore.tier == "memory"
        assert [s for s, _, _ in mgr.last_restore.skipped] == [2]
    assert all(torch.equal(state[k], v) for k, v in weights(1).items())
    [step2] = [t for path, t in reading_threads.items() if "step-00000002/data-" in path]
    assert len(step2) == 2


def test_a_chosen_step_is_verified_on_several_threads_before_anything_changes(
        tmp_path, job, two_cores, reading_threads):
    """``restore(step=N)`` keeps its two passes (a failure must change nothing): the verify
    pass is spread over the cores too, and a flip in its last run leaves every tensor as
    it was."""
    save(tmp_path / "root", job, [1, 2])
    state = {k: torch.zeros_like(v) for k, v in weights(1).items()}
    with manager(tmp_path / "root", job) as mgr:
        assert mgr.restore(state, step=2) == 2
        assert mgr.last_restore.tier == "memory"
    assert all(torch.equal(state[k], v) for k, v in weights(2).items())
    [verified] = [t for key, t in reading_threads.items()
                  if key[0] == "verify" and "step-00000002/data-" in key[1]]
    assert len(verified) == 2

    flip_near_end(data_file(job, 2))
    state = {k: torch.zeros_like(v) for k, v in weights(1).items()}
    with manager(tmp_path / "root", job) as mgr, pytest.raises(CheckpointError):
        mgr.restore(state, step=2)
    assert all(not t.any() for t in state.values())
