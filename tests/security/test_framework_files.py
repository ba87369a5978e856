"""The small files the HF integration writes into a checkpoint folder (the optimizer marker,
the verified trainer state) go through a fresh temporary beside them: a link planted in the
folder at the name such a write once used (``.optimizer.pt.part``) is never written through."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the HF extra is not installed")

from trainer.integrations import _hf_folder as hff  # noqa: E402
from trainer.integrations.hf import CkptTrainer  # noqa: E402


def planted(tmp_path, name: str):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    (folder / name).symlink_to(victim)
    return folder, victim


def test_the_optimizer_marker_is_not_written_through_a_planted_link(tmp_path):
    folder, victim = planted(tmp_path, f".{hff.OPTIMIZER_NAME}.part")
    hff.write_marker(str(folder), 3)
    assert victim.read_text() == "precious\n"
    assert not (folder / hff.OPTIMIZER_NAME).is_symlink() and hff.is_marker(str(folder))


def test_the_trainer_state_is_not_written_through_a_planted_link(tmp_path):
    folder, victim = planted(tmp_path, ".trainer_state.json.part")
    CkptTrainer._write_state(str(folder), '{"global_step": 3}\n')
    assert victim.read_text() == "precious\n"
    assert (folder / "trainer_state.json").read_text() == '{"global_step": 3}\n'
