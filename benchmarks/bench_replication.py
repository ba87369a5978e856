"""Peer replication of the memory tier: how long one rank step takes to reach a peer's
receiver (two ``Replicator``s of this process on loopback, through the handshake, the header
and the data, until the receiver has published the replica and acknowledged it).

    python benchmarks/bench_replication.py [--sizes 256MiB,1GiB] [--reps 5] [--dir /dev/shm]

Prints the median time and rate per size (and the spread); never asserts on timings.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256MiB,1GiB")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm")
    args = ap.parse_args()
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
