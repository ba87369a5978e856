"""A dropped straggler sends SIGTERM to its torchrun agent only: a process between the agent
and the worker (an entrypoint wrapper such as ``torchrun_job.py``, which the agent started
with the workers' environment) is looked past, even when its command line mentions torchrun,
and a worker with no agent above it signals nobody.

Real processes: an "agent" (a script at ``bin/torchrun``, as the console script runs) starts
a wrapper with the run's ``TORCHELASTIC_RUN_ID``, which starts a child that stands for the
launcher a warm zygote names (``trainer.warm``): the agent looked up is the one above it.
"""

from __future__ import annotations

import os
import subprocess
import sys

from trainer.straggler_drop import torchrun_agent
from trainer.warm import LAUNCHER_ENV, ZYGOTE_ENV

LEAF = """
import subprocess, sys
child = subprocess.Popen(["sleep", "60"])
print(child.pid, flush=True)
sys.stdin.read()
child.kill()
"""
# starts the script argv[1] with TORCHELASTIC_RUN_ID=job, passing its output through
AGENT = """
import os, subprocess, sys
wrapper = subprocess.Popen([sys.executable, sys.argv[1]], stdin=subprocess.PIPE,
                           env={**os.environ, "TORCHELASTIC_RUN_ID": "job"})
sys.stdin.read()
wrapper.stdin.close()
wrapper.wait()
"""


def launcher_under(argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)
    return proc, int(proc.stdout.readline())


def agent_seen_from(launcher: int, monkeypatch) -> int | None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv(ZYGOTE_ENV, str(os.getppid()))
    monkeypatch.setenv(LAUNCHER_ENV, str(launcher))
    return torchrun_agent()


def script(tmp_path, path: str, text: str):
    f = tmp_path / path
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(text)
    return str(f)


def test_a_wrapper_that_mentions_torchrun_is_looked_past_to_the_agent(tmp_path, monkeypatch):
    agent = script(tmp_path, "bin/torchrun", AGENT)
    wrapper = script(tmp_path, "torchrun_job.py", LEAF)
    proc, launcher = launcher_under([sys.executable, agent, wrapper], dict(os.environ))
    try:
        assert agent_seen_from(launcher, monkeypatch) == proc.pid
    finally:
        proc.stdin.close()
        proc.wait(10)


def test_a_wrapper_with_no_agent_above_it_is_not_signalled(tmp_path, monkeypatch):
    wrapper = script(tmp_path, "torchrun/start.py", LEAF)
    proc, launcher = launcher_under([sys.executable, wrapper],
                                    {**os.environ, "TORCHELASTIC_RUN_ID": "job"})
    try:
        assert agent_seen_from(launcher, monkeypatch) is None  # above it: pytest
    finally:
        proc.stdin.close()
        proc.wait(10)


def test_the_agent_that_started_the_worker_itself_is_found(tmp_path, monkeypatch):
    agent = script(tmp_path, "bin/torchrun", LEAF)
    proc, launcher = launcher_under([sys.executable, agent], dict(os.environ))
    try:
        assert agent_seen_from(launcher, monkeypatch) == proc.pid
    finally:
        proc.stdin.close()
        proc.wait(10)
