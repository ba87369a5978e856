"""Named fault points for crash tests: ``CKPT_FAULT=kill:<point>[:<nth>]`` SIGKILLs the process
the nth time (default first) it reaches ``<point>``; ``term:<point>[:<nth>]`` sends it SIGTERM
(its handler runs at once, on the main thread); ``raise:<point>[:<nth>]`` raises OSError.

Read once at import; a process without the variable pays one dict lookup per point.
"""

from __future__ import annotations

import errno
import os
import signal

_SPEC = os.environ.get("CKPT_FAULT", "")
_action, _, _rest = _SPEC.partition(":")
_point, _, _nth = _rest.partition(":")
_count = {"n": 0}


def fault_point(name: str) -> None:
    """Crash here if the environment asked for it (tests only)."""
    if not _SPEC or name != _point:
        return
    _count["n"] += 1
    if _count["n"] != int(_nth or 1):
        return
    if _action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif _action == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif _action == "raise":
        raise OSError(errno.EIO, f"injected fault at {name}")
