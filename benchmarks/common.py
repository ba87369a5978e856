"""Shared helpers for the benchmark scripts: synthetic states, interleaved timing, tables.

Benchmarks here print tables; they never assert on timings. The disk and the page cache of
a shared machine are noisy, so every comparison is made inside one run: the methods being
compared are run interleaved (A B C A B C ...), each repetition starting with the next
method in turn, and medians over the repetitions are reported together with the spread.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402  (after the sys.path fix, like the scripts that import ckpt)

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_DIR = os.path.join(REPO_ROOT, "bench-out")
COLUMNS = 1024  # every synthetic tensor is (rows, 1024) fp32: 4 KiB per row
SHAPES = {"many": 256, "few": 4}  # shape name -> number of tensors


# -- arguments --------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """``"256M"`` -> 268435456; accepts K, M, G suffixes (binary) or plain bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1 << 10, "M": MiB, "G": GiB}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def format_size(nbytes: int) -> str:
    if nbytes % GiB == 0:
        return f"{nbytes // GiB} GiB"
    return f"{nbytes / MiB:g} MiB"


def parse_args(description: str, default_reps: int,
               extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The options every benchmark takes: ``--sizes``, ``--shapes``, ``--reps``, ``--dir``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--sizes", default="256M,1G",
                        help="comma-separated total state sizes (default: 256M,1G)")
    parser.add_argument("--shapes", default="many,few",
                        help=f"comma-separated state shapes among {sorted(SHAPES)} "
                             f"(many: {SHAPES['many']} tensors, few: {SHAPES['few']})")
    parser.add_argument("--reps", type=int, default=default_reps,
                        help=f"repetitions per method (default: {default_reps})")
    parser.add_argument("--dir", default=DEFAULT_DIR,
                        help="where to write (default: bench-out/ in the repo, same disk)")
    parser.add_argument("--quiet-wait", type=float, default=5.0,
                        help="before each timed case, wait up to this many seconds for other "
                             "processes to leave the CPUs idle (0: do not wait; default: 5)")
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    args.shapes = [s for s in args.shapes.split(",") if s]
    for s in args.shapes:
        if s not in SHAPES:
            parser.error(f"unknown shape {s!r}; choose among {sorted(SHAPES)}")
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    GATE.max_wait = args.quiet_wait
    return args


# -- states -----------------------------------------------------------------------------------

def make_state(total_bytes: int, shape: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A dict of fp32 tensors of ``total_bytes`` in all, ``SHAPES[shape]`` tensors of
    (rows, 1024) each, filled with random values (so nothing is compressible or all-zero)."""
    count = SHAPES[shape]
    rows = total_bytes // (count * COLUMNS * 4)
    if rows < 1:
        raise ValueError(f"{format_size(total_bytes)} is too small for {count} tensors")
    gen = torch.Generator().manual_seed(seed)
    return {f"layer{i:03d}.weight": torch.rand((rows, COLUMNS), generator=gen)
            for i in range(count)}


def empty_like_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Preallocated destinations, written once so their pages are resident (no page faults
    inside a timed region)."""
    return {k: torch.zeros_like(v) for k, v in state.items()}


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def same_values(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- files and caches -------------------------------------------------------------------------

def fresh_dir(path: str) -> str:
    """An empty directory at ``path`` (what was there is removed)."""
    remove(path)
    os.makedirs(path)
    return path


def remove(path: str) -> None:
    """Remove a file or directory tree; a missing path is fine."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def fsync_path(path: str) -> None:
    """fsync a file that another library wrote and closed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_page_cache() -> bool:
    """``sync`` and drop the page cache (needs root); False when that is not allowed.

    Pages still mapped by a live process are not dropped, so drop references to loaded
    (possibly mmap-backed) tensors before calling this.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def raw_save(state: dict[str, torch.Tensor], path: str) -> None:
    """The floor: every tensor's bytes written back to back into one file, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in state.values():
            view = byte_view(t)
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_load(dest: dict[str, torch.Tensor], path: str) -> None:
    """The floor: the same bytes read back, in order, straight into the destinations."""
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        for t in dest.values():
            view = byte_view(t)
            while view:
                n = os.preadv(fd, [view], offset)
                if n == 0:
                    raise EOFError(path)
                offset += n
                view = view[n:]
    finally:
        os.close(fd)


def split_by_bytes(state: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """``state`` cut, in order, into at most ``parts`` dicts of about equal bytes."""
    target = state_bytes(state) / parts
    groups: list[dict[str, torch.Tensor]] = [{}]
    filled = 0
    for key, t in state.items():
        if groups[-1] and filled >= target * len(groups) and len(groups) < parts:
            groups.append({})
        groups[-1][key] = t
        filled += t.numel() * t.element_size()
    return groups


def raw_save_parallel(state: dict[str, torch.Tensor], path: str, threads: int = 2) -> None:
    """The disk's floor with as many streams as ckpt uses: ``threads`` files in the
    directory ``path``, each written by its own thread and fsynced."""
    os.makedirs(path)
    groups = split_by_bytes(state, threads)
    with ThreadPoolExecutor(len(groups)) as pool:
        list(pool.map(raw_save, groups, [os.path.join(path, str(i)) for i in range(len(groups))]))


def raw_load_parallel(dest: dict[str, torch.Tensor], path: str, threads: int = 2) -> None:
    """Read what :func:`raw_save_parallel` wrote, one thread per file."""
    groups = split_by_bytes(dest, threads)
    with ThreadPoolExecutor(len(groups)) as pool:
        list(pool.map(raw_load, groups, [os.path.join(path, str(i)) for i in range(len(groups))]))


class PeakMemory:
    """``with PeakMemory() as m: ...`` then ``m.extra_bytes``: how far this process's peak
    resident memory rose above what it held at the start (Linux: the peak is reset by
    writing 5 to /proc/self/clear_refs; None where that is not possible). Page cache is not
    resident memory of the process, so a load's extra buffers are what this counts."""

    def __enter__(self) -> PeakMemory:
        self.extra_bytes: int | None = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5\n")
            self._start = _status_kib("VmRSS")
        except OSError:
            self._start = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._start is not None:
            self.extra_bytes = max(0, _status_kib("VmHWM") - self._start) * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


# -- timing -----------------------------------------------------------------------------------

Timings = dict[str, dict[str, list[float]]]  # case -> metric -> seconds, one per repetition


def cpu_busy_fraction(interval: float = 0.5) -> float:
    """The fraction of all CPUs' time spent not idle (any process, iowait counted as busy)
    over the next ``interval`` seconds, from /proc/stat; 0.0 where that is unreadable."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
        return sum(fields), fields[3]  # total, idle

    try:
        total0, idle0 = sample()
        time.sleep(interval)
        total1, idle1 = sample()
    except (OSError, ValueError):
        return 0.0
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


class QuietGate:
    """Waits before each timed case until other processes leave the CPUs idle.

    The machine may be shared (other jobs' tests compete for 2 cores and one disk); a case
    timed while they run measures them as much as us. Between cases this process is idle,
    so the busy fraction seen then is someone else's. Waits at most ``max_wait`` seconds,
    then runs anyway and counts the case as contended.
    """

    def __init__(self, max_wait: float, threshold: float = 0.15) -> None:
        self.max_wait = max_wait
        self.threshold = threshold
        self.cases = 0
        self.contended = 0
        self.waited = 0.0

    def wait(self) -> None:
        if self.max_wait <= 0:
            return
        self.cases += 1
        t0 = time.perf_counter()
        while cpu_busy_fraction() > self.threshold:
            if time.perf_counter() - t0 > self.max_wait:
                self.contended += 1
                break
        self.waited += time.perf_counter() - t0

    def summary(self) -> str:
        if self.max_wait <= 0:
            return "Quiet gate: off (cases started whatever else ran)."
        return (f"Quiet gate: before each case waited until other processes used <"
                f"{self.threshold:.0%} CPU (at most {self.max_wait:g} s; {self.waited:.0f} s "
                f"waited in all); {self.contended} of {self.cases} cases started while busy.")


GATE = QuietGate(max_wait=0)  # parse_args sets it from --quiet-wait


def run_interleaved(cases: Sequence[tuple[str, Callable[[int], dict[str, float]]]],
                    reps: int, progress: str = "") -> Timings:
    """Run every case once per repetition, interleaved; repetition ``r`` starts with case
    ``r % len(cases)``, and every other repetition runs the cases in reverse order, so that
    no case always runs first, nor always right after the same case (whose after-effects,
    such as the page cache it left dirty, would then always fall on it).

    A case is ``fn(rep) -> {metric: seconds}``: it times its own region, so setup and
    cleanup (dropping caches, removing files) stay outside the timed part. Each case starts
    once the machine is quiet (see :class:`QuietGate`).
    """
    out: Timings = {name: {} for name, _ in cases}
    for rep in range(reps):
        order = [cases[(rep + i) % len(cases)] for i in range(len(cases))]
        if rep % 2:
            order.reverse()
        for name, fn in order:
            if progress:
                print(f"  [{progress}] rep {rep + 1}/{reps}: {name}", file=sys.stderr, flush=True)
            GATE.wait()
            for metric, seconds in fn(rep).items():
                out[name].setdefault(metric, []).append(seconds)
    return out


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.seconds`` (wall) and ``sw.cpu_seconds``
    (user + system time of every thread of this process: what CPU contention multiplies)."""

    def __enter__(self) -> Stopwatch:
        self._cpu0 = time.process_time()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.cpu_seconds = time.process_time() - self._cpu0


# -- tables -----------------------------------------------------------------------------------

@dataclass
class Row:
    """One method's repetitions of one metric."""

    name: str
    seconds: list[float]
    cpu_seconds: list[float] | None = None

    @property
    def median(self) -> float:
        return median(self.seconds)


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB/s (1e9 bytes per second), as disk vendors and `dd` report."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join(lines)


def throughput_table(rows: Sequence[Row], nbytes: int, anchors: Sequence[str]) -> str:
    """Median seconds, spread, GB/s, throughput ratio (method / anchor, >1 is faster)
    against each anchor row (named in ``anchors``) and median CPU seconds when measured."""
    by_name = {r.name: r for r in rows}
    headers = ["method", "median s", "min..max s", "GB/s"] + [f"x {a}" for a in anchors]
    with_cpu = any(r.cpu_seconds for r in rows)
    if with_cpu:
        headers.append("CPU s")
    body = []
    for r in rows:
        cells = [r.name, f"{r.median:.3f}", f"{min(r.seconds):.3f}..{max(r.seconds):.3f}",
                 f"{gbps(nbytes, r.median):.2f}"]
        cells += [f"{by_name[a].median / r.median:.2f}" for a in anchors]
        if with_cpu:
            cells.append(f"{median(r.cpu_seconds):.2f}" if r.cpu_seconds else "-")
        body.append(cells)
    return markdown_table(headers, body)


def time_table(rows: Sequence[Row], anchors: Sequence[str], unit: str = "ms") -> str:
    """Median time, spread and time ratio (method / anchor, <1 is faster) per anchor."""
    scale = {"s": 1.0, "ms": 1e3}[unit]
    by_name = {r.name: r for r in rows}
    headers = ["method", f"median {unit}", f"min..max {unit}", "n"] + [f"/ {a}" for a in anchors]
    body = []
    for r in rows:
        cells = [r.name, f"{r.median * scale:.1f}",
                 f"{min(r.seconds) * scale:.1f}..{max(r.seconds) * scale:.1f}", str(len(r.seconds))]
        cells += [f"{r.median / by_name[a].median:.2f}" for a in anchors]
        body.append(cells)
    return markdown_table(headers, body)


def machine_description() -> str:
    """One line about where this ran (CPU count, memory, torch, Python)."""
    try:
        with open("/proc/meminfo") as f:
            mem_kib = int(f.readline().split()[1])
        mem = f"{mem_kib / (1 << 20):.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        mem = "unknown RAM"
    return (f"{platform.machine()}, {os.cpu_count()} CPUs, {mem}, torch {torch.__version__} "
            f"({torch.get_num_threads()} intra-op threads), Python {platform.python_version()}")


def describe_dir(path: str) -> str:
    """Where data goes, without this machine's paths: the file system type and whether it
    is the repository's own bench-out/ (the default) or a directory given with --dir."""
    where = "bench-out/ in the repository" if os.path.abspath(path).startswith(
        os.path.abspath(DEFAULT_DIR)) else "a directory given with --dir"
    fstype = "unknown"
    try:
        best = ""
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if os.path.abspath(path).startswith(parts[1]) and len(parts[1]) > len(best):
                    best, fstype = parts[1], parts[2]
    except OSError:
        pass
    return f"{where} (file system: {fstype})"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (other processes compete for CPU and disk)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


CODE_DIRS = ("ckpt", "storage_backends", "benchmarks", "trainer", "verify")


def code_version() -> str:
    """The commit of the code measured, and whether the code (CODE_DIRS) differs from it
    (so a table can be tied to the code that produced it)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                *CODE_DIRS],
                               cwd=REPO_ROOT, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head}{' + uncommitted changes in ' + ', '.join(CODE_DIRS) if dirty else ''}"
