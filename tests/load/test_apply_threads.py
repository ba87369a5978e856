"""The apply pass of a two-pass load copies from the page cache on every free core.

After the verify pass the files are in the page cache, so reading a chunk again into its live
tensor is a memory copy, bound by the CPU: one file's chunks are cut into contiguous runs,
one per core, each read in offset order. A failure in any run still stops every run and the
error names exactly the live tensors that changed.
"""

from __future__ import annotations

import threading

import pytest
import torch

import ckpt
from ckpt import CheckpointManager, PartialLoadError, SaveOptions
from ckpt._load import read_run
from storage_backends import PosixStorage

N = 16
CHUNK = 128 << 10


def save_one_file(root) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    # chunks of 128 KiB: large enough that the load reads on its pool (not "tiny")
    state = {f"t{i:02d}": torch.randn(128, 256, generator=gen) for i in range(N)}
    with CheckpointManager(root, async_save=False, metrics=False,
                           schedule=ckpt.Schedule(handle_sigterm=False),
                           options=SaveOptions(chunk_bytes=CHUNK, write_threads=1)) as mgr:
        mgr.save(1, state)
    return state


class _Recording(PosixStorage):
    """Records (thread, path, start, length) of every read through ``open_reader`` (the
    apply pass; the verify pass streams through ``read_blocks``); fails the read at
    ``fail_at``; with ``together``, each thread's first chunk read waits until that many
    threads are reading at once (a load that reads on fewer threads fails)."""

    def __init__(self, root, fail_at: int | None = None, together: int = 1) -> None:
        super().__init__(root)
        self.fail_at = fail_at
        self.barrier = threading.Barrier(together, timeout=10) if together > 1 else None
        self.waited: set[int] = set()
        self.reads: list[tuple[int, str, int, int]] = []
        self._lock = threading.Lock()

    def open_reader(self, path):
        reader, storage = super().open_reader(path), self

        class Recorded:
            def read_into(self, start, out):
                me = threading.get_ident()
                with storage._lock:
                    storage.reads.append((me, path, start, len(out)))
                    first = len(out) == CHUNK and me not in storage.waited
                    storage.waited.add(me)
                if first and storage.barrier is not None:
                    storage.barrier.wait()  # BrokenBarrierError: the threads never overlapped
                if start == storage.fail_at:
                    raise OSError(5, "Input/output error (injected)")
                reader.read_into(start, out)

            def close(self):
                reader.close()

        return Recorded()


def data_reads(storage: _Recording) -> dict[int, list[int]]:
    """The chunk reads (not the header's) by thread, in the order each thread made them."""
    by_thread: dict[int, list[int]] = {}
    for thread, path, start, n in storage.reads:
        if n == CHUNK:
            by_thread.setdefault(thread, []).append(start)
    return by_thread


@pytest.mark.parametrize("cores", [1, 2, 3])
def test_one_file_is_copied_on_as_many_threads_as_cores_each_run_in_order(
        tmp_path, monkeypatch, cores):
    state = save_one_file(tmp_path)
    monkeypatch.setattr(read_run, "_cores", lambda: cores)
    # the load's pool has min(4, cpu_count) threads: the runs beyond it wait for a thread
    threads = min(cores, ckpt.options.default_threads())
    storage = _Recording(tmp_path, together=threads)
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    with CheckpointManager(storage, read_only=True, metrics=False) as mgr:
        assert mgr.restore(live, step=1) == 1  # an explicit step: verified, then applied
    assert all(torch.equal(live[k], state[k]) for k in state)
    by_thread = data_reads(storage)
    assert len(by_thread) == threads
    runs = sorted(by_thread.values())
    for run in runs:
        assert run == sorted(run), "a run is read in offset order"
    starts = [s for run in runs for s in run]
    assert len(starts) == len(set(starts)) == N, "every chunk is read once"


def test_a_failed_read_in_one_run_stops_them_all_and_names_what_changed(tmp_path,
                                                                        monkeypatch):
    state = save_one_file(tmp_path)
    monkeypatch.setattr(read_run, "_cores", lambda: 2)
    probe = _Recording(tmp_path)
    with CheckpointManager(probe, read_only=True, metrics=False) as mgr:
        mgr.restore({k: torch.zeros_like(v) for k, v in state.items()}, step=1)
    starts = sorted(s for run in data_reads(probe).values() for s in run)
    fail_at = starts[len(starts) // 2 + 2]  # a few chunks into the second run
    storage = _Recording(tmp_path, fail_at=fail_at)
    gen = torch.Generator().manual_seed(2)
    live = {k: torch.randn(v.shape, generator=gen) for k, v in state.items()}
    before = {k: v.clone() for k, v in live.items()}
    with CheckpointManager(storage, read_only=True, metrics=False) as mgr:
        with pytest.raises(PartialLoadError, match="injected") as info:
            mgr.restore(live, step=1)
    changed = {k for k in live if not torch.equal(live[k], before[k])}
    assert changed and changed <= info.value.changed  # every changed tensor is named
    assert len(changed) < N  # the failed run stopped: its later tensors were never read
    message = str(info.value)
    whole = [k for k in live if torch.equal(live[k], state[k])]
    assert f"{len(whole)} tensors hold step 1's values" in message
