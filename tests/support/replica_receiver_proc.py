"""A replica receiver in a process of its own, so that a test can read what connections cost
it (``/proc/<pid>/status``: peak resident memory, threads). Prints its port, then runs until
its stdin closes.

    python -m tests.support.replica_receiver_proc SHM_DIR KEY AUTH_TIMEOUT
"""

from __future__ import annotations

import sys

from ckpt._memory.replication import Replicator


def main() -> None:
    shm, key, auth_timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
    rep = Replicator(shm_dir=shm, job="j", node="n", keep=2, timeout=auth_timeout,
                     host="127.0.0.1", auth_timeout=auth_timeout)
    rep.connect([], key)
    print(rep.address[1], flush=True)
    sys.stdin.read()
    rep.close()


if __name__ == "__main__":
    main()
