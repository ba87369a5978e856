"""``ckpt import`` into a root whose steps it would disorder (a step already saved there, or
one older than the newest) is refused as a usage error (status 2, one line saying what to
give instead), and the root is left as it was."""

from __future__ import annotations

import pytest
import torch

import ckpt
from verify.cli import main


@pytest.mark.parametrize("step,says", [("3", "step 3 is already saved in "),
                                       ("2", "a newer step, 3, is saved in ")])
@pytest.mark.parametrize("name", ["run1", "run. two"])  # a sentence's end inside the path
def test_an_import_onto_a_saved_or_older_step_is_a_usage_error(tmp_path, capsys, step, says,
                                                               name):
    root = tmp_path / name
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"m": {"w": torch.full((4,), float(s))}}, force=True)
    assert main(["export", str(root), "--step", "1", "--to", "dcp", str(tmp_path / "d")]) == 0
    capsys.readouterr()
    assert main(["import", str(tmp_path / "d"), str(root), "--step", step]) == 2
    err = capsys.readouterr().err
    assert "--step" in err and "overwrite=True" not in err and "Traceback" not in err
    assert f"{says}{root}; give a --step after the root's newest step" in err
    assert ckpt.inspect.open(root).steps() == [1, 2, 3]
    assert main(["import", str(tmp_path / "d"), str(root), "--step", "4"]) == 0
