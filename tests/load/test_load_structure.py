"""Loads without a template: ``ckpt.load(path)`` and ``mgr.load()`` give back the saved
structure, as ``torch.load`` of a ``torch.save`` of the same state does."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt._shared.state import is_stateful


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.mix = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("count", torch.tensor(7, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(x))))


def make_state() -> dict:
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95))
    model(torch.tensor([1, 2, 3])).sum().backward()
    opt.step()
    shared = torch.arange(12, dtype=torch.float16).reshape(3, 4)
    return {
        "model": model,
        "optim": opt,
        "weights": torch.randn(4, 5, dtype=torch.bfloat16),
        "extra": {"ints": [1, -2, 3], "pi": 3.25, "name": "run-1", "flag": True, "none": None,
                  "nested": {"deep": [{"t": shared}, [0.5, "x"]], "pair": (1, "two")},
                  "again": shared, "view": shared[1]},
        "epoch": 3,
    }


def as_saved(state: dict) -> dict:
    """What torch.save would be handed for the same state: state_dict()s of stateful items."""
    return {k: v.state_dict() if is_stateful(v) else v for k, v in state.items()}


def assert_same(got, want, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), where
    elif isinstance(want, Mapping):
        assert isinstance(got, Mapping), where
        assert list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}/{i}")
    else:
        assert type(got) is type(want) and got == want, where


def test_load_without_a_template_equals_torch_load(tmp_path):
    state = make_state()
    ckpt.save(state, tmp_path / "one", step=5)
    buf = io.BytesIO()
    torch.save(as_saved(state), buf)
    want = torch.load(io.BytesIO(buf.getvalue()))

    got = ckpt.load(tmp_path / "one")

    assert_same(got, want)
    # Tied tensors come back as one tensor, as torch.load keeps one storage.
    assert got["model"]["head.weight"] is got["model"]["embed.weight"]
    assert got["extra"]["again"] is got["extra"]["nested"]["deep"][0]["t"]
    assert all(t.device.type == "cpu" for t in got["model"].values())


def test_map_location_moves_every_tensor(tmp_path):
    ckpt.save(make_state(), tmp_path / "one")
    got = ckpt.load(str(tmp_path / "one"), map_location="meta")
    assert got["model"]["mix.weight"].device.type == "meta"
    assert got["optim"]["state"][0]["exp_avg"].device.type == "meta"
    assert got["extra"]["nested"]["deep"][0]["t"].device.type == "meta"
    assert got["epoch"] == 3
    with pytest.raises(TypeError, match="map_location"):
        ckpt.load(make_state(), tmp_path / "one", map_location="cpu")


class Opaque:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque)


def test_no_pickle_unless_allowed(tmp_path):
    ckpt.save({"x": torch.ones(2), "odd": Opaque()}, tmp_path / "one", allow_pickle=True)
    with pytest.raises(ckpt.UnsupportedValueError, match="allow_pickle"):
        ckpt.load(tmp_path / "one")
    assert ckpt.load(tmp_path / "one", allow_pickle=True)["odd"] == Opaque()


def flip_a_bit(step_dir: Path, key: str) -> None:
    doc = json.loads((step_dir / "manifest.json").read_bytes())
    chunk = doc["tensors"][key]["chunks"][0]
    path = step_dir / chunk["file"]
    raw = bytearray(path.read_bytes())
    raw[chunk["start"] + 1] ^= 0x08
    path.write_bytes(bytes(raw))


def test_manager_load_falls_back_past_a_corrupt_newest_step(tmp_path, caplog):
    state = make_state()
    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        assert mgr.load() is None
        for step in (1, 2, 3):
            state["epoch"] = step
            with torch.no_grad():
                state["model"].mix.weight.add_(1.0)
            mgr.save(step, state)
            if step == 2:
                want = as_saved(state)
                want = torch.load(io.BytesIO(_saved_bytes(want)))
    flip_a_bit(root / "step-00000003", "model/mix.weight")

    with ckpt.CheckpointManager(root, read_only=True) as mgr, caplog.at_level(logging.WARNING,
                                                                              "ckpt"):
        got = mgr.load()
        assert mgr.loaded_step == 2
        assert_same(got, want)
        assert any("skipping step=3" in r.getMessage() for r in caplog.records)
        with pytest.raises(ckpt.CorruptCheckpointError, match="digest mismatch"):
            mgr.load(step=3)
    # One step directory of a root loads on its own, too.
    assert_same(ckpt.load(root / "step-00000002"), want)


def _saved_bytes(value: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _two_steps(root) -> None:
    with ckpt.CheckpointManager(root, async_save=False,
                                options=ckpt.SaveOptions(allow_pickle=True)) as mgr:
        mgr.save(1, {"w": torch.arange(8.0)})
        mgr.save(2, {"w": torch.arange(8.0), "odd": {1, 2}})


def test_load_of_a_named_step_raises_that_steps_own_error_and_skips_nothing(tmp_path):
    """``load(step=...)`` raises that step's own error: a missing step is CheckpointNotFoundError,
    not "no committed step could be loaded", and nothing is recorded in ``mgr.skipped``."""
    _two_steps(tmp_path)
    with ckpt.CheckpointManager(tmp_path, read_only=True,
                                options=ckpt.SaveOptions(allow_pickle=True)) as mgr:
        with pytest.raises(ckpt.CheckpointNotFoundError) as caught:
            mgr.load(step=7)
        assert "could be loaded" not in str(caught.value)
        assert mgr.skipped == []


def test_load_raises_this_ranks_fatal_error_as_it_is(tmp_path):
    """Without ``allow_pickle`` the newest step's pickled value is refused with
    UnsupportedValueError as it is, never as "another rank failed to load", and no older step is
    tried."""
    _two_steps(tmp_path)
    with ckpt.CheckpointManager(tmp_path, read_only=True) as mgr:
        with pytest.raises(ckpt.UnsupportedValueError) as caught:
            mgr.load()
        assert "another rank" not in str(caught.value) and mgr.skipped == []
