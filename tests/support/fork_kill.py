"""The killed run and the resumed run of an integration job, with one import of the framework.

Lightning, transformers and accelerate take seconds to import. A job script that would be
started twice (a run that SIGKILLs itself, then a run that resumes) instead forks after its
imports: the child trains and is SIGKILLed for real; the parent, which has trained nothing,
waits for it, reports on stdout how it ended (``killed <signal>``), then waits for ``go`` on
stdin (the test inspects and corrupts the checkpoints meanwhile) and resumes. ``run_forked``
runs such a job in a process of the test suite's fork server instead, which has imported the
job's framework already; the report and the ``go`` then travel on a pipe.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Callable

RESUMING = "=== resuming ==="  # on stderr: what follows is the resumed run's


# Set by run_forked: the job's connection to the test, instead of stdout/stdin.
_conn = None


def run_forked(module: str, script: str, mode: str, work: str, conn) -> None:
    """Run job script ``module``'s main (``script MODE WORK``) in this process, one forked
    from the test suite's fork server (tests/support/ranks.py) whose preload imported the
    script and its framework: no second import of them. The process gets a session of its
    own (the test may SIGKILL it and a child still running as a group), its output goes to
    WORK/<script>.stderr, and kill_then_wait reports on ``conn`` and waits for its ``go``."""
    global _conn
    os.setsid()
    log = os.open(os.path.join(work, f"{script}.stderr"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    _conn = conn
    sys.argv = [script, mode, work]
    importlib.import_module(module).main()


def kill_then_wait(killed_run: Callable[[], object]) -> None:
    """Run ``killed_run`` in a forked child (it must SIGKILL itself); return once the test
    said ``go``."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            killed_run()
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(3)  # not killed: the parent reports it
    _, status = os.waitpid(pid, 0)
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)
    if _conn is not None:
        _conn.send(f"killed {sig}")
        said = _conn.recv() if _conn.poll(600) else ""
    else:
        print(f"killed {sig}", flush=True)
        said = sys.stdin.readline()
    if said.strip() != "go":
        raise SystemExit("the test did not say go")
    print(RESUMING, file=sys.stderr, flush=True)
