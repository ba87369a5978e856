"""``ckpt export`` writes its file (``--to safetensors|torch``) or folder (``--to hf``) under a
temporary name beside the target, then renames it into place.

Threat model: another local user who can write the target's folder (a shared output folder)
plants an entry where the temporary name will be: a file or a folder, to make the export
fail, or a link to a file or folder of the exporting user, to have the export write through
it. The temporary name is unguessable and created exclusively, never through a link, so the
export succeeds, writes only its target, and leaves the planted entry and what it points at
as they were.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

import ckpt
from verify.cli import main

FORMATS = {"safetensors": "model.safetensors", "torch": "model.pt", "hf": "hf-model"}


def plant(at, kind: str, victim_file, victim_dir) -> None:
    if kind == "file":
        at.write_bytes(b"planted")
    elif kind == "folder":
        at.mkdir()
    else:
        os.symlink(victim_file if kind == "link to a file" else victim_dir, at)


@pytest.mark.parametrize("kind", ["file", "folder", "link to a file", "link to a folder"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_export_succeeds_past_an_entry_planted_at_the_predictable_temp_name(
        tmp_path, capsys, fmt, kind):
    """The name a temporary file or folder would have if built from the target and the
    process id (``<target>.tmp-<pid>``) is taken beforehand: the export still succeeds."""
    root = tmp_path / "root"
    weight = torch.arange(6.0).reshape(2, 3)
    with ckpt.CheckpointManager(str(root), async_save=False) as mgr:
        mgr.save(1, {"model": {"weight": weight}})
    shared = tmp_path / "shared"
    shared.mkdir()
    victim_file, victim_dir = tmp_path / "victim.txt", tmp_path / "victim-dir"
    victim_file.write_text("precious")
    victim_dir.mkdir()
    target = shared / FORMATS[fmt]
    planted = shared / f"{target.name}.tmp-{os.getpid()}"
    plant(planted, kind, victim_file, victim_dir)

    code = main(["export", str(root), "--to", fmt, str(target), "--item", "model"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    if fmt == "torch":
        loaded = torch.load(target, weights_only=True)
    else:
        loaded = load_file(next(target.glob("*.safetensors")) if fmt == "hf" else target)
    assert torch.equal(loaded["weight"], weight)
    assert victim_file.read_text() == "precious" and os.listdir(victim_dir) == []
    assert os.path.lexists(planted) and sorted(os.listdir(shared)) == sorted(
        [target.name, planted.name])  # nothing else left behind
