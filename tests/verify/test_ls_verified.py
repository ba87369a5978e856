"""``ckpt ls`` shows whether each step is verified: when and at which step it was confirmed,
and a marker it does not trust (damaged, edited, stale) with the reason, escaped."""

from __future__ import annotations

import json
import os

import torch

import ckpt
from verify.cli import main


def cli(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args])
    out, _ = capsys.readouterr()
    return code, out


def test_ls_shows_verified_unverified_and_ignored_markers(tmp_path, capsys):
    root = str(tmp_path / "r")
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        for s in (5, 10, 15):
            mgr.save(s, {"w": torch.full((4,), float(s))})
        mgr.mark_verified(5, {"window": 3, "confirmed_at": 8})
    with open(os.path.join(root, "step-00000010", "verified.json"), "w") as f:
        f.write('{"format": "ckpt-verified", "\\u001b[2Jstep": 10}')  # an escape in a key

    code, out = cli(capsys, "ls", root)
    assert code == 0
    header, _, *rows, reason = out.splitlines()
    assert "VERIFIED" in header.split()
    cells = {int(r.split()[0]): r for r in rows}
    assert "yes (at 8)" in cells[5] and "ignored (below)" in cells[10]
    assert " - " in cells[15].split("committed")[0][-20:]
    assert reason.startswith("step 10: verified marker ignored: ") and "\x1b" not in out
    assert "\\x1b[2Jstep" in reason

    code, out = cli(capsys, "ls", "--json", root)
    steps = {r["step"]: r for r in json.loads(out)["steps"]}
    assert steps[5]["verified"] == "verified"
    assert steps[5]["verified_evidence"] == {"window": 3, "confirmed_at": 8}
    assert isinstance(steps[5]["verified_at"], float)
    assert steps[10]["verified"] == "untrusted" and "missing fields" in steps[10][
        "verified_problem"]
    assert steps[15]["verified"] == "unverified" and "verified_problem" not in steps[15]
