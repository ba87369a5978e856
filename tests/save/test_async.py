"""Asynchronous saves: a save is a snapshot taken when ``save()`` returns, background errors
surface on the next call, memory stays flat, a second save waits for the first, and SIGTERM
either saves the current step (save_on_preemption) or lets the save in flight commit."""

from __future__ import annotations

import errno
import gc
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import ckpt
from tests.support.workers import ForkedWorker, assert_same, preempt_state, zeroed
from storage_backends import PosixStorage
from tests.support.gated import GatedStorage
import ckpt._save.writer
from ckpt._save.staging import Stager


def staging_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-"))


def trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def clone_state_dict(sd):
    if isinstance(sd, torch.Tensor):
        return sd.clone()
    if isinstance(sd, dict):
        return type(sd)((k, clone_state_dict(v)) for k, v in sd.items())
    if isinstance(sd, list):
        return [clone_state_dict(v) for v in sd]
    return sd


# -------------------------------------------------------------- a save is a snapshot


@pytest.mark.parametrize("api", ["manager", "async_save"])
def test_mutating_the_state_after_save_returns_does_not_change_the_checkpoint(
        tmp_path, monkeypatch, api):
    gate = threading.Event()
    original_write = PosixStorage.write

    def gated_write(self, path, buffers):
        assert gate.wait(30), "the test never opened the gate"
        return original_write(self, path, buffers)

    monkeypatch.setattr(PosixStorage, "write", gated_write)
    model, opt = trained(0)
    expected_model = clone_state_dict(model.state_dict())
    expected_opt = clone_state_dict(opt.state_dict())
    state = {"model": model, "opt": opt}
    options = ckpt.SaveOptions(write_threads=2, chunk_bytes=4096)

    mgr = ckpt.CheckpointManager(tmp_path / "root", options=options) if api == "manager" else None
    try:
        if mgr is not None:
            handle = mgr.save(1, state)
        else:
            handle = ckpt.async_save(state, tmp_path / "one", step=1, options=options)
        assert not handle.done()  # nothing written yet: the writer waits for the gate
        # In place, right away: parameters, optimizer moments and steps.
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-2.0).add_(0.5)
            for s in opt.state.values():
                for v in s.values():
                    v.add_(3.0)
        with pytest.raises(AssertionError):
            assert_same(clone_state_dict(model.state_dict()), expected_model)
        gate.set()
        assert handle.wait().step == 1
    finally:
        gate.set()
        if mgr is not None:
            mgr.close()

    model2, opt2 = trained(1)
    target = {"model": model2, "opt": opt2}
    if api == "manager":
        with ckpt.CheckpointManager(tmp_path / "root") as mgr:
            assert mgr.restore(target) == 1
    else:
        assert ckpt.load(target, tmp_path / "one") == 1
    assert_same(model2.state_dict(), expected_model, "model")
    assert_same(opt2.state_dict(), expected_opt, "opt")


# -------------------------------------------------------------- background errors


class FailingStorage(PosixStorage):
    """POSIX storage whose write() raises OSError once its budget of calls is spent."""

    def __init__(self, root: Path) -> None:
        super().__init__(str(root))
        self._mutex = threading.Lock()
        self.budget: int | None = None  # None: never fail
        self.errors: list[OSError] = []

    def write(self, path, buffers):
        with self._mutex:
            if self.budget is not None:
                if self.budget == 0:
                    err = OSError(errno.EIO, f"injected write failure on {path}")
                    self.errors.append(err)
                    raise err
                self.budget -= 1
        return super().write(path, buffers)


def chunky(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 64, generator=g), "step": step}


@pytest.mark.parametrize("surface", ["save", "wait", "close"])
def test_background_storage_error_surfaces_on_the_next_call(tmp_path, surface):
    root = tmp_path / "root"
    storage = FailingStorage(root)
    mgr = ckpt.CheckpointManager(storage, options=ckpt.SaveOptions(write_threads=4,
                                                                    chunk_bytes=4096))
    try:
        mgr.save(1, chunky(1))
        mgr.wait()
        storage.budget = 1  # step 2: the first file is written, the next write fails
        handle = mgr.save(2, chunky(2))
        assert handle is not None  # async: the failure is not raised here

        with pytest.raises(ckpt.StorageError) as e:
            if surface == "save":
                mgr.save(3, chunky(3))
            elif surface == "wait":
                mgr.wait()
            else:
                mgr.close()
        err = e.value
        assert isinstance(err, ckpt.CheckpointError) and isinstance(err, OSError)
        assert isinstance(err.__cause__, OSError) and err.__cause__ in storage.errors
        assert "step 2" in str(err)
        with pytest.raises(ckpt.StorageError) as again:  # the handle re-raises it too
            handle.wait()
        assert again.value.__cause__ is err.__cause__
        # Nothing of step 2 is visible or left behind; step 1 is intact.
        assert not (root / "step-00000002").exists()
        assert staging_dirs(root) == []
        storage.budget = None
        if surface == "close":
            mgr = ckpt.CheckpointManager(root)  # the lock was released all the same
        else:
            mgr.wait()  # reported once: it does not raise again
            mgr.save(4, chunky(4))
            mgr.wait()
        assert mgr.steps() == ([1] if surface == "close" else [1, 4])
        template = {"w": torch.zeros(64, 64), "step": None}
        assert mgr.restore(template, step=1) == 1
        assert_same(template, chunky(1))
    finally:
        storage.budget = None
        mgr.close()


# -------------------------------------------------------------- memory


def rss_bytes() -> int:
    try:
        import psutil
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return psutil.Process().memory_info().rss


@pytest.mark.slow
def test_memory_stays_flat_over_twenty_async_saves(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(1024, 1024, generator=g) for i in range(16)}  # 64 MiB
    with ckpt.CheckpointManager(tmp_path / "root", keep_last=2) as mgr:
        for step in range(1, 21):
            for t in state.values():
                t.add_(1.0)
            mgr.save(step, state)
            if step in (2, 20):
                mgr.wait()
                gc.collect()
                if step == 2:
                    after_2 = rss_bytes()
                else:
                    after_20 = rss_bytes()
        assert mgr.steps() == [19, 20]
    print(f"RSS after save 2: {after_2 >> 20} MiB, after save 20: {after_20 >> 20} MiB")
    assert after_20 <= after_2 * 1.10 + (8 << 20), (after_2 >> 20, after_20 >> 20)


# -------------------------------------------------------------- backpressure


def test_second_save_waits_for_the_first_and_counts_it(tmp_path):
    storage = GatedStorage(tmp_path / "root")
    state = {"x": torch.arange(10.0)}
    with ckpt.CheckpointManager(storage) as mgr:
        try:
            first = mgr.save(1, state)
            assert not first.done()  # its writes wait for the gate
            assert mgr.backpressure_waits == 0
            opener = threading.Timer(0.3, storage.gate.set)
            opener.start()
            mgr.save(2, state)
            # save(2) returned only after save 1 finished, which the gate held until the
            # opener ran: it waited (not timed: the gate is what proves it)
            assert storage.gate.is_set() and first.done()
            assert first.wait().step == 1
            assert mgr.backpressure_waits == 1
            mgr.wait()
            mgr.save(3, state)  # nothing in flight: no wait
            assert mgr.backpressure_waits == 1
            mgr.wait()
            assert mgr.steps() == [1, 2, 3]
        finally:
            storage.gate.set()


# -------------------------------------------------------------- SIGTERM


@pytest.mark.slow
@pytest.mark.multiproc
def test_save_on_preemption_saves_the_current_step_and_exits_143(tmp_path):
    root = tmp_path / "root"
    worker = ForkedWorker("preempt", root)
    worker.expect("saving 3")
    assert not any(p.name.startswith("step-") for p in root.iterdir())  # schedule: no saves
    os.kill(worker.pid, signal.SIGTERM)
    assert worker.finish(60) == 143, worker.output
    assert "loop ended" not in worker.lines
    last = max(int(x.split()[1]) for x in worker.lines if x.startswith("saving "))
    with ckpt.CheckpointManager(root) as mgr:
        assert mgr.steps() == [last]
        template = zeroed(preempt_state(last))
        assert mgr.restore(template) == last
    assert_same(template, preempt_state(last))


@pytest.mark.slow
@pytest.mark.multiproc
def test_sigterm_lets_the_save_in_flight_commit_before_exiting(tmp_path):
    root, gate = tmp_path / "root", tmp_path / "go"
    worker = ForkedWorker("inflight", root, gate)
    worker.expect("inflight")
    assert not (root / "step-00000001").exists()  # its writes wait for the gate
    os.kill(worker.pid, signal.SIGTERM)
    time.sleep(0.5)
    assert worker.proc.poll() is None, worker.output  # still finishing the save
    assert not (root / "step-00000001").exists()
    gate.touch()
    assert worker.finish(60) == 143, worker.output
    assert "idle loop ended" not in worker.lines
    with ckpt.CheckpointManager(root) as mgr:
        assert mgr.steps() == [1]
        template = zeroed(preempt_state(1))
        assert mgr.restore(template) == 1
    assert_same(template, preempt_state(1))
    assert staging_dirs(root) == []


def test_prepare_allocates_the_staging_buffers_once_and_writes_nothing(tmp_path):
    model = torch.nn.Linear(512, 512)
    with ckpt.CheckpointManager(tmp_path, every_steps=1) as mgr:
        mgr.prepare({"model": model})
        buffers = {k: t.data_ptr() for k, t in mgr._saver.stager._buffers.items()}
        assert set(buffers) == {"model/weight", "model/bias"}
        assert mgr.steps() == [] and not list(tmp_path.glob("step-*"))
        mgr.save(1, {"model": model}).wait()
        # The save reused what prepare allocated, and saved the live values.
        assert {k: t.data_ptr() for k, t in mgr._saver.stager._buffers.items()} == buffers
    out = torch.nn.Linear(512, 512)
    with ckpt.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore({"model": out}) == 1
    assert torch.equal(out.weight, model.weight)


def test_the_manifest_of_a_step_still_being_written_says_to_wait(tmp_path, monkeypatch):
    """mgr.manifest(step) right after an asynchronous save(step) finds no committed step;
    the error says the step is being written and to call wait(), which then makes it
    readable (a missing step keeps the plain not-found message)."""
    import ckpt._save.writer

    release = threading.Event()
    real_write_rank = ckpt._save.writer.write_rank

    def write_rank(*args, **kwargs):
        release.wait(timeout=60)
        return real_write_rank(*args, **kwargs)

    monkeypatch.setattr(ckpt._save.writer, "write_rank", write_rank)
    with ckpt.CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, {"w": torch.ones(4)})
        with pytest.raises(ckpt.CheckpointNotFoundError,
                           match="step 1 is still being written in the background.*mgr.wait"):
            mgr.manifest(1)
        with pytest.raises(ckpt.CheckpointNotFoundError) as missing:
            mgr.manifest(2)
        assert "still being written" not in str(missing.value)
        release.set()
        mgr.wait()
        assert mgr.manifest(1).step == 1


def test_a_second_async_save_waits_until_the_first_has_written_its_staged_bytes(
        tmp_path, monkeypatch):
    """ckpt.async_save stages into the buffers of one Stager (pinned ones for CUDA tensors): a
    second call while the first's writer has not read them yet waits for it rather than refill them
    (the first checkpoint would hold the second's values, with valid digests)."""
    state = {"t": torch.zeros(1024)}
    reading, release, staged = threading.Event(), threading.Event(), threading.Event()
    real_write_rank, real_stage = ckpt._save.writer.write_rank, Stager.stage

    def write_rank(storage, staging, payload, options, pool, *rest):
        if not reading.is_set():  # the first save's writer, before it reads its buffers
            reading.set()
            release.wait(timeout=60)
        return real_write_rank(storage, staging, payload, options, pool, *rest)

    def stage(self, *args, **kwargs):
        out = real_stage(self, *args, **kwargs)
        staged.set()
        return out

    monkeypatch.setattr(ckpt._save.writer, "write_rank", write_rank)
    first = ckpt.async_save(state, tmp_path / "one")
    assert reading.wait(timeout=60)
    state["t"].fill_(1.0)
    monkeypatch.setattr(Stager, "stage", stage)
    second = threading.Thread(target=lambda: ckpt.async_save(state, tmp_path / "two").wait())
    second.start()
    staged.wait(timeout=1)  # a second save that does not wait stages now (not a timing assert)
    release.set()
    first.wait()
    second.join(timeout=60)
    assert torch.equal(ckpt.load(tmp_path / "one")["t"], torch.zeros(1024))
    assert torch.equal(ckpt.load(tmp_path / "two")["t"], torch.ones(1024))


def test_the_host_copies_of_an_async_save_are_exact_and_shared_by_the_threads(monkeypatch):
    """An asynchronous save copies CPU tensors into its buffers in pieces on several threads
    (non-temporal stores where they can be had): every byte lands for odd sizes and dtypes,
    tensors that start inside their storage, an empty one; those whose bytes cannot be read
    as they are (a transposed view, a lazy conjugate) go through torch; the pieces of a
    large tensor reach the helper threads, small tensors stay on the calling thread."""
    import ckpt._save.staging as staging

    monkeypatch.setattr(staging, "PIECE", 64 << 10)
    monkeypatch.setattr(staging, "PARALLEL", 16 << 10)
    g = torch.Generator().manual_seed(3)
    state = {"big": torch.randn(700, 333, generator=g),  # many pieces, an odd tail
             "bf16": torch.randn(77, 130, generator=g).to(torch.bfloat16),
             "inside": torch.randn(100_001, generator=g)[13:],
             "t": torch.randn(64, 48, generator=g).t(),
             "c": torch.randn(50, generator=g, dtype=torch.complex64).conj(),
             "small": torch.arange(7), "empty": torch.zeros(0, 3)}
    callers: list[str] = []
    real = staging.stream_copy
    helped = threading.Event()

    def spying(*job):
        name = threading.current_thread().name
        if name.startswith("ckpt-stage"):
            helped.set()
        elif not callers:  # the calling thread's first piece waits for a helper's
            assert helped.wait(60)
        callers.append(name)
        real(*job)

    monkeypatch.setattr(staging, "stream_copy", spying)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    stager = Stager()
    staged, ready = stager.stage(state, copy=True)
    assert ready is None
    for key, t in state.items():
        assert staged[key] is not t
        assert torch.equal(staged[key].resolve_conj(), t.resolve_conj()), key
    assert any(name.startswith("ckpt-stage") for name in callers)
    assert len(callers) > 20  # "big" alone is 14 pieces
    stager.release_buffers()
