"""The GPU checks, made to work the first time a GPU machine is lent (on the CPU, here).

A device machine comes rarely and for minutes, and its image lacks zstandard, moto and
s3fs: what tests/test_cuda.py, benchmarks/bench_cuda.py and benchmarks/device_check.sh
need is checked here, without a GPU.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import _fake_cuda
import ckpt
from ckpt._save.engine import Stager, byte_view

REPO = Path(__file__).resolve().parent.parent

# Python that behaves as if zstandard, moto and s3fs were not installed (a None entry in
# sys.modules makes their import raise ModuleNotFoundError; find_spec says "not found").
WITHOUT_OPTIONAL = "import sys; sys.modules.update(zstandard=None, moto=None, s3fs=None)\n"


def run_python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_OPTIONAL + textwrap.dedent(code), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_ckpt_saves_and_loads_without_zstandard_and_names_it_when_asked_to_compress(tmp_path):
    result = run_python(f"""
        import torch, ckpt
        state = {{"t": torch.arange(10.0)}}
        ckpt.save(state, {str(tmp_path / 'plain')!r})
        back = {{"t": torch.zeros(10)}}
        ckpt.load(back, {str(tmp_path / 'plain')!r})
        assert torch.equal(back["t"], state["t"])
        try:
            ckpt.save(state, {str(tmp_path / 'zstd')!r},
                      options=ckpt.SaveOptions(compression="zstd"))
        except ckpt.CheckpointError as e:
            print("refused:", e)
        """)
    assert result.returncode == 0, result.stderr
    assert "refused: compression='zstd' needs the zstandard package" in result.stdout
    assert "pip install zstandard" in result.stdout


# -- the device-to-host copies of a save, on fake CUDA streams (tests/_fake_cuda.py) ---------

def staged_on(device: int, monkeypatch, guard: bool):
    """A parameter (guarded by its optimizer when ``guard``) and a buffer on ``device``
    while the current device is cuda:0 (cuda:1: a model moved there without
    torch.cuda.set_device)."""
    sim = _fake_cuda.install(monkeypatch)
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
    sim, optimizer, _, _, copies, _ = staged_on(device, monkeypatch, guard=True)
    training = sim.defaults[device]  # the stream where the model's kernels run
    assert sim.covered(*copies["bn"], training), "a forward pass could change the buffer mid-copy"
    assert not sim.covered(*copies["w"], training), "the parameter's copy was not overlapped"
    optimizer.step()  # no gradients: only the step pre-hook does something
    assert sim.covered(*copies["w"], training), "the step could change the parameter mid-copy"


@ON_DEVICE
def test_without_guards_training_waits_for_every_copy(device, monkeypatch):
    sim, optimizer, _, _, copies, _ = staged_on(device, monkeypatch, guard=False)
    assert all(sim.covered(s, i, sim.defaults[device]) for s, i in copies.values())
    assert not optimizer._optimizer_step_pre_hooks



@ON_DEVICE
def test_the_copies_read_what_training_queued_before_save(device, monkeypatch):
    """The side stream waits for training's stream: a copy must not overtake the kernels
    (here a write into the parameter and the buffer) queued before save() was called."""
    sim = _fake_cuda.install(monkeypatch)
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
    """A non-blocking copy into pageable memory would make save() wait for the copy."""
    sim = _fake_cuda.install(monkeypatch)
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
    import ckpt._save.engine

    sim = _fake_cuda.install(monkeypatch)
    weight = sim.tensor(torch.randn(8, 4), device=1)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    state = {"w": weight, "bn": sim.tensor(torch.randn(4), device=0), "opt": optimizer}
    in_flight = []
    real_write_rank = ckpt._save.engine.write_rank

    def write_rank(storage, staging, payload, options, pool):
        for _, buf in payload.pieces.values():
            in_flight.extend(sim.host_in_flight(*_fake_cuda.memory_range(byte_view(buf))))
        return real_write_rank(storage, staging, payload, options, pool)

    monkeypatch.setattr(ckpt._save.engine, "write_rank", write_rank)
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
    sim = _fake_cuda.install(monkeypatch)
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


# -- the CUDA generators of RNGState, on a machine with another number of devices ------------

def fake_cuda_rng(monkeypatch, count: int, current: int) -> dict[int, torch.Tensor]:
    """torch.cuda's RNG calls on ``count`` fake devices: returns each device's state as set
    (an index out of range raises, as torch.cuda.default_generators[index] does)."""
    states: dict[int, torch.Tensor] = {}

    def set_rng_state(new_state, device="cuda"):
        index = device if isinstance(device, int) else torch.device(device).index
        if index is None:
            index = current
        if not 0 <= index < count:
            raise IndexError("tuple index out of range")
        states[index] = new_state

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    return states


def saved_rng(devices: int, current: int) -> dict:
    state = ckpt.RNGState().state_dict()
    state["cuda"] = [torch.full((16,), i, dtype=torch.uint8) for i in range(devices)]
    state["cuda_device"] = current
    return state


def test_cuda_rng_states_restore_on_as_many_devices_one_per_device(monkeypatch):
    states = fake_cuda_rng(monkeypatch, count=2, current=1)
    ckpt.RNGState().load_state_dict(saved_rng(devices=2, current=1))
    assert {i: int(s[0]) for i, s in states.items()} == {0: 0, 1: 1}


def test_cuda_rng_of_a_rank_on_cuda3_of_8_goes_on_on_the_one_device_it_has_now(monkeypatch):
    states = fake_cuda_rng(monkeypatch, count=1, current=0)
    ckpt.RNGState().load_state_dict(saved_rng(devices=8, current=3))
    assert {i: int(s[0]) for i, s in states.items()} == {0: 3}


def test_cuda_rng_saved_by_an_old_version_without_its_device_restores_what_fits(monkeypatch):
    states = fake_cuda_rng(monkeypatch, count=2, current=0)
    old = saved_rng(devices=4, current=0)
    del old["cuda_device"]
    ckpt.RNGState().load_state_dict(old)
    assert {i: int(s[0]) for i, s in states.items()} == {0: 0, 1: 1}


# -- benchmarks/bench_cuda.py: its code run on the CPU ---------------------------------------

def run_bench_cuda(*args: str) -> subprocess.CompletedProcess:
    return run_python(f"""
        import runpy
        sys.argv = ["bench_cuda.py", *{list(args)!r}]
        runpy.run_path("benchmarks/bench_cuda.py", run_name="__main__")
        """, timeout=300)


def test_bench_cuda_dry_run_on_the_cpu_prints_every_row(tmp_path):
    result = run_bench_cuda("--device", "cpu", "--sizes", "4M", "--reps", "1",
                            "--quiet-wait", "0", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    for row in ("training step, no save", "device-to-host copy floor (pinned)",
                "ckpt save() blocks (overlapped)", "ckpt next step (overlap off)",
                "ckpt step during the write (overlapped)", "DCP async_save blocks (default)",
                "DCP async_save blocks (DefaultStager, pinned)", "ckpt restore (warm)",
                "dcp.load (warm)"):
        assert f"| {row} " in result.stdout, (row, result.stdout)
    assert "Restore " in result.stdout and "failed after" not in result.stdout
    assert "WARNING" not in result.stdout  # the copy floor moved what ckpt saved
    assert "a dry run" in result.stdout
    assert not (tmp_path / "cuda").exists()  # its data removed


def test_bench_cuda_without_a_gpu_says_so_and_exits_0():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    result = run_bench_cuda("--sizes", "4M")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("No CUDA device: bench_cuda.py measured nothing")


def test_test_cuda_runs_on_the_cpu_where_it_is_not_about_cuda_itself():
    """tests/test_cuda.py with CKPT_TEST_DEVICE=cpu: the tests of saves and restores run."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "CKPT_TEST_DEVICE": "cpu"})
    assert result.returncode == 0, result.stdout[-3000:]
    assert "6 passed" in result.stdout, result.stdout[-3000:]


# -- benchmarks/device_check.sh: the one script run on a device machine ----------------------

def run_device_check(out: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "benchmarks/device_check.sh"], cwd=REPO, capture_output=True,
                          text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(out),
                               "PYTHON": sys.executable, **env})


def test_device_check_runs_every_step_keeps_their_logs_and_exits_with_the_first_failure(
        tmp_path):
    """One run with a test step that times out and a benchmark that refuses its sizes: every
    step still runs, each keeps its log under $OUT, the status is the first failure's."""
    result = run_device_check(tmp_path, CKPT_COMMIT="abc1234", TEST_TIMEOUT="1",
                              BENCH_SIZES="bogus")
    log = (tmp_path / "device_check.log").read_text()
    assert "commit abc1234" in log
    for line in ("import: exit 0", "test_cuda: TIMED OUT after 1s", "bench_cuda: exit 1"):
        assert line in log, log
    assert "invalid literal" in (tmp_path / "bench_cuda.log").read_text()
    assert {"versions.log", "import.log", "test_cuda.log", "bench_cuda.log"} <= {
        p.name for p in tmp_path.iterdir()}
    if torch.cuda.is_available():
        assert result.returncode == 124, log
    else:  # the versions step failed first
        assert "NO CUDA DEVICE" in log and "versions: exit 3" in log, log
        assert result.returncode == 3, log


# -- a restore onto the GPU through pinned bounce buffers, on fake CUDA streams --------------

@ON_DEVICE
def test_restore_reuses_a_bounce_buffer_only_after_its_copy_and_returns_after_every_copy(
        device, tmp_path, monkeypatch):
    """Chunks are read into two pinned buffers in turn and copied to the device on a side
    stream: no read may land in a buffer whose last copy out of it is still in flight, and
    training may use the tensors once load() returns."""
    from storage_backends import posix

    saved = {"a": torch.randn(64, 256), "b": torch.randn(3, 1000)}
    ckpt.save(saved, tmp_path / "c", options=ckpt.SaveOptions(chunk_bytes=4096))
    sim = _fake_cuda.install(monkeypatch)
    live = {k: sim.tensor(torch.zeros_like(v), device=device) for k, v in saved.items()}
    clobbered = []
    real_read_into = posix._FileReader.read_into

    def read_into(self, start, out):
        clobbered.extend(sim.host_in_flight(*_fake_cuda.memory_range(out)))
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
    ckpt.save(saved, tmp_path / "c", options=ckpt.SaveOptions(chunk_bytes=4096))
    sim = _fake_cuda.install(monkeypatch)
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
    sim = _fake_cuda.install(monkeypatch)
    weight = sim.tensor(torch.zeros(16, 256), device=device)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    stager = Stager()
    stager.stage({"w": weight}, copy=True, guards=[optimizer])
    [(save_stream, save_copy, _)] = sim.copies("d2h")
    ckpt.load({"w": weight}, tmp_path / "c")
    writes = sim.copies("h2d")
    assert writes and all(sim.covered(save_stream, save_copy, s, before=i) for s, i, _ in writes)
