"""Saves from and loads onto a CUDA device (skipped without one).

Covers pinned staging, the device-to-host copy that overlaps the next forward and backward
(and the optimizer step that waits for it), a mutation right after ``save()`` returns,
restore onto CUDA tensors through pinned bounce buffers, the CUDA RNG, and a corrupt last
chunk that must leave every CUDA tensor unchanged.

``CKPT_TEST_DEVICE=cpu`` runs the tests that are not about CUDA itself on the CPU, a dry run
of this file (tests/gpu/test_device_check.py does, so that a mistake in it shows before a GPU
is lent); the others are then skipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import CheckpointManager, CorruptCheckpointError, SaveOptions
from ckpt._save.staging import Stager

DEVICE = os.environ.get("CKPT_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="needs a CUDA device")
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="about CUDA itself (a CPU dry run)")

SMALL = SaveOptions(chunk_bytes=1 << 16, write_threads=2)


def make_training(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.BatchNorm1d(512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 256)).to(DEVICE)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optimizer


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def train_step(model, optimizer, batch) -> None:
    optimizer.zero_grad()
    model(batch).square().mean().backward()
    optimizer.step()


def cpu_copy(module_or_opt) -> dict:
    sd = module_or_opt.state_dict()
    if "state" in sd:  # an optimizer
        return {f"{i}.{k}": v.detach().cpu().clone() for i, s in sd["state"].items()
                for k, v in s.items() if isinstance(v, torch.Tensor)}
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


def manager(root, **kwargs) -> CheckpointManager:
    return CheckpointManager(root, schedule=ckpt.Schedule(handle_sigterm=False), metrics=False,
                             **kwargs)


@cuda_only
def test_staging_buffers_are_pinned():
    stager = Stager()
    t = torch.randn(1024, device=DEVICE)
    staged, ready = stager.stage({"t": t}, copy=True)
    ready.synchronize()
    assert staged["t"].is_pinned()
    assert torch.equal(staged["t"], t.cpu())


def test_save_overlaps_and_a_step_right_after_save_returns_is_not_seen(tmp_path):
    """The must-show: the optimizer updates the parameters in place right after save()
    returns; the saved content is bit-exact the state at save()."""
    model, optimizer = make_training()
    batch = torch.randn(64, 256, device=DEVICE)
    for _ in range(3):
        train_step(model, optimizer, batch)
    expected_model, expected_optim = cpu_copy(model), cpu_copy(optimizer)
    with manager(tmp_path, options=SMALL) as mgr:
        mgr.save(3, {"model": model, "optim": optimizer})
        for _ in range(3):  # mutates parameters, optimizer state and batch-norm buffers
            train_step(model, optimizer, batch)
        mgr.wait()
    fresh_model, fresh_optim = make_training(seed=1)
    with manager(tmp_path, read_only=True) as mgr:
        assert mgr.restore({"model": fresh_model, "optim": fresh_optim}, step=3) == 3
    got_model, got_optim = cpu_copy(fresh_model), cpu_copy(fresh_optim)
    assert all(torch.equal(got_model[k], expected_model[k]) for k in expected_model)
    assert all(torch.equal(got_optim[k], expected_optim[k]) for k in expected_optim)


@cuda_only
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_model_on_a_device_that_is_not_the_current_one_is_staged_whole():
    """Tensors on cuda:1 while cuda:0 is current (no torch.cuda.set_device): the copies run
    on cuda:1's streams, and ``ready`` waits for them."""
    torch.cuda.set_device(0)
    model, optimizer = make_training()
    model.to("cuda:1")
    train_step(model, optimizer, torch.randn(64, 256, device="cuda:1"))
    params = {f"p{i}": p for i, p in enumerate(model.parameters())}
    stager = Stager()
    staged, ready = stager.stage(params, copy=True, guards=[optimizer])
    ready.synchronize()
    assert all(torch.equal(staged[k], v.detach().cpu()) for k, v in params.items())


@cuda_only
def test_the_optimizer_step_waits_for_the_deferred_copy():
    """With overlap, the parameters' copy is not awaited by training's stream at once, but
    the optimizer's step pre-hook makes it wait before changing them."""
    model, optimizer = make_training()
    stager = Stager()
    params = {f"p{i}": p for i, p in enumerate(model.parameters())}
    sync()
    staged, ready = stager.stage(params, copy=True, guards=[optimizer])
    before = {k: v.detach().cpu().clone() for k, v in params.items()}
    train_step(model, optimizer, torch.randn(64, 256, device=DEVICE))
    ready.synchronize()
    assert optimizer._optimizer_step_pre_hooks, "no step pre-hook was registered"
    assert all(torch.equal(staged[k], before[k]) for k in params)


def test_without_overlap_training_waits_for_every_copy(tmp_path):
    model, optimizer = make_training()
    options = SaveOptions(chunk_bytes=1 << 16, overlap_device_copy=False)
    with manager(tmp_path, options=options) as mgr:
        mgr.save(1, {"model": model, "optim": optimizer})
        assert not optimizer._optimizer_step_pre_hooks
        expected = cpu_copy(model)
        train_step(model, optimizer, torch.randn(64, 256, device=DEVICE))
        mgr.wait()
    fresh, _ = make_training(seed=1)
    ckpt.load({"model": fresh}, tmp_path / "step-00000001")
    assert all(torch.equal(v, expected[k]) for k, v in cpu_copy(fresh).items())


def test_a_load_right_after_save_returns_is_not_seen_by_the_save(tmp_path):
    """save() returns with the parameters' copies waiting for the next optimizer step; a
    load into the same model before that step comes after them on the GPU."""
    model, optimizer = make_training()
    train_step(model, optimizer, torch.randn(64, 256, device=DEVICE))
    ckpt.save({"model": make_training(seed=1)[0]}, tmp_path / "other")
    expected = cpu_copy(model)
    with manager(tmp_path / "root", options=SMALL) as mgr:
        mgr.save(1, {"model": model, "optim": optimizer})
        ckpt.load({"model": model}, tmp_path / "other")
        mgr.wait()
    fresh, _ = make_training(seed=2)
    ckpt.load({"model": fresh}, tmp_path / "root" / "step-00000001")
    assert all(torch.equal(v, expected[k]) for k, v in cpu_copy(fresh).items())


def test_restore_onto_cuda_tensors(tmp_path):
    model, optimizer = make_training()
    train_step(model, optimizer, torch.randn(64, 256, device=DEVICE))
    ckpt.save({"model": model, "optim": optimizer}, tmp_path / "c", options=SMALL)
    fresh_model, fresh_optim = make_training(seed=1)
    train_step(fresh_model, fresh_optim, torch.randn(64, 256, device=DEVICE))
    ckpt.load({"model": fresh_model, "optim": fresh_optim}, tmp_path / "c")
    assert all(p.device.type == DEVICE for p in fresh_model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(cpu_copy(fresh_model).values(),
                                                 cpu_copy(model).values()))
    assert all(torch.equal(a, b) for a, b in zip(cpu_copy(fresh_optim).values(),
                                                 cpu_copy(optimizer).values()))


@cuda_only
def test_cuda_rng_state_round_trips(tmp_path):
    torch.zeros(1, device=DEVICE)  # RNGState saves the CUDA generators once CUDA is in use
    torch.cuda.manual_seed(123)
    rng = ckpt.RNGState()
    ckpt.save({"rng": rng}, tmp_path / "c")
    expected = torch.rand(4, device=DEVICE)
    torch.cuda.manual_seed(999)
    ckpt.load({"rng": ckpt.RNGState()}, tmp_path / "c")
    assert torch.equal(torch.rand(4, device=DEVICE), expected)


@cuda_only
def test_cuda_rng_saved_with_more_devices_restores_the_savers_generator_here():
    """A state saved by a process that saw one more GPU than this one and drew from the
    last: set_rng_state_all would raise on the index; the saver's generator goes on here."""
    torch.zeros(1, device=DEVICE)
    torch.cuda.manual_seed(5)
    other = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(7)
    drawn = torch.cuda.get_rng_state()
    expected = torch.rand(4, device=DEVICE)
    state = ckpt.RNGState().state_dict()
    state["cuda"] = [other] * torch.cuda.device_count() + [drawn]
    state["cuda_device"] = torch.cuda.device_count()
    ckpt.RNGState().load_state_dict(state)
    assert torch.equal(torch.rand(4, device=DEVICE), expected)


def flip_last_stored_byte(step_dir: Path) -> None:
    """Flip the last byte of the chunk stored last in ``step_dir`` (read last by a load)."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    chunks = [c for e in manifest["tensors"].values() for c in e["chunks"]]
    last = max(chunks, key=lambda c: (c["file"], c["start"]))
    path: Path = step_dir / last["file"]
    data = bytearray(path.read_bytes())
    data[last["start"] + last["length"] - 1] ^= 0x40
    path.write_bytes(bytes(data))


def test_corrupt_last_chunk_leaves_every_cuda_tensor_unchanged(tmp_path):
    model, optimizer = make_training()
    ckpt.save({"model": model}, tmp_path / "c", options=SaveOptions(chunk_bytes=4096,
                                                                     write_threads=1))
    flip_last_stored_byte(tmp_path / "c")
    live, _ = make_training(seed=1)
    before = cpu_copy(live)
    with pytest.raises(CorruptCheckpointError, match="digest mismatch"):
        ckpt.load({"model": live}, tmp_path / "c")
    sync()
    assert all(torch.equal(v, before[k]) for k, v in cpu_copy(live).items())


def test_one_pass_restore_onto_cuda_falls_back_and_repairs_what_it_overwrote(tmp_path):
    """restore() reads the newest step once, through pinned bounce buffers; its corrupt last
    chunk is found after the other tensors' host-to-device copies were issued; step 1,
    loaded next, must overwrite every one of them."""
    options = SaveOptions(chunk_bytes=4096, write_threads=1)
    with CheckpointManager(tmp_path, async_save=False, options=options,
                           schedule=ckpt.Schedule(handle_sigterm=False), metrics=False) as mgr:
        for step, seed in ((1, 1), (2, 2)):
            model, _ = make_training(seed)
            mgr.save(step, {"model": model})
    first = cpu_copy(make_training(1)[0])
    flip_last_stored_byte(tmp_path / "step-00000002")
    live, _ = make_training(seed=3)
    with CheckpointManager(tmp_path, read_only=True, metrics=False) as mgr:
        assert mgr.restore({"model": live}) == 1
        assert [s for s, _ in mgr.skipped] == [2]
    sync()
    assert all(torch.equal(v, first[k]) for k, v in cpu_copy(live).items())
