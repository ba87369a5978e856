"""A dropped straggler sends SIGTERM to its torchrun agent only: a parent that merely
mentions torchrun in its command line (a wrapper script ``torchrun_job.py``, a job folder
named ``torchrun``) is not the agent and is never signalled.

Real processes: the parent runs the named script and starts a child that stands for the
launcher a warm zygote names (``trainer.warm``), so the agent looked up is that parent.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from trainer.straggler_drop import torchrun_agent
from trainer.warm import LAUNCHER_ENV, ZYGOTE_ENV

PARENT = """
import subprocess, sys
child = subprocess.Popen(["sleep", "60"])
print(child.pid, flush=True)
sys.stdin.read()
child.kill()
"""


def agent_of_a_child_of(script, monkeypatch) -> tuple[int | None, int]:
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        launcher = int(proc.stdout.readline())
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
        monkeypatch.setenv(ZYGOTE_ENV, str(os.getppid()))
        monkeypatch.setenv(LAUNCHER_ENV, str(launcher))
        return torchrun_agent(), proc.pid
    finally:
        proc.stdin.close()
        proc.wait(10)


@pytest.mark.parametrize("path", ["torchrun_job.py", "torchrun/start.py"])
def test_a_wrapper_that_mentions_torchrun_is_not_the_agent(tmp_path, monkeypatch, path):
    script = tmp_path / path
    script.parent.mkdir(exist_ok=True)
    script.write_text(PARENT)
    agent, _ = agent_of_a_child_of(script, monkeypatch)
    assert agent is None


def test_a_parent_running_torchrun_is_the_agent(tmp_path, monkeypatch):
    script = tmp_path / "bin" / "torchrun"  # as the console script runs: python .../torchrun
    script.parent.mkdir()
    script.write_text(PARENT)
    agent, parent = agent_of_a_child_of(script, monkeypatch)
    assert agent == parent
