"""The staging buffers a save reuses are not refilled while a previous save still reads them."""

from __future__ import annotations

import threading

import torch

import ckpt
import ckpt._save.engine
from ckpt._save.engine import Stager


def test_a_second_async_save_waits_until_the_first_has_written_its_staged_bytes(
        tmp_path, monkeypatch):
    """ckpt.async_save stages into the buffers of one Stager (pinned ones for CUDA tensors):
    a second call while the first's writer has not read them yet must wait for it, not
    refill them (the first checkpoint would hold the second's values, with valid digests)."""
    state = {"t": torch.zeros(1024)}
    reading, release, staged = threading.Event(), threading.Event(), threading.Event()
    real_write_rank, real_stage = ckpt._save.engine.write_rank, Stager.stage

    def write_rank(storage, staging, payload, options, pool):
        if not reading.is_set():  # the first save's writer, before it reads its buffers
            reading.set()
            release.wait(timeout=60)
        return real_write_rank(storage, staging, payload, options, pool)

    def stage(self, *args, **kwargs):
        out = real_stage(self, *args, **kwargs)
        staged.set()
        return out

    monkeypatch.setattr(ckpt._save.engine, "write_rank", write_rank)
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


def test_save_keeps_no_host_copy_of_cuda_tensors_and_async_save_keeps_one_for_reuse(
        tmp_path, monkeypatch):
    """ckpt.save stages CUDA tensors into pinned host buffers; once it returns, nothing
    holds them (a module-level copy the size of the model, pinned, until the next save).
    async_save keeps its buffers: the next call refills them."""
    import gc
    import weakref

    import _fake_cuda

    sim = _fake_cuda.install(monkeypatch)
    state = {"w": sim.tensor(torch.randn(64, 64)), "b": sim.tensor(torch.randn(64))}
    buffers: list = []
    real_stage = Stager.stage

    def stage(self, tensors, copy, guards=()):
        staged, ready = real_stage(self, tensors, copy, guards)
        buffers.extend(weakref.ref(t) for t in staged.values())
        return staged, ready

    monkeypatch.setattr(Stager, "stage", stage)
    ckpt.async_save(state, tmp_path / "a").wait()
    gc.collect()
    kept = [r() for r in buffers]
    assert len(kept) == 2 and all(t is not None and t.is_pinned() for t in kept)
    del kept
    buffers.clear()
    ckpt.save(state, tmp_path / "s")
    gc.collect()
    assert len(buffers) == 2 and all(r() is None for r in buffers)
    back = ckpt.load(tmp_path / "s")
    assert torch.equal(back["w"], state["w"].as_subclass(torch.Tensor))
