"""The threads of a save's blocking copy: the calling thread and a few helpers, as many as
torch computes with (as its own ``copy_`` uses), each taking the next job as it finishes one.

The jobs are copies and digests of host memory, which release the GIL; a pool is kept
between saves (starting threads at every save would cost more than small copies), and a
forked child, which has none of its parent's threads, makes its own.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from typing import Any, Callable

MAX_THREADS = 8  # copying threads at most: more only contend for the memory bus

Workers = Callable[[int], "cf.Executor | None"]


class HelperThreads:
    """A pool of helper threads, kept between saves, made again in a forked child."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pool: cf.ThreadPoolExecutor | None = None
        self._size, self._pid = 0, os.getpid()  # its size, the process it runs in

    def __call__(self, n: int) -> cf.Executor:
        """A pool of at least ``n`` threads."""
        if self._pool is None or self._size < n or self._pid != os.getpid():
            if self._pool is not None and self._pid == os.getpid():
                self._pool.shutdown(wait=False)
            self._pool = cf.ThreadPoolExecutor(n, thread_name_prefix=self.name)
            self._size, self._pid = n, os.getpid()
        return self._pool

    def close(self) -> None:
        if self._pool is not None and self._pid == os.getpid():
            self._pool.shutdown(wait=False)
        self._pool = None


def run_jobs(jobs: list, small: list, do: Callable[[Any], None], threads: int,
             workers: Workers) -> None:
    """``do(job)`` for every job of ``jobs``, on this thread and ``threads - 1`` of
    ``workers(threads - 1)``, each taking the next job as it finishes one, then for every
    job of ``small`` on this thread only: a small job's work is mostly Python, which holds
    the GIL, and threads taking turns at it are slower than one thread alone."""
    threads = max(1, min(threads, MAX_THREADS, len(jobs)))
    lock, it = threading.Lock(), iter(jobs)

    def drain() -> None:
        while True:
            with lock:
                job = next(it, None)
            if job is None:
                return
            do(job)

    pool = workers(threads - 1) if threads > 1 else None
    helpers = [pool.submit(drain) for _ in range(threads - 1)] if pool is not None else []
    try:
        drain()
        for job in small:
            do(job)
    finally:
        for f in helpers:
            f.result()
