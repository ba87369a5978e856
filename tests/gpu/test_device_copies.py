"""A save's device-to-host copies and a load's host-to-device copies, on fake CUDA streams
(tests/support/fake_cuda.py): each copy runs on a side stream of its tensor's device, training waits
for it only where it must, and no buffer is read or refilled while a copy into or out of it is
in flight."""

from __future__ import annotations

import pytest
import torch

from tests.support import fake_cuda
import ckpt
from ckpt._save.staging import Stager
from ckpt._shared.buffers import byte_view


def staged_on(device: int, monkeypatch, guard: bool):
    """A parameter (guarded by its optimizer when ``guard``) and a buffer on ``device``
    while the current device is cuda:0 (cuda:1: a model moved there without
    torch.cuda.set_device)."""
    sim = fake_cuda.install(monkeypatch)
    weight = sim.tensor(torch.randn(8, 4), device=device)
    buffer = sim.tensor(torch.randn(4), device=device)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    stager = Stager()
    staged, ready = stager.stage({"w": weight, "bn": buffer}, copy=True,
                                 guards=[optimizer] if guard else [])
    copies = {ptr: (s, i) for s, i, ptr in sim.copies()}
    sim.keep = stager  # its optimizer hook holds it weakly (a manager holds it for real)
    return sim, optimizer, staged, ready, {
        "w": copies[weight.untyped_storage().data_ptr()],
        "bn": copies[buffer.untyped_storage().data_ptr()]}, (weight, buffer)


ON_DEVICE = pytest.mark.parametrize("device", [0, 1], ids=["cuda0", "cuda1-not-current"])


@ON_DEVICE
def test_each_copy_runs_on_a_stream_of_its_tensors_device_and_ready_waits_for_it(
        device, monkeypatch):
    """Each device-to-host copy runs on a side stream of its tensor's device (not training's),
    ``ready`` waits for every copy, and the allocator may not reuse a source's memory before its
    copy ran."""
    sim, _, staged, ready, copies, (weight, buffer) = staged_on(device, monkeypatch, guard=True)
    assert {s.device for s, _ in copies.values()} == {torch.device("cuda", device)}
    assert all(s in sim.side for s, _ in copies.values())  # not training's stream
    ready.synchronize()
    assert all(c in sim.done for c in copies.values()), "the writer could read unfinished copies"
    assert torch.equal(staged["w"], weight.as_subclass(torch.Tensor))
    assert torch.equal(staged["bn"], buffer.as_subclass(torch.Tensor))
    assert all(t.is_pinned() for t in staged.values())
    # the allocator may not reuse a source's memory before the side stream's copy ran
    assert sorted((p, s.name) for p, s in sim.recorded_uses) == sorted(
        (t.untyped_storage().data_ptr(), copies[k][0].name)
        for k, t in (("w", weight), ("bn", buffer)))


@ON_DEVICE
def test_training_waits_at_once_for_a_buffer_and_at_the_optimizer_step_for_a_parameter(
        device, monkeypatch):
    """Training waits at once for a buffer's copy (a forward pass could change it) and for a
    parameter's only at the optimizer's step, so that copy overlaps the forward and backward."""
    sim, optimizer, _, _, copies, _ = staged_on(device, monkeypatch, guard=True)
    training = sim.defaults[device]  # the stream where the model's kernels run
    assert sim.covered(*copies["bn"], training), "a forward pass could change the buffer mid-copy"
    assert not sim.covered(*copies["w"], training), "the parameter's copy was not overlapped"
    optimizer.step()  # no gradients: only the step pre-hook does something
    assert sim.covered(*copies["w"], training), "the step could change the parameter mid-copy"


@ON_DEVICE
def test_without_guards_training_waits_for_every_copy(device, monkeypatch):
    """Without guards training waits for every copy at once, and no optimizer hook is added."""
    sim, optimizer, _, _, copies, _ = staged_on(device, monkeypatch, guard=False)
    assert all(sim.covered(s, i, sim.defaults[device]) for s, i in copies.values())
    assert not optimizer._optimizer_step_pre_hooks


@ON_DEVICE
def test_the_copies_read_what_training_queued_before_save(device, monkeypatch):
    """The side stream waits for training's stream: a copy must not overtake the kernels
    (here a write into the parameter and the buffer) queued before save() was called."""
    sim = fake_cuda.install(monkeypatch)
    weight = sim.tensor(torch.zeros(8, 4), device=device)
    buffer = sim.tensor(torch.zeros(4), device=device)
    training = sim.defaults[device]
    weight.copy_(torch.ones(8, 4))  # queued on training's stream (the current one)
    buffer.copy_(torch.ones(4))
    written = [i for i, op in enumerate(training.ops) if op[0] == "copy"]
    optimizer = torch.optim.SGD([weight], lr=0.1)
    stager = Stager()
    stager.stage({"w": weight, "bn": buffer}, copy=True, guards=[optimizer])
    copies = sim.copies("d2h")
    assert len(copies) == 2 and len(written) == 2
    assert all(sim.covered(training, w, s, before=i) for s, i, _ in copies for w in written), \
        "a device-to-host copy could read the tensor before training's queued write"


def test_a_key_staged_from_the_cpu_then_from_a_gpu_gets_a_pinned_buffer(monkeypatch):
    """A key staged from the CPU, then from a GPU, gets a pinned buffer: a non-blocking copy into
    pageable memory would make save() wait for the copy."""
    sim = fake_cuda.install(monkeypatch)
    stager = Stager()
    staged, _ = stager.stage({"t": torch.randn(4)}, copy=True)
    assert not staged["t"].is_pinned()
    staged, _ = stager.stage({"t": sim.tensor(torch.randn(4))}, copy=True)
    assert staged["t"].is_pinned()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["save", "async_save"])
def test_the_writer_reads_a_staged_buffer_only_once_its_copy_is_done(
        asynchronous, tmp_path, monkeypatch):
    """ckpt.save/async_save of (fake) CUDA tensors on two devices: the writer thread starts
    reading the pinned buffers only after the device-to-host copies into them ended."""
    import ckpt._save.writer

    sim = fake_cuda.install(monkeypatch)
    weight = sim.tensor(torch.randn(8, 4), device=1)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    state = {"w": weight, "bn": sim.tensor(torch.randn(4), device=0), "opt": optimizer}
    in_flight = []
    real_write_rank = ckpt._save.writer.write_rank

    def write_rank(storage, staging, payload, options, pool, *rest):
        for _, buf in payload.pieces.values():
            in_flight.extend(sim.host_in_flight(*fake_cuda.memory_range(byte_view(buf))))
        return real_write_rank(storage, staging, payload, options, pool, *rest)

    monkeypatch.setattr(ckpt._save.writer, "write_rank", write_rank)
    if asynchronous:
        ckpt.async_save(state, tmp_path / "c").wait()
    else:
        ckpt.save(state, tmp_path / "c")
    assert len(sim.copies("d2h")) == 2
    assert in_flight == [], "the writer read a pinned buffer while its copy was in flight"
    back = ckpt.load(tmp_path / "c")
    assert torch.equal(back["w"], weight.as_subclass(torch.Tensor))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "overlap_off"])
def test_async_save_of_a_model_and_its_optimizer_overlaps_only_when_asked(
        overlap, tmp_path, monkeypatch):
    """Through async_save (the state's optimizers found as guards): with
    overlap_device_copy the parameters' copies are awaited at the optimizer's step; without
    it (for code that changes parameters in place otherwise) training waits for every copy
    at once."""
    sim = fake_cuda.install(monkeypatch)
    weight = sim.tensor(torch.randn(8, 4))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    state = {"w": weight, "bn": sim.tensor(torch.randn(4)), "opt": optimizer}
    handle = ckpt.async_save(state, tmp_path / "c",
                             options=ckpt.SaveOptions(overlap_device_copy=overlap))
    copies = {ptr: (s, i) for s, i, ptr in sim.copies("d2h")}
    training = sim.defaults[0]
    assert sim.covered(*copies[state["bn"].untyped_storage().data_ptr()], training)
    w_copy = copies[weight.untyped_storage().data_ptr()]
    assert sim.covered(*w_copy, training) is not overlap
    optimizer.step()
    assert sim.covered(*w_copy, training)
    handle.wait()


def test_save_keeps_no_host_copy_of_cuda_tensors_and_async_save_keeps_one_for_reuse(
        tmp_path, monkeypatch):
    """ckpt.save stages CUDA tensors into pinned host buffers; once it returns, nothing
    holds them (a module-level copy the size of the model, pinned, until the next save).
    async_save keeps its buffers: the next call refills them."""
    import gc
    import weakref

    from tests.support import fake_cuda

    sim = fake_cuda.install(monkeypatch)
    state = {"w": sim.tensor(torch.randn(64, 64)), "b": sim.tensor(torch.randn(64))}
    buffers: list = []
    real_stage = Stager.stage

    def stage(self, tensors, copy, guards=(), **kw):
        staged, ready = real_stage(self, tensors, copy, guards, **kw)
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


@ON_DEVICE
def test_restore_reuses_a_bounce_buffer_only_after_its_copy_and_returns_after_every_copy(
        device, tmp_path, monkeypatch):
    """Chunks are read into two pinned buffers in turn and copied to the device on a side
    stream: no read may land in a buffer whose last copy out of it is still in flight, and
    training may use the tensors once load() returns."""
    from storage_backends import posix

    saved = {"a": torch.randn(64, 256), "b": torch.randn(3, 1000)}
    ckpt.save(saved, tmp_path / "c", options=ckpt.SaveOptions(chunk_bytes=4096))
    sim = fake_cuda.install(monkeypatch)
    live = {k: sim.tensor(torch.zeros_like(v), device=device) for k, v in saved.items()}
    clobbered = []
    real_read_into = posix._FileReader.read_into

    def read_into(self, start, out):
        clobbered.extend(sim.host_in_flight(*fake_cuda.memory_range(out)))
        real_read_into(self, start, out)

    monkeypatch.setattr(posix._FileReader, "read_into", read_into)
    ckpt.load(live, tmp_path / "c")
    copies = sim.copies("h2d")
    assert len(copies) == sum(-(-v.numel() * 4 // 4096) for v in saved.values())
    assert {s.device for s, _, _ in copies} == {torch.device("cuda", device)}
    assert clobbered == [], "a chunk was read into a buffer still being copied out"
    training = sim.defaults[device]
    assert all((s, i) in sim.done or sim.covered(s, i, training) for s, i, _ in copies)
    assert all(torch.equal(live[k].as_subclass(torch.Tensor), v) for k, v in saved.items())


@ON_DEVICE
def test_a_load_on_reading_threads_writes_after_the_callers_stream(
        device, tmp_path, monkeypatch):
    """Training on a stream of its own, current on the calling thread only (CUDA's current
    stream is per thread): the copies that the load's reading threads issue come after what
    that stream queued (a write into a tensor) and after the save's deferred copies."""
    import threading

    import ckpt._load.reader
    from storage_backends import posix

    saved = {k: torch.randn(16, 256) for k in "abcd"}
    # two data files (files are read in parallel), whatever cores this machine leaves free
    ckpt.save(saved, tmp_path / "c", options=ckpt.SaveOptions(chunk_bytes=4096,
                                                               write_threads=2))
    sim = fake_cuda.install(monkeypatch)
    monkeypatch.setattr(ckpt._load.reader, "TINY_CHUNK_BYTES", 0)  # read on the pool's threads
    readers = set()
    real_read_into = posix._FileReader.read_into

    def read_into(self, start, out):
        readers.add(threading.get_ident())
        real_read_into(self, start, out)

    monkeypatch.setattr(posix._FileReader, "read_into", read_into)
    live = {k: sim.tensor(torch.zeros(16, 256), device=device) for k in saved}
    optimizer = torch.optim.SGD(list(live.values()), lr=0.1)
    training = torch.cuda.Stream(device=torch.device("cuda", device))
    with torch.cuda.stream(training):
        live["a"].copy_(torch.ones(16, 256))  # queued on training's stream
        stager = Stager()  # held, as a manager holds its own
        stager.stage(dict(live), copy=True, guards=[optimizer])
        earlier = [(training, 0)] + [(s, i) for s, i, _ in sim.copies("d2h")]
        ckpt.load(live, tmp_path / "c")
    assert readers - {threading.get_ident()}, "the load read nothing on another thread"
    writes = [(s, i) for s, i, _ in sim.copies("h2d") if s is not training]
    assert len(writes) == 4 * 4
    assert all(sim.covered(s0, i0, s, before=i) for s, i in writes for s0, i0 in earlier), \
        "a load's copy could overtake training's queued work or the save's copies"
    assert all(torch.equal(live[k].as_subclass(torch.Tensor), v) for k, v in saved.items())


@ON_DEVICE
def test_a_load_right_after_a_save_writes_after_the_saves_deferred_copies(
        device, tmp_path, monkeypatch):
    """save() returns with the parameters' copies waiting for the optimizer's next step; a
    load into them before that step must not overwrite them before they were copied."""
    saved = {"w": torch.randn(16, 256)}
    ckpt.save(saved, tmp_path / "c", options=ckpt.SaveOptions(chunk_bytes=4096))
    sim = fake_cuda.install(monkeypatch)
    weight = sim.tensor(torch.zeros(16, 256), device=device)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    stager = Stager()
    stager.stage({"w": weight}, copy=True, guards=[optimizer])
    [(save_stream, save_copy, _)] = sim.copies("d2h")
    ckpt.load({"w": weight}, tmp_path / "c")
    writes = sim.copies("h2d")
    assert writes and all(sim.covered(save_stream, save_copy, s, before=i) for s, i, _ in writes)
