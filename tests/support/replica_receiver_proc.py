"""A replica receiver in a process of its own, so that a test can read what connections cost
it (``/proc/<pid>/status``: peak resident memory, threads). Forked from the suite's fork
server (tests/support/ranks.py), which has ckpt imported already."""

from __future__ import annotations

from typing import Any

from ckpt._memory.replication import Replicator


def serve(shm: str, key: str, auth_timeout: float, port: Any, stop: Any) -> None:
    """Run a receiver (job "j", node "n") with ``key``; put its port in ``port``; return
    once ``stop`` is set."""
    rep = Replicator(shm_dir=shm, job="j", node="n", keep=2, timeout=auth_timeout,
                     host="127.0.0.1", auth_timeout=auth_timeout)
    rep.connect([], key)
    port.put(rep.address[1])
    stop.wait()
    rep.close()
