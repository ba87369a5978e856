"""Incremental saves, compression, and the reference-aware collector."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

import ckpt
from verify.cli import main as cli
from ckpt import CheckpointManager, SaveOptions
from ckpt.errors import CheckpointError
from ckpt._format.names import MANIFEST_NAME
from ckpt._retention.collect import collect
from ckpt._step.listing import step_dirs
from ckpt._step.integrity import read_manifest
from ckpt._format.sealed import reseal
from storage_backends import PosixStorage
from tests.support.ranks import forkserver

ROOT = Path(__file__).resolve().parents[2]
SMALL_CHUNKS = ckpt.SaveOptions(chunk_bytes=1 << 16, write_threads=2)


def mlp(seed: int, layers: int = 8, width: int = 128) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        torch.manual_seed(len(opt.state))
        model(torch.randn(4, model[0].in_features)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def save_series(root, state, model, opt, n: int, **kw) -> list[ckpt.SaveResult]:
    results = []
    options = dataclasses.replace(SMALL_CHUNKS, incremental=True, full_every=100)
    with ckpt.CheckpointManager(root, options=options, **kw) as mgr:
        for step in range(1, n + 1):
            train(model, opt)
            results.append(mgr.save(step, state, force=True).wait())
    return results


def test_frozen_half_writes_about_half(tmp_path):
    model = mlp(0)
    for layer in list(model)[:4]:
        layer.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    results = save_series(tmp_path, {"model": model}, model, opt, 4)
    full = nbytes(model.parameters())
    trainable = nbytes(p for p in model.parameters() if p.requires_grad)
    assert results[0].bytes_reused == 0 and results[0].bytes_written >= full
    for r in results[1:]:
        # Written: the trainable half (+ headers and the manifest, under 2%).
        assert trainable <= r.bytes_written <= trainable * 1.02 + 16384
        assert r.bytes_reused == full - trainable


def test_adapter_only_writes_a_few_percent(tmp_path):
    base = mlp(1, layers=6, width=256)
    base.requires_grad_(False)
    adapter = torch.nn.Linear(256, 8)
    model = torch.nn.ModuleDict({"base": base, "adapter": adapter})
    opt = torch.optim.SGD(adapter.parameters(), lr=1e-2)

    def step() -> None:
        adapter(base(torch.randn(2, 256))).sum().backward()
        opt.step()
        opt.zero_grad()

    options = dataclasses.replace(SMALL_CHUNKS, incremental=True)
    with ckpt.CheckpointManager(tmp_path, options=options) as mgr:
        sizes = []
        for s in range(1, 4):
            step()
            sizes.append(mgr.save(s, {"model": model}, force=True).wait().bytes_written)
    total = nbytes(model.parameters())
    assert sizes[0] >= total
    assert all(s < 0.03 * total for s in sizes[1:]), (sizes, total)


def test_with_optimizer_bytes_follow_what_changed(tmp_path):
    model = mlp(2)
    for layer in list(model)[:6]:
        layer.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    results = save_series(tmp_path, {"model": model, "optim": opt}, model, opt, 3)
    trainable = [p for p in model.parameters() if p.requires_grad]
    changed = nbytes(trainable) * 3 + 4 * len(trainable)  # params, exp_avg, exp_avg_sq, step
    for r in results[1:]:
        assert changed <= r.bytes_written <= changed * 1.03 + 32768, (r, changed)


def test_incremental_restore_is_bit_exact_even_after_its_bases_were_retired(tmp_path):
    model = mlp(3)
    for layer in list(model)[:4]:
        layer.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    state = {"model": model, "optim": opt}
    save_series(tmp_path, state, model, opt, 5, keep_last=1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    step_dirs = sorted(p.name for p in tmp_path.glob("step-*"))
    assert step_dirs[0] == "step-00000001"  # retired, kept for its referenced files
    assert not (tmp_path / "step-00000001" / "manifest.json").exists()
    fresh = mlp(99)
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters()][8:], lr=1e-3)
    with ckpt.CheckpointManager(tmp_path) as mgr:
        assert mgr.steps() == [5]
        assert mgr.restore({"model": fresh, "optim": fresh_opt}) == 5
        refs = {c.step for e in mgr.manifest(5).tensors.values() for c in e.chunks}
        assert 1 in refs  # it really did depend on the retired step
    for k, v in expected.items():
        assert torch.equal(fresh.state_dict()[k], v), k
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def save_with_gc(root: str, keep: int, environ: dict[str, str]) -> None:
    """Incremental saves of a half-frozen model with keep_last=``keep`` (a process forked from
    the suite's fork server; CKPT_FAULT in ``environ`` kills it inside the collector)."""
    import importlib

    import storage_backends.faults

    os.environ.clear()
    os.environ.update(environ)
    importlib.reload(storage_backends.faults)  # CKPT_FAULT is read at import
    model = mlp(4)
    for layer in list(model)[:4]:
        layer.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    options = dataclasses.replace(SMALL_CHUNKS, incremental=True, full_every=3)
    with ckpt.CheckpointManager(root, keep_last=keep, options=options) as mgr:
        for step in range(1, 8):
            train(model, opt)
            mgr.save(step, {"model": model}, force=True).wait()


@pytest.mark.multiproc
@pytest.mark.parametrize("point", ["gc_retired:2", "gc_deleted_file:3"])
def test_sigkill_during_gc_leaves_every_kept_step_loadable(tmp_path, point):
    root = tmp_path / "root"
    env = {**os.environ, "CKPT_FAULT": f"kill:{point}", "PYTHONPATH": str(ROOT)}
    proc = forkserver().Process(target=save_with_gc, args=(str(root), 2, env))
    proc.start()
    proc.join(120)
    if proc.is_alive():
        proc.kill()
        proc.join()
    assert proc.exitcode == -9, proc.exitcode  # it was killed inside the collector
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        steps = mgr.steps()
        assert steps
        for step in steps:
            model = mlp(5)
            assert mgr.restore({"model": model}, step=step) == step
    for step in steps:
        assert cli(["verify", str(root), "--step", str(step), "--level", "digest"]) == 0
    # The next writer finishes the interrupted collection and everything still loads.
    with ckpt.CheckpointManager(root) as mgr:
        for step in mgr.steps():
            mgr.restore({"model": mlp(6)}, step=step)


ALL_DTYPES = [torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.complex64,
              torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
              torch.bool] + [getattr(torch, n) for n in ("uint16", "uint32", "uint64",
                                                        "float8_e4m3fn", "float8_e5m2")
                             if hasattr(torch, n)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_compressed_round_trip_of_every_dtype(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (64, 33 * dtype.itemsize), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw.remainder(2)  # only 0 and 1 are bools
    smooth = (torch.randn(64, 33, generator=g) * 0.02).to(dtype) if dtype.is_floating_point \
        or dtype.is_complex else torch.arange(64 * 33).reshape(64, 33).remainder(7).to(dtype)
    state = {"noise": raw.view(dtype), "smooth": smooth,
             "strided": smooth.t()[::2], "empty": torch.empty(0, 3, dtype=dtype)}
    ckpt.save(state, tmp_path / "c", options=ckpt.SaveOptions(compression="zstd",
                                                               chunk_bytes=4096))
    out = {k: torch.zeros(v.shape, dtype=dtype) for k, v in state.items()}
    ckpt.load(out, tmp_path / "c")
    for k, v in state.items():
        assert torch.equal(_bytes(out[k]), _bytes(v)), k
    codecs = {c["codec"] for e in json.loads((tmp_path / "c" / "manifest.json").read_text())[
        "tensors"].values() for c in e["chunks"]}
    assert codecs & {"zstd", "zstd-grouped"}  # something was actually compressed
    assert "raw" in codecs  # random bytes do not shrink and are stored raw


def test_byte_grouping_shrinks_bf16_weights(tmp_path):
    w = (torch.randn(1024, 1024) * 0.02).to(torch.bfloat16)
    r = ckpt.save({"w": w}, tmp_path / "c", options=ckpt.SaveOptions(compression="zstd"))
    assert r.bytes_written < w.numel() * 2 / 1.3


def test_gc_command_dry_run_then_delete(tmp_path, capsys):
    model = mlp(7)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    save_series(tmp_path, {"model": model}, model, opt, 4)
    (tmp_path / ".tmp-step-00000009-deadbeef0000").mkdir()
    assert cli(["gc", str(tmp_path), "--keep-last", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dry_run"] and report["retired_steps"] == [1, 2, 3]
    assert (tmp_path / "step-00000001" / "manifest.json").exists()  # dry run deleted nothing
    assert cli(["gc", str(tmp_path), "--keep-last", "1", "--yes"]) == 0
    assert "removed: 3 steps" in capsys.readouterr().out
    assert not (tmp_path / ".tmp-step-00000009-deadbeef0000").exists()
    with ckpt.CheckpointManager(tmp_path) as mgr:
        assert mgr.steps() == [4]
        out = mlp(8)
        mgr.restore({"model": out})
    for k, v in model.state_dict().items():
        assert torch.equal(out.state_dict()[k], v)


# ------------------------------------------- chains and the collector, file by file


def save_steps(root, steps: dict, **kw) -> None:
    """Save ``steps`` (step -> state) in ``root`` (small chunks, one writer thread)."""
    kw.setdefault("options", SaveOptions(chunk_bytes=16 << 10, write_threads=1))
    with CheckpointManager(root, async_save=False, schedule=ckpt.Schedule(handle_sigterm=False),
                           metrics=False, **kw) as mgr:
        for step, state in steps.items():
            mgr.save(step, state, force=True)


def test_an_incremental_chain_ends_in_a_full_save_every_full_every_steps(tmp_path):
    """An incremental chain ends in a full save every ``full_every`` steps, so no step depends on
    ever older ones."""
    frozen = torch.randn(64, 64)
    save_steps(tmp_path, {s: {"frozen": frozen, "t": torch.full((4,), float(s))} for s in (1, 2, 3)},
               options=SaveOptions(chunk_bytes=16 << 10, write_threads=1, incremental=True,
                                   full_every=2))
    storage = PosixStorage(str(tmp_path))
    reused = {s: any(c.step is not None for e in read_manifest(storage, f"step-{s:08d}", s)
                     .tensors.values() for c in e.chunks) for s in (1, 2, 3)}
    assert reused == {1: False, 2: True, 3: False}


def test_gc_deletes_nothing_when_a_kept_steps_references_cannot_be_read(tmp_path):
    """The collector deletes nothing when it cannot read a kept step's manifest: its references
    unknown, the earlier step's files it reuses could go with that step."""
    frozen = torch.randn(64, 64)
    save_steps(tmp_path, {1: {"frozen": frozen, "t": torch.zeros(4)},
                          2: {"frozen": frozen, "t": torch.ones(4)}},
               options=SaveOptions(chunk_bytes=16 << 10, write_threads=1, incremental=True,
                                   full_every=100))
    before = sorted(p.name for p in (tmp_path / "step-00000001").iterdir())
    (tmp_path / "step-00000002" / MANIFEST_NAME).write_bytes(b"{not json")
    storage = PosixStorage(str(tmp_path))
    with pytest.raises(CheckpointError, match="gc stopped before deleting anything: cannot "
                                              "read the references of kept step 2"):
        collect(storage, keep={2})
    assert sorted(p.name for p in (tmp_path / "step-00000001").iterdir()) == before


def test_gc_stops_at_a_kept_step_whose_manifest_names_another_step(tmp_path):
    """The collector stops at a kept step whose manifest names another step (copied into its
    directory): such a manifest is not trusted for the references that decide what it deletes."""
    save_steps(tmp_path, {1: {"t": torch.ones(4)}, 2: {"t": torch.ones(4) * 2}})
    path = tmp_path / "step-00000002" / MANIFEST_NAME
    path.write_bytes(reseal(path.read_bytes().replace(b'"step":2', b'"step":7')))
    with pytest.raises(CheckpointError, match="cannot read the references of kept step 2"):
        collect(PosixStorage(str(tmp_path)), keep={2})
    assert (tmp_path / "step-00000001" / MANIFEST_NAME).exists()


def test_a_file_named_like_a_step_is_no_step_directory(tmp_path):
    """A file named like a step is no step directory: the collector neither takes it for an
    uncommitted step nor deletes it as that step's leftovers."""
    save_steps(tmp_path, {1: {"t": torch.ones(4)}})
    (tmp_path / "step-00000002").write_bytes(b"a note, not a step")
    storage = PosixStorage(str(tmp_path))
    assert step_dirs(storage) == {1: True}
    collect(storage)
    assert (tmp_path / "step-00000002").read_bytes() == b"a note, not a step"


def test_a_dry_run_of_gc_deletes_nothing(tmp_path):
    """A dry run of the collector reports what it would retire and deletes nothing."""
    save_steps(tmp_path, {1: {"t": torch.ones(4)}, 2: {"t": torch.ones(4) * 2}})
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    report = collect(PosixStorage(str(tmp_path)), keep={2}, dry_run=True)
    assert report.retired_steps == [1] and report.deleted_files
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_gc_leaves_a_directory_inside_a_kept_step_alone(tmp_path):
    """The collector leaves a directory inside a kept step (none of ckpt's files) alone, with what
    it holds."""
    save_steps(tmp_path, {1: {"t": torch.ones(4)}})
    (tmp_path / "step-00000001" / "notes").mkdir()
    (tmp_path / "step-00000001" / "notes" / "a.txt").write_bytes(b"kept")
    collect(PosixStorage(str(tmp_path)))
    assert (tmp_path / "step-00000001" / "notes" / "a.txt").read_bytes() == b"kept"
