"""SIGTERM where Python ignores exceptions. While the interpreter exits (an atexit callback
running) it finishes the manager's save in flight without raising SystemExit there, which
Python would print as "Exception ignored in atexit callback ... SystemExit: 143". Inside a
finalizer or a weakref callback of a running program (a collection the training loop set
off), where the exit would be ignored and training would go on, the signal comes again and
the process exits 143."""

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


def run_job(tmp_path: Path, source: str) -> tuple[subprocess.CompletedProcess, Path]:
    """``source`` run as a script with a root under ``tmp_path``: its outcome, the root."""
    script, root = tmp_path / "job.py", tmp_path / "root"
    script.write_text(source)
    done = subprocess.run([sys.executable, str(script), str(root)], capture_output=True,
                          text=True, timeout=120, cwd=str(Path(__file__).parents[2]))
    return done, root


def test_sigterm_during_atexit_prints_no_ignored_exception(tmp_path):
    done, root = run_job(tmp_path, SCRIPT)
    assert "main done" in done.stdout, done.stderr
    assert "Exception ignored" not in done.stderr and "SystemExit" not in done.stderr, \
        done.stderr
    assert done.returncode == 0, done.stderr
    assert (root / "step-00000001" / "manifest.json").exists()  # the save in flight finished


IN_A_FINALIZER = """
import signal, sys, time, weakref
import torch, ckpt
mgr = ckpt.CheckpointManager(sys.argv[1], async_save=True)
mgr.save(1, {"w": torch.ones(4)}, force=True)

class Held:
    pass

def callback(_):  # the handler runs inside this callback, which ignores exceptions
    signal.raise_signal(signal.SIGTERM)
    for _ in range(1000):
        pass

held = Held()
ref = weakref.ref(held, callback)
del held
deadline = time.monotonic() + 20
while time.monotonic() < deadline:  # training goes on
    time.sleep(0.01)
print("trained on", flush=True)
"""


def test_sigterm_whose_exit_a_weakref_callback_ignores_still_exits_143(tmp_path):
    done, root = run_job(tmp_path, IN_A_FINALIZER)
    assert "trained on" not in done.stdout, done.stderr
    assert done.returncode == 143, done.stderr
    assert "signalling again" in done.stderr
    assert (root / "step-00000001" / "manifest.json").exists()  # the save in flight finished
