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
    """The CPUs this process may use: its affinity mask (a container's or ``taskset``'s
    cpuset), else the machine's count, and no more than its cgroup's CPU quota allows
    (``docker --cpus``, a Kubernetes CPU limit: the mask still lists every core of the
    host, the quota throttles the process to a few)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cpu_quota()
    return cores if quota is None else max(1, min(cores, int(quota)))


def cpu_quota(proc: str = "/proc/self") -> float | None:
    """CPUs per second the cgroup CPU quota gives the process ``proc``: the lowest on the
    way from its cgroup up to the hierarchy's root (a parent's limit binds its children),
    cgroup v2's ``cpu.max`` or v1's ``cpu.cfs_quota_us``/``cpu.cfs_period_us``. None
    without a quota, or where the files cannot be read (not Linux, no cgroup mounted)."""
    try:
        with open(f"{proc}/cgroup") as f:
            groups = [line.rstrip("\n").split(":", 2) for line in f]
        with open(f"{proc}/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    lowest = None
    for fields in mounts:
        if "-" not in fields or len(fields) < 5:
            continue
        dash = fields.index("-")
        root, where = fields[3], fields[4]
        kind = fields[dash + 1] if dash + 1 < len(fields) else ""
        options = fields[dash + 3].split(",") if dash + 3 < len(fields) else []
        if kind == "cgroup2":
            path = next((g[2] for g in groups if len(g) == 3 and g[0] == "0"), None)
        elif kind == "cgroup" and "cpu" in options:
            path = next((g[2] for g in groups
                         if len(g) == 3 and "cpu" in g[1].split(",")), None)
        else:
            continue
        if path is None:
            continue
        # The cgroup's path is relative to the namespace's root, the mount's to its own.
        relative = os.path.relpath(path, root) if root != "/" else path.lstrip("/")
        if relative.startswith(".."):
            continue  # this mount does not show the process's cgroup
        here = os.path.normpath(os.path.join(where, relative))
        while True:
            quota = _quota_in(here, v2=kind == "cgroup2")
            if quota is not None and (lowest is None or quota < lowest):
                lowest = quota
            if here == os.path.normpath(where):
                break
            here = os.path.dirname(here)
    return lowest


def _quota_in(directory: str, *, v2: bool) -> float | None:
    """The CPU quota set in one cgroup directory (CPUs), None without one."""
    try:
        if v2:
            with open(os.path.join(directory, "cpu.max")) as f:
                quota, period = f.read().split()[:2]
        else:
            with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
                quota = f.read().strip()
            with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
                period = f.read().strip()
        if quota in ("max", "-1"):
            return None
        q, p = int(quota), int(period)
    except (OSError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None


def writer_threads(options: SaveOptions, *, from_gpu: bool, requests: bool = False) -> int:
    """Threads writing one save's files: ``options.write_threads`` when set explicitly;
    otherwise the cores training leaves free (at least 1, at most the default's count);
    for a save staged from a GPU (training runs on the device) every core the process may
    use (:func:`cores_available`, at most the default's count); the default's count for
    an object store (``requests``: every write a request, and threads overlap their
    latency rather than compete for cores)."""
    most = options.write_threads
    if not chosen_threads(most) or requests:
        return most
    if from_gpu:  # every core the process may use (the default counts the machine's)
        return max(1, min(most, cores_available()))
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
