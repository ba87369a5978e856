"""CkptAccelerator keeps Accelerate's checkpoint contract: every folder keeps its own state
(whatever the save iteration), save_state returns with the state written and the folder
unlocked, and several Accelerators of one process share a project as stock Accelerate allows.
Each test runs the real Accelerator."""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

pytest.importorskip("accelerate")
from accelerate.utils import ProjectConfiguration  # noqa: E402

import ckpt  # noqa: E402
from trainer.integrations.accelerate import CkptAccelerator  # noqa: E402


def prepared(value: float, **kwargs: object) -> tuple[CkptAccelerator, torch.nn.Linear]:
    """An Accelerator with one prepared model whose weights are all ``value``."""
    acc = CkptAccelerator(cpu=True, **kwargs)
    model = torch.nn.Linear(2, 2)
    torch.nn.init.constant_(model.weight, value)
    return acc, acc.prepare(model)


def weight(model: torch.nn.Module) -> float:
    return float(model.weight[0, 0])


def unlocked(folder: str) -> bool:
    """Whether a writer can open ``folder`` as a ckpt root now."""
    try:
        ckpt.CheckpointManager(folder, metrics=False).close()
    except ckpt.CheckpointLockedError:
        return False
    return True


def test_explicit_folders_of_new_accelerators_keep_their_own_states(tmp_path):
    """save_state("initial"), then a new Accelerator's save_state("checkpoint"): both saves
    are iteration 0, and "initial" came back with the later state."""
    first, model = prepared(1.0)
    first.save_state(str(tmp_path / "initial"))
    second, model = prepared(2.0)
    second.save_state(str(tmp_path / "checkpoint"))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "initial"]  # nothing else beside

    for folder, want in (("initial", 1.0), ("checkpoint", 2.0)):
        reader, model = prepared(0.0)
        reader.load_state(str(tmp_path / folder))
        assert weight(model) == want


def test_saving_into_a_folder_again_replaces_its_state(tmp_path):
    """As Accelerate overwrites the folder: the folder loads the newest save, and keeps one
    step."""
    for value in (1.0, 2.0, 3.0):
        acc, model = prepared(value)
        acc.save_state(str(tmp_path / "latest"))
    reader, model = prepared(0.0)
    reader.load_state(str(tmp_path / "latest"))
    assert weight(model) == 3.0
    assert sorted(p.name for p in (tmp_path / "latest").glob("step-*")) == ["step-00000002"]


def test_save_state_returns_with_the_step_committed_and_the_folder_unlocked(tmp_path):
    """The default is Accelerate's: the files are written when save_state returns, so the
    folder can be copied, loaded or locked by another writer at once; no writer thread."""
    before = set(threading.enumerate())
    acc, model = prepared(1.0)
    folder = acc.save_state(str(tmp_path / "state"))
    assert set(threading.enumerate()) - before == set()
    assert list((tmp_path / "state").glob("step-*/manifest.json"))  # committed
    assert unlocked(folder)


def test_asynchronous_saves_are_asked_for_and_released(tmp_path):
    """async_save=True: save_state returns once the state is copied; the folder is locked
    until wait_for_checkpoints(), or until the Accelerator is garbage-collected."""
    acc, model = prepared(1.0, ckpt_options={"async_save": True})
    folder = acc.save_state(str(tmp_path / "a"))
    assert not unlocked(folder)
    acc.wait_for_checkpoints()
    assert unlocked(folder)
    acc.save_state(str(tmp_path / "b"))
    del acc, model
    gc.collect()
    assert unlocked(str(tmp_path / "b"))


def test_a_second_accelerator_of_the_process_uses_the_same_project(tmp_path):
    """Two Accelerators on one project (automatic naming) in one process, the first still
    alive: the second loads the first's checkpoint, saves the next one, and loads it back;
    with asynchronous saves the second finishes the first's write instead of being locked
    out."""
    config = dict(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    first, model = prepared(1.0, project_config=ProjectConfiguration(**config))
    first.save_state()
    second, model = prepared(0.0, project_config=ProjectConfiguration(**config))
    second.load_state()
    assert weight(model) == 1.0 and second.save_iteration == 1
    torch.nn.init.constant_(model.weight, 2.0)
    second.save_state()
    reader, model = prepared(0.0, project_config=ProjectConfiguration(**config))
    reader.load_state()
    assert weight(model) == 2.0
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_0", "checkpoint_1"]

    busy, _ = prepared(3.0, ckpt_options={"async_save": True})
    busy.save_state(str(tmp_path / "shared"))
    other, _ = prepared(4.0, ckpt_options={"async_save": True})
    other.save_state(str(tmp_path / "shared"))  # finishes busy's write first
    other.wait_for_checkpoints()
    reader, model = prepared(0.0)
    reader.load_state(str(tmp_path / "shared"))
    assert weight(model) == 4.0 and busy is not None


def test_automatic_naming_keeps_total_limit_folders_and_refuses_an_existing_one(tmp_path):
    """total_limit counts checkpoint folders, dropped once the newer one is written; a save
    onto an existing checkpoint_<i> is refused as Accelerate refuses it."""
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True,
                                  total_limit=2)
    acc, model = prepared(1.0, project_config=config)
    for _ in range(4):
        acc.save_state()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_2", "checkpoint_3"]
    acc.project_configuration.iteration = 3
    with pytest.raises(ValueError, match="already exists"):
        acc.save_state()
