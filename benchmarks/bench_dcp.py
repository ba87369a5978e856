"""Restoring a PyTorch DCP checkpoint: ``ckpt.load(state, DCP_DIR)`` against
``torch.distributed.checkpoint.load`` of the same directory, in one process.

The checkpoint is written once with ``dcp.save`` (one process); each repetition loads it
into a preallocated state (the pages resident, so page faults are not timed), the two
methods interleaved, warm page cache. Reported: median wall seconds, GB/s, and the peak
resident memory each load added (VmHWM over the start, reset before each case). ckpt's
load is DCP's reader and planner plus its checks (metadata allowlist and validation, the
data files' sizes), so the two should be within noise; the table says by how much.

    python benchmarks/bench_dcp.py --sizes 256M --shapes many --reps 5
"""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (GATE, PeakMemory, Row, Stopwatch, empty_like_state, format_size,  # noqa: E402
                    fresh_dir, machine_description, markdown_table, parse_args, remove,
                    run_interleaved, same_values, state_bytes, throughput_table, median)

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import ckpt  # noqa: E402

warnings.filterwarnings("ignore", "torch.distributed is disabled")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], default_reps=5)
    print(machine_description())
    for nbytes in args.sizes:
        for shape in args.shapes:
            source = {"model": __import__("common").make_state(nbytes, shape)}
            path = os.path.join(fresh_dir(args.dir), f"dcp-{shape}-{nbytes}")
            dcp.save(source, checkpoint_id=path, no_dist=True)
            dest = {"model": empty_like_state(source["model"])}
            size = state_bytes(source["model"])
            peaks: dict[str, list[float]] = {"ckpt.load": [], "dcp.load": []}

            def case(name: str, load) -> tuple[str, object]:
                def run(rep: int) -> dict[str, float]:
                    for t in dest["model"].values():
                        t.zero_()
                    with PeakMemory() as mem, Stopwatch() as sw:
                        load()
                    peaks[name].append(mem.extra_bytes or 0)
                    assert same_values(source["model"], dest["model"])
                    return {"wall": sw.seconds, "cpu": sw.cpu_seconds}
                return name, run

            timings = run_interleaved(
                [case("ckpt.load", lambda: ckpt.load(dest, path)),
                 case("dcp.load", lambda: dcp.load(dest, checkpoint_id=path, no_dist=True))],
                args.reps, progress=f"{format_size(size)} {shape}")
            rows = [Row(n, t["wall"], t["cpu"]) for n, t in timings.items()]
            print(f"\n### {format_size(size)}, {shape} ({len(source['model'])} tensors), "
                  f"{args.reps} reps, warm page cache\n")
            print(throughput_table(rows, size, anchors=["dcp.load"]))
            print()
            print(markdown_table(["method", "median peak extra memory", "x state"],
                                 [[n, format_size(int(median(p))),
                                   f"{median(p) / size:.2f}"] for n, p in peaks.items()]))
            remove(path)
    print("\n" + GATE.summary())


if __name__ == "__main__":
    main()
