"""The fixed cost of a load: many small tensors, so the bytes are negligible and what is
timed is the per-tensor and per-chunk work around them.

For each ``--counts`` N and each ``--kinds`` state, one step is saved and then loaded
``--reps`` times with a warm page cache, interleaved with anchors on the same tensors:

* ``bag``: one stateful item holding N small fp32 tensors (16 to 1,024 elements);
* ``adam``: a model of N/3 small parameters and its Adam state after one step (each
  parameter's ``exp_avg``, ``exp_avg_sq`` and 0-d ``step``: about 4N/3 tensors in all), the
  many tensors of an LLM's optimizer.

Rows: ckpt's phases (``read_manifest``: read, parse and validate the manifest;
``load_step``: everything after it, without a thread pool and with one as ``ckpt.load``
makes; on a file system, chunks of less than 64 KiB on average are read on the calling
thread whatever the pool), ``ckpt.load`` (atomic, ``atomic=False``, and with the cyclic GC
paused around it: what the collector costs outside ``load_step``, which pauses it itself) and ``CheckpointManager.restore``, against ``torch.load(mmap=True)``
of the same state dicts followed by ``load_state_dict``, safetensors' ``load_file`` of the
same tensors followed by a copy into the live ones, and a raw read of ckpt's own data files.
Per-tensor microseconds are the median divided by the tensor count; the time spent in the
GC is measured with ``gc.callbacks``. ``--profile`` adds, per case, where one load spends
its time (cProfile of ``read_manifest`` + ``load_step`` without a pool, own time grouped by
module).

Run from the repository root::

    python benchmarks/bench_load_fixed.py [--counts 1000,10000] [--kinds bag,adam] [--reps 7]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import cProfile
import gc
import os
import pstats
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (puts the repository root on sys.path too)
import torch  # noqa: E402

import ckpt  # noqa: E402
from ckpt._format.gcpause import paused_gc  # noqa: E402
from ckpt._step.integrity import read_manifest  # noqa: E402
from ckpt._load.reader import load_step  # noqa: E402
from storage_backends import PosixStorage  # noqa: E402


class Bag:
    """A stateful item holding named tensors (``load_state_dict`` copies into them)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for k, v in sd.items():
            if v is not self.tensors[k]:
                self.tensors[k].copy_(v)


def make_state(kind: str, count: int, seed: int = 0) -> dict[str, Any]:
    """A live state of about ``count`` small tensors (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [16 << (i % 7) for i in range(count)]  # 16 .. 1024 elements
    if kind == "bag":
        return {"bag": Bag({f"t{i:06d}": torch.rand(n, generator=gen)
                            for i, n in enumerate(sizes)})}
    params = max(1, count // 3)
    model = torch.nn.Module()
    for i in range(params):
        model.register_parameter(f"p{i:06d}", torch.nn.Parameter(
            torch.rand(sizes[i], generator=gen)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.rand(p.shape, generator=gen)
    opt.step()
    return {"model": model, "optim": opt}


def item_state_dicts(state: dict[str, Any]) -> dict[str, Any]:
    return {name: obj.state_dict() for name, obj in state.items()}


def tensors_of(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The live tensors, flat, by a unique name (the safetensors anchor's destinations)."""
    flat = {}
    for name, sd in item_state_dicts(state).items():
        if name == "optim":
            for pid, s in sd["state"].items():
                for k, v in s.items():
                    flat[f"optim.{pid}.{k}"] = v
        else:
            flat.update({f"{name}.{k}": v for k, v in sd.items()})
    return flat


def raw_read(paths: list[str], buf: bytearray) -> None:
    """Every byte of ``paths``, one file after another, into a reused buffer."""
    view = memoryview(buf)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            size, pos = os.fstat(fd).st_size, 0
            while pos < size:
                n = os.preadv(fd, [view[:min(len(view), size - pos)]], pos)
                if n == 0:
                    raise EOFError(path)
                pos += n
        finally:
            os.close(fd)


class GCTimer:
    """Seconds spent in the cyclic garbage collector while ``active`` (gc.callbacks)."""

    def __init__(self) -> None:
        self.active, self.seconds, self._t0 = False, 0.0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if not self.active:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0


GC = GCTimer()


def timed(fn: Callable[[], Any]) -> Callable[[int], dict[str, float]]:
    def run(rep: int) -> dict[str, float]:
        GC.seconds, GC.active = 0.0, True
        try:
            with common.Stopwatch() as sw:
                fn()
        finally:
            GC.active = False
        return {"s": sw.seconds, "cpu": sw.cpu_seconds, "gc": GC.seconds}
    return run


def profile_load(storage: PosixStorage, state: dict[str, Any], top: int = 12) -> str:
    """Own time of one load (``read_manifest`` and ``load_step`` without a thread pool, so
    that every read runs in the profiled thread) grouped by module, then the costliest
    functions. The GC is paused (its collections would be charged to whichever function
    allocated last; the tables above give its share)."""
    prof = cProfile.Profile()
    with paused_gc():
        prof.runcall(lambda: load_step(storage, "one", read_manifest(storage, "one"), state))
    stats = pstats.Stats(prof)
    total = sum(v[2] for v in stats.stats.values())
    by_module: dict[str, float] = {}
    funcs = []
    for (file, line, func), (_, _, tt, ct, _) in stats.stats.items():
        mod = _module(file)
        by_module[mod] = by_module.get(mod, 0.0) + tt
        funcs.append((tt, ct, f"{mod}:{func}"))
    rows = [[m, f"{t * 1e3:.1f}", f"{t / total:.0%}"]
            for m, t in sorted(by_module.items(), key=lambda kv: -kv[1])[:top]]
    out = common.markdown_table(["module (own time)", "ms", "share"], rows)
    frows = [[name, f"{tt * 1e3:.1f}", f"{ct * 1e3:.1f}"]
             for tt, ct, name in sorted(funcs, reverse=True)[:top]]
    return (f"{out}\n\n{common.markdown_table(['function', 'own ms', 'cumulative ms'], frows)}"
            f"\n\n(cProfile adds its own overhead per call: {total * 1e3:.0f} ms profiled in all)")


def _module(file: str) -> str:
    for root in ("ckpt", "storage_backends"):
        marker = f"{os.sep}{root}{os.sep}"
        if marker in file:
            return root + "/" + file.split(marker, 1)[1]
    if file.startswith("~") or file.startswith("<"):
        return "builtins"
    if f"{os.sep}torch{os.sep}" in file:
        return "torch (Python)"
    return "other Python"


def measure(args: argparse.Namespace, base: str, kind: str, count: int) -> str:
    from safetensors.torch import load_file, save_file

    work = common.fresh_dir(os.path.join(base, f"{kind}-{count}"))
    state = make_state(kind, count)
    flat = tensors_of(state)
    ntensors = len(flat)
    nbytes = common.state_bytes(flat)
    one = os.path.join(work, "one")
    ckpt.save(state, one, step=1)
    root = os.path.join(work, "root")
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, state, force=True)
    torch_path = os.path.join(work, "state.pt")
    torch.save(item_state_dicts(state), torch_path)
    st_path = os.path.join(work, "state.safetensors")
    save_file({k: v.contiguous() for k, v in flat.items()}, st_path)
    storage = PosixStorage(work, create=False)
    manifest = read_manifest(storage, "one")
    paths = [os.path.join(one, f) for f in manifest.files]
    buf = bytearray(max(os.path.getsize(p) for p in paths))
    reader = ckpt.CheckpointManager(root, read_only=True)
    live = make_state(kind, count, seed=1)  # the destinations, other values
    live_flat = tensors_of(live)

    def torch_load() -> None:
        sds = torch.load(torch_path, mmap=True, weights_only=True)
        for name, obj in live.items():
            obj.load_state_dict(sds[name])

    def st_load() -> None:
        loaded = load_file(st_path)
        with torch.no_grad():
            for k, t in live_flat.items():
                t.copy_(loaded[k])

    pool = cf.ThreadPoolExecutor(ckpt.SaveOptions().write_threads)  # as ckpt.load's

    def paused_load() -> None:
        with paused_gc():
            ckpt.load(live, one)

    cases = [
        ("raw read of ckpt's files", timed(lambda: raw_read(paths, buf))),
        ("torch.load(mmap) + load_state_dict", timed(torch_load)),
        ("safetensors load_file + copy_", timed(st_load)),
        ("ckpt: read_manifest", timed(lambda: read_manifest(storage, "one"))),
        ("ckpt: load_step, no thread pool", timed(lambda: load_step(storage, "one", manifest,
                                                                    live))),
        (f"ckpt: load_step, pool of {pool._max_workers}",
         timed(lambda: load_step(storage, "one", manifest, live, pool=pool))),
        ("ckpt.load", timed(lambda: ckpt.load(live, one))),
        ("ckpt.load, GC paused around it", timed(paused_load)),
        ("ckpt.load(atomic=False)", timed(lambda: ckpt.load(live, one, atomic=False))),
        ("CheckpointManager.restore", timed(lambda: reader.restore(live, strict=True))),
    ]
    for _, fn in cases:  # warm every path (page cache, imports, first-call costs)
        fn(0)
    timings = common.run_interleaved(cases, args.reps, progress=f"{kind} {count}")
    reader.close()
    pool.shutdown()
    assert common.same_values(tensors_of(live), flat), "a load did not restore the state"
    rows = [common.Row(name, t["s"], t["cpu"]) for name, t in timings.items()]
    anchors = ["raw read of ckpt's files", "torch.load(mmap) + load_state_dict",
               "safetensors load_file + copy_"]
    table = common.time_table(rows, anchors)
    per = common.markdown_table(
        ["method", "µs per tensor", "of which in the GC (median ms)", "CPU s"],
        [[r.name, f"{r.median / ntensors * 1e6:.1f}",
          f"{common.median(timings[r.name]['gc']) * 1e3:.1f}",
          f"{common.median(r.cpu_seconds):.3f}"] for r in rows])
    out = (f"\n### {kind}: {ntensors} tensors, {nbytes / common.MiB:.1f} MiB, "
           f"{sum(len(e.chunks) for e in manifest.tensors.values())} chunks, "
           f"{len(paths)} data files, manifest {os.path.getsize(os.path.join(one, 'manifest.json')) / 1024:.0f} KiB; "
           f"warm page cache; median of {args.reps}, interleaved\n\n{table}\n\n{per}\n")
    if args.profile:
        out += (f"\n#### where one load spends its time ({kind}, {ntensors} tensors; "
                "read_manifest + load_step without a pool, GC paused)\n\n")
        out += profile_load(storage, live) + "\n"
    common.remove(work)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="1000,10000",
                        help="comma-separated tensor counts (default 1000,10000)")
    parser.add_argument("--kinds", default="bag,adam", help="bag, adam or both (default)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dir", default=common.DEFAULT_DIR)
    parser.add_argument("--profile", action="store_true",
                        help="also profile one ckpt.load per case (cProfile, by module)")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",") if c]
    kinds = [k for k in args.kinds.split(",") if k]
    base = common.fresh_dir(os.path.join(args.dir, "load_fixed"))
    print(f"machine: {common.machine_description()}; load {common.load_average()}; "
          f"code {common.code_version()}")
    try:
        for kind in kinds:
            for count in counts:
                print(measure(args, base, kind, count), flush=True)
    finally:
        common.remove(base)
    print(f"load average at the end: {common.load_average()}")


if __name__ == "__main__":
    main()
