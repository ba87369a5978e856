"""Compression that keeps up with the storage: zstd levels and threads, and saves to a throttled disk.

Two tables. The codec alone: compression ratio and speed of one chunk at several zstd levels,
with and without zstd's own worker threads, on weights as training leaves them (normal,
std 0.02) in fp32 and bf16 (and level 1 with zstd's own match finder, which ckpt cuts down
for byte-grouped floats). Then whole saves (synchronous, fsynced) to storage throttled to a
given write bandwidth, the uncompressed save as the anchor, interleaved. The goal (reported,
not asserted): a compressed save >= 0.8x the uncompressed one when storage writes <= 0.5 GB/s.
The throttled storage lives in memory (/dev/shm where it exists, else --dir), so the throttle,
not this machine's own disk, is the storage's speed.

Run from the repository root::

    python benchmarks/bench_compression.py [--sizes 256M] [--reps 3] [--rates 0.5,0.25]
"""

from __future__ import annotations

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (puts the repository root on sys.path too)
import numpy as np  # noqa: E402
import torch  # noqa: E402
import zstandard  # noqa: E402

import ckpt  # noqa: E402
from ckpt._format.codec import encode  # noqa: E402
from ckpt._shared.buffers import byte_view  # noqa: E402
from storage_backends import PosixStorage  # noqa: E402

LEVELS = [-3, -1, 1, 3]


class ThrottledStorage(PosixStorage):
    """POSIX storage whose writes, all threads together, run at most ``rate`` bytes/s
    (a disk or network share slower than this machine's)."""

    def __init__(self, root: str, rate: float) -> None:
        super().__init__(root)
        self.rate = rate
        self._lock = threading.Lock()
        self._free_at = time.monotonic()

    def write(self, path, buffers):
        size = super().write(path, buffers)
        with self._lock:
            self._free_at = max(self._free_at, time.monotonic()) + size / self.rate
            wait = self._free_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        return size


def weights(nbytes: int, dtype: torch.dtype, count: int = 16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    rows = nbytes // (count * common.COLUMNS * dtype.itemsize)
    return {f"layer{i:03d}.weight": (torch.randn((rows, common.COLUMNS), generator=gen) * 0.02
                                     ).to(dtype) for i in range(count)}


def codec_table(reps: int) -> str:
    threads = [0, os.cpu_count() or 1]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        chunk = next(iter(weights(8 << 20, dtype, count=1).values()))
        data = byte_view(chunk)
        for level in LEVELS:
            for t in threads:
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    _, out = encode(data, dtype, level, t)
                    times.append(time.perf_counter() - t0)
                seconds = common.median(times)
                rows.append([str(dtype).removeprefix("torch."), str(level), str(t),
                             f"{len(data) / len(out):.3f}",
                             f"{common.gbps(len(data), seconds):.2f}"])
        # level 1 on grouped floats with zstd's own match finder, beside ckpt's cheaper one
        grouped = np.frombuffer(data, np.uint8).reshape(-1, dtype.itemsize).T.tobytes()
        plain = zstandard.ZstdCompressor(level=1)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = plain.compress(grouped)
            times.append(time.perf_counter() - t0)
        rows.append([str(dtype).removeprefix("torch."), "1, zstd's own match finder", "0",
                     f"{len(data) / len(out):.3f}",
                     f"{common.gbps(len(data), common.median(times)):.2f}"])
    return common.markdown_table(
        ["dtype", "level", "zstd threads", "ratio", "compress GB/s (of raw bytes)"], rows)


def save_table(size: int, rate: float, reps: int, workdir: str, configs) -> str:
    state = weights(size, torch.bfloat16)
    nbytes = common.state_bytes(state)

    def case_for(name: str, options: ckpt.SaveOptions):
        def case(rep: int) -> dict[str, float]:
            root = common.fresh_dir(os.path.join(workdir, "root"))
            storage = ThrottledStorage(root, rate * 1e9)
            with ckpt.CheckpointManager(storage, async_save=False, options=options, metrics=False,
                                        schedule=ckpt.Schedule(handle_sigterm=False)) as mgr:
                with common.Stopwatch() as sw:
                    mgr.save(1, state)
            written = sum(os.path.getsize(os.path.join(root, "step-00000001", f))
                          for f in os.listdir(os.path.join(root, "step-00000001")))
            common.remove(root)
            return {"save": sw.seconds, "cpu": sw.cpu_seconds, "bytes": written}
        return name, case

    cases = [case_for(name, options) for name, options in configs]
    timings = common.run_interleaved(cases, reps, progress=f"{rate} GB/s")
    rows = [common.Row(name, timings[name]["save"], timings[name]["cpu"]) for name, _ in configs]
    table = common.throughput_table(rows, nbytes, anchors=[configs[0][0]])
    sizes = ", ".join(f"{name}: {common.median(timings[name]['bytes']) / common.MiB:.0f} MiB"
                      for name, _ in configs)
    return (f"### Save of {common.format_size(nbytes)} bf16 weights to storage throttled to "
            f"{rate} GB/s, {reps} reps\n\n{table}\n\nBytes stored: {sizes}\n")


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], default_reps=3, extra=lambda p: p.add_argument(
        "--rates", default="0.5,0.25", help="throttled write bandwidths in GB/s"))
    base_dir = "/dev/shm" if os.path.isdir("/dev/shm") else args.dir
    workdir = common.fresh_dir(os.path.join(base_dir, f"ckpt-bench-compression-{os.getpid()}"))
    cpus = os.cpu_count() or 1
    base = ckpt.SaveOptions()
    configs = [("uncompressed", base)]
    for level, threads in ((1, 0), (1, cpus), (-1, 0), (3, 0)):  # 1 is the default
        configs.append((f"zstd level {level}, {threads} threads",
                        ckpt.SaveOptions(compression="zstd", compression_level=level,
                                         compression_threads=threads)))
    print(f"Machine: {common.machine_description()}")
    print(f"Throttled storage in: {common.describe_dir(workdir)}")
    print(f"ckpt code: commit {common.code_version()}")
    print(f"Load average at start: {common.load_average()}\n")
    print("### zstd on one 8 MiB chunk of weights (normal, std 0.02), median of "
          f"{max(3, args.reps)}\n")
    print(codec_table(max(3, args.reps)) + "\n", flush=True)
    for size in args.sizes:
        for rate in (float(r) for r in args.rates.split(",") if r):
            print(save_table(size, rate, args.reps, workdir, configs), flush=True)
    print(f"Load average at end: {common.load_average()}")
    print(common.GATE.summary())
    common.remove(workdir)


if __name__ == "__main__":
    main()
