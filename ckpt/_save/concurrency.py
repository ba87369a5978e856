"""How many threads write a save in the background, and at what priority beside training.

A background save shares the CPUs with the training loop. Writer threads that take cores
training uses make the steps after a save slower; too few make the write (and the time it
competes at all) longer. The policy: with the default ``SaveOptions.write_threads``, a save
of CPU tensors gets one writer thread per core that training leaves free (the cores this
process may run on, minus torch's intra-op threads), at least one; a save staged from a GPU
(training runs on the device, the cores are free) or written to an object store (the threads
wait on requests more than they compute) gets them all. An explicit
``write_threads=N`` is used as given. Writer threads also run at a lower scheduling priority
(``SaveOptions.writer_nice``) so that, on a contended core, training's threads run first and
the write takes the time they leave.

Who reaches this: only the program, through ``SaveOptions`` (validated when made). It reads
the process's own affinity mask and torch's thread count, and only ever raises the nice value
of ckpt's own threads, which any process may do; it never lowers one (that needs privilege).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import torch

from ckpt.options import SaveOptions, chosen_threads

log = logging.getLogger("ckpt")


def cores_available() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. a container's or
    ``taskset``'s cpuset), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def writer_threads(options: SaveOptions, *, from_gpu: bool, requests: bool = False) -> int:
    """Threads writing one save's files: ``options.write_threads`` when set explicitly;
    otherwise the cores training leaves free (at least 1, at most the default's count), or
    the default's count when the cores are not what limits the write: a save staged from a
    GPU (training runs on the device) or to an object store (``requests``: every write a
    request, and threads overlap their latency rather than compete for cores)."""
    most = options.write_threads
    if not chosen_threads(most) or from_gpu or requests:
        return most
    spare = cores_available() - torch.get_num_threads()
    return max(1, min(most, spare))


def niced(nice: int) -> int | None:
    """The nice value writer threads take: the calling (training) thread's plus ``nice``,
    at most 19; None where nothing changes (``nice`` 0, or not Linux: elsewhere
    ``setpriority(PRIO_PROCESS, id)`` may name a process, not a thread)."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return None
    return min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + nice)


def lower_priority(value: int | None) -> None:
    """Give the calling thread the nice value ``value`` (from :func:`niced`) unless it is
    already that low in priority. Absolute, not relative: a pool's threads start from the
    thread that submits to it, and inherit that thread's value."""
    if value is None:
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < value:
            os.setpriority(os.PRIO_PROCESS, tid, value)
    except OSError as e:  # a sandbox without setpriority: the write runs at training's
        log.debug("writer thread keeps its priority: %s", e)
