"""``ckpt gc`` on the roots of the framework integrations (Lightning's ``.ckpts.ckpt``, HF's
``.out.ckpt``): their retention is the framework's (a step goes once no ``.ckpt`` file or
``checkpoint-N`` folder names it), so retention rules given to gc are refused with status 2
and every step stays; gc without rules still removes what crashed saves left. Given the
framework's folder (``ckpts/``), gc works on its hidden sibling root, as ``ls`` and
``verify`` do, instead of reporting an empty root.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckpt
from verify.cli import main

# The manifest metadata each integration records in its steps.
FRAMEWORKS = {"lightning": "lightning_files", "hf": "hf_model_files"}


def framework_root(tmp_path: Path, key: str) -> tuple[Path, Path]:
    """A framework folder ``ckpts/`` and its sibling root holding steps 1, 2, 3 whose
    manifests carry the framework's metadata ``key``."""
    folder, root = tmp_path / "ckpts", tmp_path / ".ckpts.ckpt"
    folder.mkdir()
    (folder / "epoch=0-step=3.ckpt").write_bytes(b"a framework's file")
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"x": torch.full((4,), float(step))}, force=True,
                     metadata={key: []})
    return folder, root


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
@pytest.mark.parametrize("rule", [["--keep-last", "1"], ["--keep-every", "2", "--keep-last",
                                                         "1"]])
def test_retention_rules_on_a_framework_root_are_refused(tmp_path, capsys, framework, rule):
    _, root = framework_root(tmp_path, FRAMEWORKS[framework])
    assert main(["gc", str(root), *rule, "--yes"]) == 2
    err = capsys.readouterr().err
    assert "framework" in err and "Traceback" not in err
    assert ckpt.inspect.open(root).steps() == [1, 2, 3]


def test_gc_without_rules_on_a_framework_root_removes_leftovers_only(tmp_path):
    _, root = framework_root(tmp_path, "lightning_files")
    leftover = root / ".tmp-step-00000004-x"
    leftover.mkdir()
    (leftover / "data.safetensors").write_bytes(b"half")
    assert main(["gc", str(root), "--yes"]) == 0
    assert not leftover.exists()
    assert ckpt.inspect.open(root).steps() == [1, 2, 3]


def test_gc_on_the_framework_folder_works_on_its_sibling_root(tmp_path, capsys):
    folder, root = framework_root(tmp_path, "lightning_files")
    assert main(["gc", str(folder), "--keep-last", "1"]) == 2  # its root's rules: refused
    assert "framework" in capsys.readouterr().err
    leftover = root / ".tmp-step-00000004-x"
    leftover.mkdir()
    assert main(["gc", str(folder), "--yes"]) == 0
    out = capsys.readouterr()
    assert str(root) in out.err and not leftover.exists()
    assert sorted(os.listdir(folder)) == ["epoch=0-step=3.ckpt"]
    assert ckpt.inspect.open(root).steps() == [1, 2, 3]


def test_each_framework_key_is_defined_in_one_module():
    """The metadata key that marks a framework's steps is assigned once, in
    verify/integration_keys.py or the module it takes it from, and the integration that
    writes it and the gc that reads it both import that name: a key renamed on one side
    cannot leave gc blind to the framework's steps (and retiring them by count)."""
    import ast

    from verify.integration_keys import FRAMEWORK_STEPS

    repo = Path(__file__).resolve().parents[2]
    defined: dict[str, list[str]] = {key: [] for key in FRAMEWORK_STEPS}
    for package in ("ckpt", "storage_backends", "trainer", "verify"):
        for path in sorted((repo / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and node.value in defined:
                    defined[node.value].append(str(path.relative_to(repo)))
    assert all(len(places) == 1 for places in defined.values()), defined
