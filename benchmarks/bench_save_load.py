"""Synchronous save and load throughput of ckpt against raw I/O and other checkpointers.

For each state size and shape, every method saves the same state and loads it back, once per
repetition, interleaved with the others. Saves are durable for every method (data fsynced
before the clock stops). Before every save and every load the page cache is dropped when the
process may (root), so loads read from the disk ("cold"); the output says which it was.

Two raw anchors: one file written (read) by one thread, as the goals are stated, and as many
files and threads as ckpt uses (``SaveOptions().write_threads``), the disk's floor for
parallel streams. A third for loads, "raw, read twice": the one file read cold and then
again from the page cache, the least a load costs that checks every byte before it changes
the first live one and holds no second copy of the state (docs/design.md, "Loading").

Two one-pass rows: ``ckpt.load(atomic=False)`` and ``CheckpointManager.restore()`` of the
newest step (which reads once and digests each block where it lands; a corrupt chunk sends it
to the next step, which overwrites whatever the bad one wrote).

Every load ends with the bytes in preallocated tensors, as a restore into a live model does:
raw, ckpt and DCP read in place; torch.load and safetensors return new tensors, which are
then copied into the destinations (the copy ``load_state_dict`` would do) inside the timing.

Goals (reported, not asserted): ckpt save >= 0.9x raw write+fsync and faster than DCP;
ckpt load >= 0.9x raw read, with extra memory <= max(256 MiB, 5% of the state). A third table
gives each load's extra memory: how far the process's peak resident memory rose during it.

Run from the repository root::

    python benchmarks/bench_save_load.py [--sizes 256M,1G] [--shapes many,few] [--reps 3]
        [--methods "raw,raw, 2 files,ckpt"]   # only these rows (raw always runs: the anchor)
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (puts the repository root on sys.path too)
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import ckpt  # noqa: E402

State = dict[str, torch.Tensor]
# DCP warns that no process group exists and it assumes a single process: that is the intent.
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


# -- the methods: each saves `state` to `path` or loads `path` into `dest` -------------------

def ckpt_save(state: State, path: str) -> None:
    ckpt.save(state, path)


def ckpt_load(dest: State, path: str) -> None:
    ckpt.load(dest, path)


def ckpt_load_in_place(dest: State, path: str) -> None:
    ckpt.load(dest, path, atomic=False)


def ckpt_restore(state: State, dest: State, root: str) -> dict[str, float]:
    """``CheckpointManager.restore`` of the newest step (one pass; docs/design.md,
    "Loading"): the save untimed, the restore timed with its peak extra memory."""
    with ckpt.CheckpointManager(root, async_save=False, metrics=False,
                                schedule=ckpt.Schedule(handle_sigterm=False)) as mgr:
        mgr.save(1, state)
    for t in dest.values():
        t.zero_()
    common.drop_page_cache()
    with ckpt.CheckpointManager(root, read_only=True, metrics=False) as mgr:
        with common.PeakMemory() as mem, common.Stopwatch() as sw:
            step = mgr.restore(dest)
    assert step == 1 and mgr.last_restore.tier == "storage"
    common.remove(root)
    return {"restore": sw.seconds, "restore_cpu": sw.cpu_seconds,
            "restore_extra": mem.extra_bytes or 0}


def torch_save(state: State, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def torch_load(dest: State, path: str) -> None:
    loaded = torch.load(path, weights_only=True)
    for k, t in dest.items():
        t.copy_(loaded[k])


def safetensors_save(state: State, path: str) -> None:
    save_file(state, path)
    common.fsync_path(path)


def safetensors_load(dest: State, path: str) -> None:
    loaded = load_file(path)  # mmap-backed: the copy below is what reads the file
    for k, t in dest.items():
        t.copy_(loaded[k])


def dcp_save(state: State, path: str) -> None:
    # FileSystemWriter's default sync_files=True fsyncs every file it writes.
    dcp.save(state, checkpoint_id=path)


def dcp_load(dest: State, path: str) -> None:
    dcp.load(dest, checkpoint_id=path)


WRITE_THREADS = ckpt.SaveOptions().write_threads
RAW_PARALLEL = f"raw, {WRITE_THREADS} files"  # written / read by as many threads


def raw_parallel_save(state: State, path: str) -> None:
    """Raw writes with as many files and threads as ckpt writes with."""
    common.raw_save_parallel(state, path, WRITE_THREADS)


def raw_parallel_load(dest: State, path: str) -> None:
    common.raw_load_parallel(dest, path, WRITE_THREADS)


# (table row name, save function, load function)
METHODS: list[tuple[str, Callable[[State, str], None], Callable[[State, str], None]]] = [
    ("raw", common.raw_save, common.raw_load),
    (RAW_PARALLEL, raw_parallel_save, raw_parallel_load),
    ("ckpt", ckpt_save, ckpt_load),
    ("torch.save/load", torch_save, torch_load),
    ("safetensors", safetensors_save, safetensors_load),
    ("DCP", dcp_save, dcp_load),
]
CKPT_IN_PLACE = "ckpt load, atomic=False (one pass)"
CKPT_RESTORE = "ckpt restore(), newest step (one pass)"
RAW_TWICE = "raw, read twice"  # cold, then from the page cache: the floor of two passes


def make_case(name: str, save: Callable[[State, str], None], load: Callable[[State, str], None],
              state: State, dest: State, path: str, cold: bool) -> Callable[[int], dict[str, float]]:
    """One repetition of one method: save (timed), load (timed, with its peak extra
    memory), check, remove the files."""

    def case(rep: int) -> dict[str, float]:
        common.remove(path)
        if cold:
            common.drop_page_cache()
        with common.Stopwatch() as sw_save:
            save(state, path)
        for t in dest.values():
            t.zero_()
        if cold:
            common.drop_page_cache()
        with common.PeakMemory() as mem, common.Stopwatch() as sw_load:
            load(dest, path)
        if rep == 0 and not common.same_values(state, dest):
            raise AssertionError(f"{name}: loaded values differ from the saved ones")
        result = {"save": sw_save.seconds, "save_cpu": sw_save.cpu_seconds,
                  "load": sw_load.seconds, "load_cpu": sw_load.cpu_seconds,
                  "load_extra": mem.extra_bytes or 0}
        if name == METHODS[0][0]:  # the same file read twice: cold, then from the page cache
            if cold:
                common.drop_page_cache()
            with common.Stopwatch() as sw:
                load(dest, path)
                load(dest, path)
            result["load_twice"] = sw.seconds
            result["load_twice_cpu"] = sw.cpu_seconds
        if name == "ckpt":  # the same files again, read straight into the destinations
            for t in dest.values():
                t.zero_()
            if cold:
                common.drop_page_cache()
            with common.PeakMemory() as mem, common.Stopwatch() as sw:
                ckpt_load_in_place(dest, path)
            if rep == 0 and not common.same_values(state, dest):
                raise AssertionError("ckpt in-place load: loaded values differ")
            result["load_in_place"] = sw.seconds
            result["load_in_place_cpu"] = sw.cpu_seconds
            result["load_in_place_extra"] = mem.extra_bytes or 0
            if cold:  # the manager's restore (the page cache dropped in it)
                restored = ckpt_restore(state, dest, path + "-root")
                if rep == 0 and not common.same_values(state, dest):
                    raise AssertionError("ckpt restore: restored values differ")
                result.update(restored)
        common.remove(path)
        return result

    return case


def bench_one(size: int, shape: str, reps: int, workdir: str, cold: bool,
              methods: list[str] | None = None) -> str:
    """Run every method (or those named in ``methods``) on one state; return the tables."""
    state = common.make_state(size, shape)
    dest = common.empty_like_state(state)
    nbytes = common.state_bytes(state)
    chosen = [m for m in METHODS if methods is None or m[0] in methods or m is METHODS[0]]
    cases = [(name, make_case(name, save, load, state, dest,
                              os.path.join(workdir, f"m{i}"), cold))
             for i, (name, save, load) in enumerate(chosen)]
    label = f"{common.format_size(size)}, {shape}"
    timings = common.run_interleaved(cases, reps, progress=label)

    names = [n for n, _, _ in chosen]
    raw = METHODS[0][0]
    anchors = [a for a in (raw, RAW_PARALLEL) if a in names]
    save_rows = [common.Row(n, timings[n]["save"], timings[n]["save_cpu"]) for n in names]
    load_rows = [common.Row(n, timings[n]["load"], timings[n]["load_cpu"]) for n in names]
    load_rows.insert(1, common.Row(RAW_TWICE, timings[raw]["load_twice"],
                                   timings[raw]["load_twice_cpu"]))
    extra = {n: timings[n]["load_extra"] for n in names}
    extra[RAW_TWICE] = extra[raw]
    if "ckpt" in names:
        at = [r.name for r in load_rows].index("ckpt") + 1
        load_rows.insert(at, common.Row(CKPT_IN_PLACE, timings["ckpt"]["load_in_place"],
                                        timings["ckpt"]["load_in_place_cpu"]))
        extra[CKPT_IN_PLACE] = timings["ckpt"]["load_in_place_extra"]
        if "restore" in timings["ckpt"]:
            load_rows.insert(at + 1, common.Row(CKPT_RESTORE, timings["ckpt"]["restore"],
                                                timings["ckpt"]["restore_cpu"]))
            extra[CKPT_RESTORE] = timings["ckpt"]["restore_extra"]
    count = len(state)
    title = (f"{common.format_size(nbytes)} in {count} fp32 tensors "
             f"({common.format_size(nbytes // count)} each), {reps} reps")
    memory = common.markdown_table(
        ["method", "median extra MiB", "max extra MiB", "% of state"],
        [[r.name, f"{common.median(extra[r.name]) / common.MiB:.0f}",
          f"{max(extra[r.name]) / common.MiB:.0f}", f"{100 * max(extra[r.name]) / nbytes:.0f}"]
         for r in load_rows])
    return "\n".join([
        f"### Save: {title}", "",
        common.throughput_table(save_rows, nbytes,
                                anchors=anchors + (["DCP"] if "DCP" in names else [])), "",
        f"### Load ({'cold' if cold else 'warm'} page cache): {title}", "",
        common.throughput_table(load_rows, nbytes, anchors=anchors + [RAW_TWICE]), "",
        f"### Load memory (peak resident memory above the start): {title}", "",
        memory, "",
    ])


def method_names(text: str) -> list[str] | None:
    """``--methods``' rows: comma-separated, where a comma followed by a space belongs to
    the name (``raw,raw, 2 files,ckpt``); None (every row) when empty."""
    names: list[str] = []
    for part in text.split(","):
        if part.startswith(" ") and names:
            names[-1] += "," + part
        elif part:
            names.append(part)
    return names or None


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], default_reps=3, extra=lambda p: p.add_argument(
        "--methods", default="", help="comma-separated rows to run (default: all): "
        + ", ".join(n for n, _, _ in METHODS)))
    methods = method_names(args.methods)
    unknown = [m for m in methods or [] if m not in [n for n, _, _ in METHODS]]
    if unknown:
        raise SystemExit(f"unknown --methods {unknown}; choose among "
                         + ", ".join(repr(n) for n, _, _ in METHODS))
    workdir = common.fresh_dir(os.path.join(args.dir, "save_load"))
    cold = common.drop_page_cache()
    print(f"Machine: {common.machine_description()}")
    print(f"Data directory: {common.describe_dir(workdir)}")
    print(f"Loads are {'COLD (page cache dropped before each save and load)' if cold else 'WARM (cannot drop the page cache: not root?)'}")
    print(f"ckpt code: commit {common.code_version()}")
    print(f"ckpt SaveOptions: {ckpt.SaveOptions()}")
    print("Ratios are throughput ratios: `x raw` = raw time / method time (above 1 is faster).")
    print("CPU s: user+system seconds of all this process's threads (not the kernel's flushers).")
    print(f"Load average at start: {common.load_average()}")
    print()
    for size in args.sizes:
        for shape in args.shapes:
            print(bench_one(size, shape, args.reps, workdir, cold, methods), flush=True)
    print(f"Load average at end: {common.load_average()}")
    print(common.GATE.summary())
    common.remove(workdir)


if __name__ == "__main__":
    main()
