"""The memory tier's default (on under torchrun) meets the user's checkpoint options.

The memory tier cannot hold incremental steps (they reference their base step's files in
the root). A job that asked for incremental saves in ``CheckpointConfig.manager_options``
and left ``memory_tier`` at its default must therefore run under torchrun as it runs in a
plain process: the default gives way (the tier stays off, and the log says why); it must
not fail every worker at start with an error about a memory tier the user never asked for.
Asking for both explicitly is refused when the config is built, naming both fields.
"""

from __future__ import annotations

import logging

import pytest

import ckpt
from trainer import CheckpointConfig
from trainer.checkpointing import manager_keywords

INCREMENTAL = [{"options": ckpt.SaveOptions(incremental=True, compression="zstd")},
               {"incremental": True}]


def test_incremental_saves_under_torchrun_keep_the_memory_tier_off(monkeypatch, tmp_path,
                                                                    caplog):
    """Under torchrun (the tier's default on), incremental manager options leave the tier off:
    the manager the trainer builds from them opens and saves incrementally."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run7")
    caplog.set_level(logging.INFO, logger="trainer.elastic")
    config = CheckpointConfig(manager_options={"keep_last": 2, **INCREMENTAL[0]})
    keywords = manager_keywords(config, root=tmp_path / "root", elastic=True)
    assert "memory_tier" not in keywords
    assert "incremental" in caplog.text and "memory tier" in caplog.text
    with ckpt.CheckpointManager(tmp_path / "root", **keywords) as mgr:
        assert mgr.save(1, {"x": ckpt.RNGState()}, force=True) is not None
        mgr.wait()
        assert mgr.steps() == [1]


def test_the_default_stays_on_under_torchrun_without_incremental_saves(monkeypatch,
                                                                         tmp_path):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run7")
    config = CheckpointConfig(manager_options={"options": ckpt.SaveOptions(
        compression="zstd")})
    keywords = manager_keywords(config, root=tmp_path, elastic=True)
    assert isinstance(keywords["memory_tier"], ckpt.MemoryTierOptions)
    assert keywords["options"].compression == "zstd"


@pytest.mark.parametrize("options", INCREMENTAL, ids=["save-options", "shorthand"])
def test_asking_for_the_memory_tier_and_incremental_saves_is_refused_at_config(options):
    with pytest.raises(ValueError, match="memory_tier=True.*incremental"):
        CheckpointConfig(memory_tier=True, manager_options=options)
