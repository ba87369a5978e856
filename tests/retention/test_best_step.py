"""ckpt.tools.best_step: the committed step with the best value of a metric saved with it."""

from __future__ import annotations

import math

import pytest
import torch

import ckpt
import ckpt.tools


def _root(path, losses: dict[int, float | None]) -> None:
    with ckpt.CheckpointManager(path, async_save=False) as mgr:
        for step, loss in losses.items():
            mgr.save(step, {"w": torch.full((2,), float(step))}, force=True,
                     metrics=None if loss is None else {"val_loss": loss, "acc": -loss})


def test_best_step_by_min_and_max_from_a_path_or_a_manager(tmp_path):
    _root(tmp_path / "root", {1: 0.9, 2: 0.4, 3: math.nan, 4: None, 5: 0.6})
    assert ckpt.tools.best_step(tmp_path / "root", "val_loss") == 2
    assert ckpt.tools.best_step(str(tmp_path / "root"), "acc", mode="max") == 2
    with ckpt.CheckpointManager(tmp_path / "root", read_only=True) as mgr:
        best = ckpt.tools.best_step(mgr, "val_loss")
        state = {"w": torch.zeros(2)}
        assert mgr.restore(state, step=best) == 2 and state["w"].tolist() == [2.0, 2.0]


def test_best_step_tie_goes_to_the_newer_step_and_none_without_values(tmp_path):
    _root(tmp_path / "root", {1: 0.5, 2: 0.5, 3: None})
    assert ckpt.tools.best_step(tmp_path / "root", "val_loss") == 2
    assert ckpt.tools.best_step(tmp_path / "root", "bleu") is None
    with pytest.raises(ValueError, match="best_mode"):
        ckpt.tools.best_step(tmp_path / "root", "val_loss", mode="lowest")
