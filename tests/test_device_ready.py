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
from ckpt.engine import Stager

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
