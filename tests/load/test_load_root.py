"""``ckpt.load`` of a root (what every ``ckpt`` command takes): the newest committed step
that passes verification, or ``step=N``; with a state and without one, POSIX and S3."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import ckpt
from tests.support.s3_fixture import _moto, s3  # noqa: F401  (fixtures)


def _model(fill: float) -> torch.nn.Linear:
    m = torch.nn.Linear(3, 2)
    with torch.no_grad():
        m.weight.fill_(fill)
        m.bias.fill_(fill)
    return m


def _root(path, steps=(1, 2, 3), **kw) -> None:
    with ckpt.CheckpointManager(path, async_save=False, **kw) as mgr:
        for s in steps:
            mgr.save(s, {"model": _model(s), "meta": {"at": s}}, force=True)


def _flip_a_data_byte(step_path: Path) -> None:
    data = sorted(p for p in step_path.rglob("*.safetensors"))[0]
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01
    data.write_bytes(bytes(raw))


def test_load_of_a_root_takes_its_newest_committed_step(tmp_path):
    _root(tmp_path / "root")
    (tmp_path / "root" / "step-00000009").mkdir()  # a step being written: no manifest yet
    state = {"model": _model(0), "meta": {}}
    assert ckpt.load(state, tmp_path / "root") == 3
    assert torch.equal(state["model"].weight, torch.full((2, 3), 3.0))
    assert state["meta"] == {"at": 3}
    assert ckpt.load(tmp_path / "root")["meta"] == {"at": 3}  # without a state, as saved


def test_load_of_a_root_with_step_takes_that_step(tmp_path):
    _root(tmp_path / "root")
    state = {"model": _model(0)}
    assert ckpt.load(state, str(tmp_path / "root"), step=2) == 2
    assert torch.equal(state["model"].bias, torch.full((2,), 2.0))
    assert torch.equal(ckpt.load(tmp_path / "root", step=1)["model"]["bias"],
                       torch.full((2,), 1.0))


def test_load_of_a_root_skips_a_corrupt_newest_step_with_a_warning(tmp_path, caplog):
    _root(tmp_path / "root")
    _flip_a_data_byte(tmp_path / "root" / "step-00000003")
    state = {"model": _model(0)}
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        assert ckpt.load(state, tmp_path / "root") == 2
    assert "skipping step=3" in caplog.text and "digest mismatch" in caplog.text
    assert torch.equal(state["model"].weight, torch.full((2, 3), 2.0))
    # an explicit step does not fall back, and changes nothing
    with pytest.raises(ckpt.CorruptCheckpointError, match="digest mismatch"):
        ckpt.load(state, tmp_path / "root", step=3)
    assert torch.equal(state["model"].weight, torch.full((2, 3), 2.0))


def test_load_of_a_root_whose_every_step_is_corrupt_names_each(tmp_path):
    _root(tmp_path / "root", steps=(1, 2))
    for s in (1, 2):
        _flip_a_data_byte(tmp_path / "root" / f"step-0000000{s}")
    with pytest.raises(ckpt.CorruptCheckpointError, match="step 2: .*step 1: "):
        ckpt.load({"model": _model(0)}, tmp_path / "root")


def test_load_of_an_empty_root_or_a_missing_step_says_what_exists(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckpt.CheckpointNotFoundError, match="holds no committed checkpoint"):
        ckpt.load({"model": _model(0)}, tmp_path / "empty")
    _root(tmp_path / "root")
    with pytest.raises(ckpt.CheckpointNotFoundError, match=r"no committed step 7 .*1, 2, 3"):
        ckpt.load({"model": _model(0)}, tmp_path / "root", step=7)
    with pytest.raises(ckpt.CheckpointNotFoundError):
        ckpt.load({"model": _model(0)}, tmp_path / "nowhere")


def test_step_is_refused_for_one_checkpoint_directory(tmp_path):
    ckpt.save({"model": _model(5)}, tmp_path / "one", step=5)
    with pytest.raises(ValueError, match="step= chooses a step of a root"):
        ckpt.load({"model": _model(0)}, tmp_path / "one", step=5)
    assert ckpt.load({"model": _model(0)}, tmp_path / "one") == 5  # a directory as before
    _root(tmp_path / "root")
    assert ckpt.load({"model": _model(0)}, tmp_path / "root" / "step-00000002") == 2


@pytest.mark.s3
def test_load_of_an_s3_root(s3):
    _root(s3.root("run"), storage_options=s3.storage_options)
    state = {"model": _model(0)}
    assert ckpt.load(state, s3.root("run"), storage_options=s3.storage_options) == 3
    assert torch.equal(state["model"].weight, torch.full((2, 3), 3.0))
    assert ckpt.load(state, s3.root("run") + "/step-00000001",
                     storage_options=s3.storage_options) == 1


def test_load_of_a_root_ignores_a_step_linked_in_from_elsewhere(tmp_path):
    """Someone who can write into the root's parent plants step-00000009 as a link to a
    checkpoint of theirs: it is never followed, so the newest real step loads."""
    _root(tmp_path / "root")
    _root(tmp_path / "theirs", steps=(9,))
    (tmp_path / "root" / "step-00000009").symlink_to(tmp_path / "theirs" / "step-00000009")
    state = {"model": _model(0)}
    assert ckpt.load(state, tmp_path / "root") == 3
    assert torch.equal(state["model"].weight, torch.full((2, 3), 3.0))
