"""``ckpt export --to dcp DIR --force`` replaces an earlier DCP export at ``DIR``, and only
that: a folder holding anything else (the checkpoint root being exported, a folder that
contains it, a user's files) is refused with status 2 and left as it was.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckpt
from verify.cli import main


def root_with_a_step(path: Path) -> Path:
    with ckpt.CheckpointManager(path, async_save=False) as mgr:
        mgr.save(1, {"m": {"w": torch.arange(6.0).reshape(2, 3)}}, force=True)
    return path


def tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_force_replaces_an_earlier_dcp_export(tmp_path):
    root = root_with_a_step(tmp_path / "run1")
    out = tmp_path / "export"
    assert main(["export", str(root), "--to", "dcp", str(out)]) == 0
    before = tree(out)
    assert ".metadata" in before
    assert main(["export", str(root), "--to", "dcp", str(out), "--force"]) == 0
    assert tree(out) == before


@pytest.mark.parametrize("target", ["the root", "its parent", "a user's folder"])
def test_force_refuses_a_folder_that_is_no_dcp_export(tmp_path, capsys, target):
    parent = tmp_path / "work"
    parent.mkdir()
    (parent / "notes.txt").write_text("precious")
    root = root_with_a_step(parent / "run1")
    folder = {"the root": root, "its parent": parent, "a user's folder": tmp_path}[target]
    before = tree(tmp_path)
    assert main(["export", str(root), "--to", "dcp", str(folder), "--force"]) == 2
    err = capsys.readouterr().err
    assert "not a DCP export" in err and "Traceback" not in err
    assert tree(tmp_path) == before
    assert ckpt.inspect.open(root).steps() == [1]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".part")]


def test_the_library_call_refuses_the_same_folders_before_reading_the_step(tmp_path,
                                                                           monkeypatch):
    parent = tmp_path / "work"
    parent.mkdir()
    (parent / "notes.txt").write_text("precious")
    root = root_with_a_step(parent / "run1")
    before = tree(tmp_path)

    def no_load(*args, **kwargs):
        raise AssertionError("the step was read before the target was checked")

    monkeypatch.setattr(ckpt.api, "load", no_load)
    for folder in (root, parent):
        with pytest.raises(FileExistsError, match="is not a DCP export"):
            ckpt.interop.export_dcp(root, folder, force=True)
    assert tree(tmp_path) == before


def test_a_folder_that_stops_being_an_export_during_the_export_is_kept(tmp_path, monkeypatch):
    """The check runs again just before the old export is deleted: a file put into the
    folder while the new export was written (the folder is someone's now) keeps it."""
    import torch.distributed.checkpoint as dcp

    root = root_with_a_step(tmp_path / "run1")
    out = tmp_path / "export"
    assert main(["export", str(root), "--to", "dcp", str(out)]) == 0
    save = dcp.save

    def save_while_a_user_writes(*args, **kwargs):
        (out / "notes.txt").write_text("precious")
        return save(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", save_while_a_user_writes)
    with pytest.raises(FileExistsError, match="is not a DCP export"):
        ckpt.interop.export_dcp(root, out, force=True)
    assert (out / "notes.txt").read_text() == "precious" and (out / ".metadata").exists()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".part")]


@pytest.mark.parametrize("planted", ["a link to a folder", "a folder"])
def test_names_another_user_plants_beside_the_export_neither_block_it_nor_are_written(
        tmp_path, planted):
    """Another local user who can write the export's parent folder plants, at every
    temporary name an export could predict, a link into a folder of theirs (DCP would write
    the model there) or a folder (the export would fail): the export takes a name of its
    own, and what was planted is left as it was."""
    root = root_with_a_step(tmp_path / "run1")
    out = tmp_path / "export"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for name in (f"{out}.tmp-{os.getpid()}", f"{out}.tmp-export"):
        if planted == "a folder":
            os.mkdir(name)
        else:
            os.symlink(theirs, name)
    assert main(["export", str(root), "--to", "dcp", str(out)]) == 0
    assert not out.is_symlink() and ".metadata" in tree(out)
    assert tree(theirs) == []
    assert {p for p in os.listdir(tmp_path) if ".tmp-" in p} == {
        "export.tmp-export", f"export.tmp-{os.getpid()}"}
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".part")]
