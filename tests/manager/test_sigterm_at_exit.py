"""SIGTERM that arrives while the interpreter exits (an atexit callback running) finishes
the manager's save in flight without raising SystemExit there, which Python would print as
"Exception ignored in atexit callback ... SystemExit: 143"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import atexit, os, signal, sys, time
import torch, ckpt
mgr = ckpt.CheckpointManager(sys.argv[1], async_save=True)
mgr.save(1, {"w": torch.ones(4)}, force=True)

def slow_cleanup():  # a library's exit hook, registered after the manager: runs first
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)

atexit.register(slow_cleanup)
print("main done", flush=True)
"""


def test_sigterm_during_atexit_prints_no_ignored_exception(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    root = tmp_path / "root"
    done = subprocess.run([sys.executable, str(script), str(root)], capture_output=True,
                          text=True, timeout=120, cwd=str(Path(__file__).parents[2]))
    assert "main done" in done.stdout, done.stderr
    assert "Exception ignored" not in done.stderr and "SystemExit" not in done.stderr, \
        done.stderr
    assert done.returncode == 0, done.stderr
    assert (root / "step-00000001" / "manifest.json").exists()  # the save in flight finished
