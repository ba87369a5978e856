"""torchrun with a shorter grace before its agent SIGKILLs workers that ignore SIGTERM.

    python tests/support/torchrun.py GRACE <torchrun arguments...>

When a torchrun agent restarts its worker group it SIGTERMs the workers and waits 30 s
(hard-coded: ``LocalElasticAgent._stop_workers`` calls ``_shutdown()`` with its default
timeout; ``--shutdown-timeout`` only covers the agent's own exit) before it SIGKILLs those
still there. A hung (SIGSTOPped) worker never exits on SIGTERM, so a test of a hung rank
would wait those 30 s for nothing. This runs the real torchrun (``torch.distributed.run``)
with only that default changed; the agent's exit keeps its own ``--shutdown-timeout``.
"""

from __future__ import annotations

import inspect
import signal
import sys

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.run import main


def shorten_restart_grace(grace: float) -> None:
    """Make ``grace`` seconds the default wait of ``LocalElasticAgent._shutdown``."""
    original = LocalElasticAgent._shutdown
    timeout = inspect.signature(original).parameters.get("timeout")
    if timeout is None or timeout.default != 30:  # another torch: say so, do not guess
        raise RuntimeError(f"LocalElasticAgent._shutdown{inspect.signature(original)} has "
                           "no timeout defaulting to 30 s; update tests/support/torchrun.py")

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM,
                  timeout: float = grace) -> None:
        original(self, death_sig, timeout)

    LocalElasticAgent._shutdown = _shutdown


if __name__ == "__main__":
    shorten_restart_grace(float(sys.argv[1]))
    sys.argv = ["torchrun", *sys.argv[2:]]
    main()
