"""The lighthouse of a live job: torchft's quorum server, bound to the job's address.

Every replica group heartbeats to it and asks it for the quorum of each step; it drops a
group that has been silent for ``heartbeat_timeout``. It holds no training state: a
lighthouse restarted at the same address (within the groups' quorum retry window) carries
on, which is how :class:`trainer.live.supervisor.LiveJob` supervises it.

``python -m trainer.live.lighthouse --bind HOST:PORT --min-replicas N`` runs one. It starts
in a fraction of a second because it loads torchft's native extension alone, without
``import torch`` (the ``torchft`` package imports torch first, seconds on a busy machine).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import threading
from pathlib import Path
from types import ModuleType

from trainer.live.config import is_wildcard


def native() -> ModuleType:
    """torchft's native extension (``torchft._torchft``), loaded without the package."""
    if "torchft._torchft" in sys.modules:
        return sys.modules["torchft._torchft"]
    package = importlib.util.find_spec("torchft")
    if package is None or not package.submodule_search_locations:
        raise ModuleNotFoundError("live recovery needs torchft: pip install 'ckpt[live]'")
    folder = Path(list(package.submodule_search_locations)[0])
    found = sorted(folder.glob("_torchft*.so")) + sorted(folder.glob("_torchft*.pyd"))
    if not found:
        raise ModuleNotFoundError(f"torchft's native extension is missing from {folder}")
    spec = importlib.util.spec_from_file_location("torchft._torchft", found[0])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def start_lighthouse(bind: str, min_replicas: int, *, heartbeat_timeout: float = 5.0,
                     join_timeout: float = 60.0, quorum_tick: float = 0.1) -> object:
    """A ``LighthouseServer`` listening on ``bind`` (``host:port``; port 0 picks one).

    Args:
        bind: the job's address and a port; a wildcard address is refused.
        min_replicas: fewest replica groups in a quorum.
        heartbeat_timeout: seconds of silence after which a group leaves the quorum.
        join_timeout: seconds a new quorum waits for heartbeating stragglers to ask.
        quorum_tick: seconds between the lighthouse's checks for a quorum.
    """
    if is_wildcard(bind.rsplit(":", 1)[0]):
        raise ValueError(f"bind the lighthouse to the job's address, not {bind!r}")
    return native().LighthouseServer(
        bind=bind, min_replicas=min_replicas, join_timeout_ms=int(join_timeout * 1000),
        quorum_tick_ms=int(quorum_tick * 1000),
        heartbeat_timeout_ms=int(heartbeat_timeout * 1000))


def main(argv: list[str] | None = None) -> int:
    """Run a lighthouse until SIGTERM/SIGINT."""
    p = argparse.ArgumentParser(prog="python -m trainer.live.lighthouse")
    p.add_argument("--bind", required=True, help="HOST:PORT (the job's address)")
    p.add_argument("--min-replicas", type=int, required=True)
    p.add_argument("--heartbeat-timeout", type=float, default=5.0, help="seconds")
    p.add_argument("--join-timeout", type=float, default=60.0, help="seconds")
    p.add_argument("--quorum-tick", type=float, default=0.1, help="seconds")
    p.add_argument("--ready-fd", type=int, default=None,
                   help="a pipe's file descriptor to write one byte to once listening "
                        "(for a supervisor)")
    args = p.parse_args(argv)
    try:
        server = start_lighthouse(args.bind, args.min_replicas,
                                  heartbeat_timeout=args.heartbeat_timeout,
                                  join_timeout=args.join_timeout,
                                  quorum_tick=args.quorum_tick)
    except Exception as e:  # a taken port, a bad address: one line, no traceback
        print(f"lighthouse: cannot listen on {args.bind}: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"lighthouse: listening on {args.bind}", flush=True)
    if args.ready_fd is not None:
        os.write(args.ready_fd, b"1")
        os.close(args.ready_fd)
    stop.wait()
    server.shutdown()  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    sys.exit(main())
