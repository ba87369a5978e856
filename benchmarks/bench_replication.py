"""Peer replication of the memory tier: how long one rank step takes to reach a peer's
receiver (two ``Replicator``s of this process on loopback, through the handshake, the header
and the data, until the receiver has published the replica and acknowledged it).

    python benchmarks/bench_replication.py [--sizes 256MiB,1GiB] [--reps 5] [--dir /dev/shm]

With ``--restore``: the restore from replicas of a replaced node's ranks (world 4 on gloo,
two "nodes" of two ranks, a DDP state in memory only; node B lost, node C's two ranks fetch
it from node A's replicas), each replicated byte fetched once per node (``cooperative.MODE =
"always"``, the default across hosts) against every rank fetching its own (``"never"``, the
default on one host), interleaved. A restore's time
is its slowest rank's; its CPU time is summed over the ranks (every thread of each process:
steadier than the wall time on a loaded machine); the bytes the holders served are counted
where they leave.

    python benchmarks/bench_replication.py --restore [--sizes 64MiB,256MiB] [--reps 5]

Prints medians and ratios (and the spread); never asserts on timings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from ckpt._memory.replication import Replicator  # noqa: E402

MiB = 1 << 20


def _size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * scale)
    return int(text)


def restore_table(sizes: list[int], reps: int, where: str) -> None:
    """Restore from replicas, shared per node against fetched per rank (see the docstring)."""
    from tests.support.peer_shared_workers import plain_then_shared
    from tests.support.ranks import run_ranks

    print("| state | per rank: median s | shared: median s | shared / per rank | "
          "CPU s, all ranks: per rank | shared | served per rank (x state) | "
          "served shared (x state) | spread s (per rank; shared) |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for size in sizes:
        base = tempfile.mkdtemp(prefix="bench-shared-restore-", dir=where)
        os.chmod(base, 0o700)
        try:
            shm = os.path.join(base, "shm")
            os.mkdir(shm)
            ranks = run_ranks(4, plain_then_shared, os.path.join(base, "root"), shm,
                              size // MiB, reps, timeout=3600)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        state = ranks[0][0]["state"]
        times: dict[str, list[float]] = {"never": [], "always": []}
        served: dict[str, list[float]] = {"never": [], "always": []}
        cpu: dict[str, list[float]] = {"never": [], "always": []}
        for i, run in enumerate(ranks[0]):
            times[run["mode"]].append(max(r[i]["seconds"] for r in ranks))
            cpu[run["mode"]].append(sum(r[i]["cpu"] for r in ranks))
            served[run["mode"]].append(sum(r[i]["served"] for r in ranks) / state)
            assert all(r[i]["exact"] and r[i]["step"] == 1 for r in ranks)
        plain, shared = (statistics.median(times[m]) for m in ("never", "always"))
        print(f"| {size / MiB:.0f} MiB | {plain:.3f} | {shared:.3f} | {shared / plain:.2f} | "
              f"{statistics.median(cpu['never']):.2f} | {statistics.median(cpu['always']):.2f} | "
              f"{statistics.median(served['never']):.2f} | "
              f"{statistics.median(served['always']):.2f} | "
              f"{min(times['never']):.3f}-{max(times['never']):.3f}; "
              f"{min(times['always']):.3f}-{max(times['always']):.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--restore", action="store_true",
                    help="restore from replicas: shared per node against per rank")
    args = ap.parse_args()
    if args.restore:
        restore_table(list(map(_size, (args.sizes or "64MiB,256MiB").split(","))), args.reps,
                      args.dir)
        return
    args.sizes = args.sizes or "256MiB,1GiB"
    base = tempfile.mkdtemp(prefix="bench-replication-", dir=args.dir)
    os.chmod(base, 0o700)
    try:
        print("| step size | median s | GB/s | spread s |\n| --- | --- | --- | --- |")
        for size in map(_size, args.sizes.split(",")):
            src, dst, own = (os.path.join(base, n) for n in ("src", "dst", "own"))
            for d in (src, dst, own):
                os.makedirs(d, mode=0o700, exist_ok=True)
            step = os.path.join(src, "step-00000001")
            os.makedirs(step, mode=0o700, exist_ok=True)
            with open(os.path.join(step, "data-0"), "wb") as f:
                for _ in range(size // MiB):
                    f.write(os.urandom(MiB))
            with open(os.path.join(step, "rank.json"), "w") as f:
                json.dump({"step": 1, "rank": 0}, f)
            receiver = Replicator(shm_dir=dst, job="bench", node="b", keep=1)
            sender = Replicator(shm_dir=own, job="bench", node="a", keep=1)
            key = os.urandom(32).hex()
            receiver.connect([], key)
            sender.connect([receiver.address], key)
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                sender.submit(1, step, 0)
                assert sender.drain(600)
                times.append(time.perf_counter() - t0)
            sender.close()
            receiver.close()
            med = statistics.median(times)
            print(f"| {size / MiB:.0f} MiB | {med:.3f} | {size / med / 1e9:.2f} | "
                  f"{min(times):.3f}-{max(times):.3f} |")
            shutil.rmtree(src)
            shutil.rmtree(dst)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
