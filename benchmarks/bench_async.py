"""What an asynchronous save costs the training loop: blocking time, memory, step slowdown.

Three measurements per state size and shape:

1. Blocking time of ``CheckpointManager(async_save=True).save()`` (the time the training
   loop waits), interleaved with the copy floor (``copy_`` of the same tensors into
   preallocated host buffers) and with DCP's ``torch.distributed.checkpoint.async_save``
   (single process, no process group). Each save is waited for, outside the timing, before
   the next one starts, so no save waits on the previous one (no backpressure). The first
   call is reported apart from the steady state (calls 2..N).
2. Peak extra host memory of ckpt (and of DCP, for reference) during saves: the resident set
   size sampled every millisecond minus the size before the manager existed, in a fresh
   child process per measurement so earlier allocations do not blur it.
3. Training step slowdown while the background writer runs: a CPU MLP forward/backward/SGD
   step timed with no save in flight, while ckpt's writer writes, and while a plain thread
   does a raw write+fsync of the same bytes (what any background write costs here).

Goals (reported, not asserted): steady blocking <= 1.3x the copy floor and <= 0.5x DCP
async_save; peak extra memory <= 1.1x the state size; step slowdown <= 10%.

Run from the repository root::

    python benchmarks/bench_async.py [--sizes 256M,1G] [--shapes many,few] [--reps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import warnings
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (puts the repository root on sys.path too)
import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import ckpt  # noqa: E402

State = dict[str, torch.Tensor]
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

COPY, CKPT, CKPT_INTERNAL, DCP = ("copy floor", "ckpt save()", "ckpt blocking_seconds",
                                  "DCP async_save")


def open_manager(root: str) -> ckpt.CheckpointManager:
    """An async manager keeping one step, so the benchmark does not fill the disk."""
    return ckpt.CheckpointManager(common.fresh_dir(root), async_save=True, keep_last=1,
                                  schedule=ckpt.Schedule(handle_sigterm=False))


# -- 1. blocking time -------------------------------------------------------------------------

def bench_blocking(size: int, shape: str, reps: int, workdir: str) -> str:
    state = common.make_state(size, shape)
    buffers = common.empty_like_state(state)
    manager = open_manager(os.path.join(workdir, "blocking-ckpt"))
    dcp_dir = os.path.join(workdir, "blocking-dcp")
    writes: dict[str, list[float]] = {CKPT: [], DCP: []}

    def copy_floor(rep: int) -> dict[str, float]:
        with common.Stopwatch() as sw:
            for key, t in state.items():
                buffers[key].copy_(t)
        return {"block": sw.seconds}

    def ckpt_save(rep: int) -> dict[str, float]:
        manager.wait()
        with common.Stopwatch() as sw:
            handle = manager.save(rep + 1, state)
        t0 = time.perf_counter()
        handle.wait()
        writes[CKPT].append(time.perf_counter() - t0)
        return {"block": sw.seconds, "internal": handle.blocking_seconds}

    def dcp_async_save(rep: int) -> dict[str, float]:
        path = os.path.join(dcp_dir, f"step-{rep}")
        with common.Stopwatch() as sw:
            future = dcp.async_save(state, checkpoint_id=path)
        t0 = time.perf_counter()
        future.result()
        writes[DCP].append(time.perf_counter() - t0)
        common.remove(dcp_dir)
        return {"block": sw.seconds}

    # One extra repetition: the first call of each method is reported on its own.
    label = f"blocking {common.format_size(size)}, {shape}"
    timings = common.run_interleaved(
        [(COPY, copy_floor), (CKPT, ckpt_save), (DCP, dcp_async_save)], reps + 1, progress=label)
    manager.close()
    common.remove(os.path.join(workdir, "blocking-ckpt"))

    # run_interleaved rotates the order, but each case's list is in repetition order.
    series = {COPY: timings[COPY]["block"], CKPT: timings[CKPT]["block"],
              CKPT_INTERNAL: timings[CKPT]["internal"], DCP: timings[DCP]["block"]}
    steady = {name: common.median(values[1:]) for name, values in series.items()}
    rows = []
    for name, values in series.items():
        rest = values[1:]
        background = writes.get(name)
        rows.append([
            name, f"{values[0] * 1e3:.1f}", f"{steady[name] * 1e3:.1f}",
            f"{min(rest) * 1e3:.1f}..{max(rest) * 1e3:.1f}",
            f"{steady[name] / steady[COPY]:.2f}", f"{steady[name] / steady[DCP]:.2f}",
            f"{common.median(background[1:]):.2f}" if background else "-",
        ])
    nbytes = common.state_bytes(state)
    return "\n".join([
        f"### Blocking time: {common.format_size(nbytes)} in {len(state)} tensors, "
        f"first call + {reps} steady-state calls", "",
        common.markdown_table(
            ["method", "first ms", "steady median ms", "steady min..max ms", "/ copy floor",
             "/ DCP", "background write s"], rows), "",
    ])


# -- 2. peak extra host memory (each probe runs in a fresh child process) --------------------

class PeakRSS:
    """Samples this process's resident set size every millisecond on a thread."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        return self._process.memory_info().rss

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.001)

    def reset(self) -> None:
        self.peak = self.rss()

    def __enter__(self) -> PeakRSS:
        self.reset()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def memory_probe(which: str, size: int, shape: str, saves: int, workdir: str) -> dict:
    """In a child process: peak RSS above the baseline during each of ``saves`` saves."""
    state = common.make_state(size, shape)
    root = os.path.join(workdir, f"memory-{which}")
    common.fresh_dir(root)
    peaks = []
    with PeakRSS() as sampler:
        baseline = sampler.rss()  # the state exists; nothing of the checkpointer yet
        manager = open_manager(root) if which == "ckpt" else None
        for i in range(saves):
            if which == "ckpt":
                manager.save(i + 1, state).wait()
            else:
                path = os.path.join(root, f"step-{i}")
                dcp.async_save(state, checkpoint_id=path).result()
                common.remove(path)
            time.sleep(0.005)  # let the sampler see the end of the save
            peaks.append(sampler.peak - baseline)
            sampler.reset()
        if manager is not None:
            manager.close()
    common.remove(root)
    return {"peaks": peaks, "state_bytes": common.state_bytes(state)}


def run_memory_probe(which: str, size: int, shape: str, saves: int, workdir: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-probe", which,
           "--sizes", str(size), "--shapes", shape, "--dir", workdir, "--reps", str(saves)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def bench_memory(size: int, shape: str, saves: int, workdir: str) -> str:
    rows = []
    for which, name in (("ckpt", "ckpt (async manager)"), ("dcp", "DCP async_save")):
        print(f"  [memory {common.format_size(size)}, {shape}] {which}", file=sys.stderr, flush=True)
        probe = run_memory_probe(which, size, shape, saves, workdir)
        peaks, nbytes = probe["peaks"], probe["state_bytes"]
        rows.append([name, f"{peaks[0] / common.MiB:.0f}", f"{peaks[0] / nbytes:.2f}",
                     f"{max(peaks[1:]) / common.MiB:.0f}", f"{max(peaks[1:]) / nbytes:.2f}"])
    return "\n".join([
        f"### Peak extra host memory (RSS above the process before any save): "
        f"{common.format_size(size)}, {shape}, {saves} saves", "",
        common.markdown_table(["checkpointer", "first save MiB", "x state",
                               f"saves 2..{saves} max MiB", "x state"], rows), "",
    ])


# -- 3. training step slowdown ---------------------------------------------------------------

class FakeTraining:
    """A CPU MLP (4 x Linear(1024, 1024) + ReLU, batch 64) trained with SGD."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(4):
            layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*layers)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(64, 1024)

    def step(self) -> float:
        """One step; returns its duration in seconds."""
        t0 = time.perf_counter()
        loss = self.model(self.x).square().mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


def steps_while(training: FakeTraining, busy: Callable[[], bool]) -> list[float]:
    """Durations of the steps that ran entirely while ``busy()`` stayed true."""
    times = []
    while busy():
        seconds = training.step()
        if busy():
            times.append(seconds)
    return times


def bench_step_slowdown(size: int, shape: str, reps: int, workdir: str, threads: int,
                        idle_steps: int = 20) -> list[list[str]]:
    """Rows (one per condition) for ``threads`` intra-op threads in the training step."""
    torch.set_num_threads(threads)
    state = common.make_state(size, shape)
    training = FakeTraining()
    for _ in range(5):  # warm up: allocator, kernels
        training.step()
    manager = open_manager(os.path.join(workdir, "step-ckpt"))
    raw_path = os.path.join(workdir, "step-raw")
    steps: dict[str, list[float]] = {"idle": [], "ckpt": [], "raw": []}

    def idle(rep: int) -> dict[str, float]:
        steps["idle"] += [training.step() for _ in range(idle_steps)]
        return {}

    def during_ckpt(rep: int) -> dict[str, float]:
        manager.wait()
        handle = manager.save(rep + 1, state)
        steps["ckpt"] += steps_while(training, lambda: not handle.done())
        handle.wait()
        return {}

    def during_raw(rep: int) -> dict[str, float]:
        writer = threading.Thread(target=common.raw_save, args=(state, raw_path))
        writer.start()
        steps["raw"] += steps_while(training, writer.is_alive)
        writer.join()
        common.remove(raw_path)
        return {}

    label = f"step {common.format_size(size)}, {shape}, {threads} threads"
    common.run_interleaved([("idle", idle), ("ckpt", during_ckpt), ("raw", during_raw)],
                           reps, progress=label)
    manager.close()
    common.remove(os.path.join(workdir, "step-ckpt"))

    base = common.median(steps["idle"])
    names = {"idle": "no save in flight",
             "ckpt": "ckpt writer running (default SaveOptions: threads chosen per save)",
             "raw": "raw write+fsync thread running (1 thread)"}
    rows = []
    for key, values in steps.items():
        if not values:
            rows.append([common.format_size(size), shape, str(threads), names[key], "-", "-", "0", "-"])
            continue
        m = common.median(values)
        rows.append([common.format_size(size), shape, str(threads), names[key], f"{m * 1e3:.1f}",
                     f"{min(values) * 1e3:.1f}..{max(values) * 1e3:.1f}", str(len(values)),
                     f"{(m / base - 1) * 100:+.1f}%"])
    return rows


# -- main ---------------------------------------------------------------------------------------

def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--skip", default="",
                        help="comma-separated parts to skip among blocking,memory,step")
    parser.add_argument("--memory-probe", choices=["ckpt", "dcp"], help=argparse.SUPPRESS)


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], default_reps=4, extra=add_options)
    if args.memory_probe:  # child process of bench_memory
        result = memory_probe(args.memory_probe, args.sizes[0], args.shapes[0], args.reps,
                              args.dir)
        print(json.dumps(result))
        return
    skip = set(args.skip.split(","))
    workdir = common.fresh_dir(os.path.join(args.dir, "async"))
    default_threads = torch.get_num_threads()
    print(f"Machine: {common.machine_description()}")
    print(f"Data directory: {common.describe_dir(workdir)}")
    print(f"ckpt code: commit {common.code_version()}")
    print(f"ckpt SaveOptions: {ckpt.SaveOptions()}")
    print("Ratios are time ratios (below 1 is faster).")
    print(f"Load average at start: {common.load_average()}")
    print()
    step_rows: list[list[str]] = []
    for size in args.sizes:
        for shape in args.shapes:
            if "blocking" not in skip:
                print(bench_blocking(size, shape, args.reps, workdir), flush=True)
            if "memory" not in skip:
                print(bench_memory(size, shape, max(3, args.reps), workdir), flush=True)
            if "step" not in skip:
                for threads in sorted({default_threads, max(1, default_threads - 1)}, reverse=True):
                    step_rows += bench_step_slowdown(size, shape, args.reps, workdir, threads)
                torch.set_num_threads(default_threads)
    if step_rows:
        print(f"### Training step while a save is written ({FakeTraining.__doc__.strip()}), "
              f"{args.reps} reps interleaved\n")
        print(common.markdown_table(
            ["state", "shape", "step threads", "condition", "median step ms", "min..max ms",
             "steps", "slowdown"], step_rows))
        print()
    print(f"Load average at end: {common.load_average()}")
    print(common.GATE.summary())
    common.remove(workdir)


if __name__ == "__main__":
    main()
