"""The architecture as contracts: import-linter's layers and forbidden-import contracts in
setup.cfg hold for the code as it is, fail as soon as an import is added against them, and
docs/design.md's picture of the wings is the one the imports draw."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("ckpt", "storage_backends", "trainer", "verify")


def lint_imports(repo: Path) -> subprocess.CompletedProcess:
    """import-linter over the packages found in ``repo``, with the contracts in its setup.cfg."""
    env = dict(os.environ, PYTHONPATH=str(repo), COLUMNS="200")
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command;"
                           " lint_imports_command()", "--config", str(repo / "setup.cfg"),
                           "--no-cache"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def copy_of_the_code(tmp_path_factory) -> Path:
    """The four packages and setup.cfg copied aside, so a test may add an import to them."""
    root = tmp_path_factory.mktemp("code")
    for name in PACKAGES:
        shutil.copytree(REPO / name, root / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(REPO / "setup.cfg", root / "setup.cfg")
    return root


def test_the_code_keeps_every_layering_contract():
    """Every contract in setup.cfg holds: the packages import one way, ckpt's wings only the
    wings below them (save and load never each other), the format does no I/O, verify and
    trainer reach ckpt only through its public modules (ckpt, ckpt.inspect, ckpt.tools,
    ckpt.errors, ckpt.options), and storage_backends imports neither torch nor ckpt."""
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "BROKEN" not in result.stdout


def _add_import(root: Path, module: str, line: str) -> Path:
    path = root / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = root / module.replace(".", "/") / "__init__.py"
    original = path.read_text()
    path.write_text(original + "\n" + line + "\n")
    return path


@pytest.mark.parametrize("module, line, contract", [
    ("ckpt._load.reader", "import ckpt._save", "ckpt's wings import only the wings below them"),
    ("ckpt._save.chunking", "import ckpt._load", "ckpt's wings import only the wings below them"),
    ("ckpt._format.layout", "import ckpt._step",
     "ckpt's wings import only the wings below them"),
    ("ckpt._format.layout", "import concurrent.futures",
     "The on-disk format does no I/O and starts no threads"),
    ("ckpt._format.layout", "import storage_backends",
     "The on-disk format does no I/O and starts no threads"),
    ("storage_backends.base", "import torch",
     "storage_backends moves bytes: no torch, nothing of ckpt"),
    ("storage_backends.base", "import ckpt.errors",
     "storage_backends moves bytes: no torch, nothing of ckpt"),
    ("ckpt.errors", "import verify",
     "The four packages import one way: trainer > verify > ckpt > storage_backends"),
    ("verify.report", "import trainer",
     "The four packages import one way: trainer > verify > ckpt > storage_backends"),
    ("verify.report", "import ckpt._step.pointer",
     "verify and trainer use only the public modules of ckpt"),
    ("trainer.data", "from ckpt._format import names",
     "verify and trainer use only the public modules of ckpt"),
    ("verify.report", "import storage_backends",
     "verify and trainer use only the public modules of ckpt"),
])
def test_an_import_against_the_layering_breaks_its_contract(copy_of_the_code, module, line,
                                                            contract):
    """Adding one import that goes against a rule makes import-linter fail and name the
    contract it breaks (the contracts are live, not decoration)."""
    path = _add_import(copy_of_the_code, module, line)
    original = path.read_text().rsplit("\n" + line + "\n", 1)[0]
    try:
        result = lint_imports(copy_of_the_code)
    finally:
        path.write_text(original)
    assert result.returncode != 0
    assert f"{contract} BROKEN" in " ".join(result.stdout.split()), result.stdout[-3000:]


def test_the_wings_picture_in_the_design_doc_is_drawn_from_the_imports():
    """docs/design.md shows the wings as the code's imports draw them today
    (``python docs/wings.py`` redraws it)."""
    result = subprocess.run([sys.executable, str(REPO / "docs" / "wings.py"), "--check"],
                            cwd=REPO, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode == 0, result.stderr
