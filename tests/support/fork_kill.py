"""The killed run and the resumed run of an integration job, with one import of the framework.

Lightning, transformers and accelerate take seconds to import. A job script that would be
started twice (a run that SIGKILLs itself, then a run that resumes) instead forks after its
imports: the child trains and is SIGKILLed for real; the parent, which has trained nothing,
waits for it, reports on stdout how it ended (``killed <signal>``), then waits for ``go`` on
stdin (the test inspects and corrupts the checkpoints meanwhile) and resumes.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

RESUMING = "=== resuming ==="  # on stderr: what follows is the resumed run's


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
    print(f"killed {sig}", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("the test did not say go")
    print(RESUMING, file=sys.stderr, flush=True)
