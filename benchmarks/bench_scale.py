"""Save and load planning at 8 to 4,096 ranks, simulated: metadata only, no tensor bytes.

For a 70B decoder (Llama-3-70B shapes, bf16) and its Adam state (fp32) laid out by FSDP,
HSDP or tensor parallel + FSDP, this runs the planning path of a real save and load
(benchmarks/scale_sim.py explains which functions) and prints seconds per phase:

* ``plan``: what every rank computes in the blocking part of a save once the boxes are
  gathered: writer assignment over all ranks' boxes (replicas written once) and the chunks
  and data files of its own share (rank 0's, the busiest under the greedy balance);
* ``vote``: the commit vote through a real ``TCPStore``: every rank publishes its chunk table,
  the coordinator collects them all. Up to ``--clients`` client connections are real; the
  coordinator's time for the others is extrapolated linearly and marked ``~``;
* ``merge``: the coordinator's parse of every table and its merge into one manifest;
* ``serialize`` / ``validate``: the manifest to JSON, and JSON back through full validation
  (what every restore, ``ckpt ls`` and ``ckpt verify`` do first);
* ``load_plan``: one rank of the next world (N/2 and N-8 ranks) finding the chunks that overlap
  its boxes of every tensor.

A phase projected to exceed ``--budget`` seconds is not run; it is extrapolated from the two
largest measured worlds (linear in chunks) and marked ``~``. The last line is machine-readable::

    scale: ranks=4096 chunks=<n> manifest_bytes=<n> plan_s=<x> merge_s=<x> validate_s=<x> load_plan_s=<x>

Run from the repository root: ``python benchmarks/bench_scale.py [--ranks 8,64,512,4096]``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (also puts the repository root on sys.path)
import scale_sim as sim  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402

from ckpt.distributed import Group  # noqa: E402
from ckpt.engine import RankTable, build_manifest  # noqa: E402
from ckpt.format import Manifest  # noqa: E402
from ckpt.options import SaveOptions  # noqa: E402
from ckpt.sharding import assign_writers, overlapping  # noqa: E402

LAYOUTS = ("fsdp", "hsdp", "tp_fsdp")


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _store_group(store: TCPStore, rank: int, world: int) -> Group:
    """A ``Group`` whose store calls go to ``store`` (the real publish/collect code)."""
    group = Group.__new__(Group)
    group.enabled, group.pg, group.rank, group.world_size = True, None, rank, world
    group._store = store
    return group


def vote(tables: list[RankTable], clients: int) -> tuple[float, bool]:
    """Publish ``clients`` tables from that many real client connections, then collect them
    on the coordinator; returns (seconds for all tables, extrapolated?)."""
    n = min(clients, len(tables))
    master = TCPStore("127.0.0.1", 0, n + 1, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=120))
    port = master.port
    stores = [TCPStore("127.0.0.1", port, n + 1, is_master=False,
                       timeout=datetime.timedelta(seconds=120)) for _ in range(n)]
    docs = [tables[r].to_json() for r in range(n)]

    def publish(r: int) -> None:
        _store_group(stores[r], r, len(tables)).publish(f"tok/rank{r}", {"ok": docs[r]})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=publish, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    coordinator = _store_group(master, 0, len(tables))
    coordinator.collect([f"tok/rank{r}" for r in range(n)], timeout=120)
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    del stores, master
    return seconds * len(tables) / n, n < len(tables)


def load_plan(manifest: Manifest, layout: str, world: int, rank: int = 0) -> tuple[float, int]:
    """Seconds for one rank of ``world`` to find the chunks overlapping its boxes."""
    if layout != "fsdp" and world % 8:
        layout = "fsdp"
    mesh, tensors = sim.model_state(layout, world, optimizer=_ARGS.optim, layers=_ARGS.layers)
    boxes = sim.rank_boxes(mesh, tensors, rank)
    t0 = time.perf_counter()
    reads = 0
    for t, box in zip(tensors, boxes):
        reads += len(overlapping(manifest.tensors[t.key], box))
    return time.perf_counter() - t0, reads


def run_world(layout: str, world: int, options: SaveOptions) -> dict:
    row: dict = {"layout": layout, "ranks": world}
    mesh, tensors = sim.model_state(layout, world, optimizer=_ARGS.optim, layers=_ARGS.layers)
    specs = sim.rank_specs(mesh, tensors)
    writers, t_assign = _timed(lambda: assign_writers(specs))
    table0, t_chunk = _timed(lambda: sim.rank_table(0, specs[0], writers, options, "t" * 12))
    row["plan_s"] = t_assign + t_chunk
    tables = [table0] + [sim.rank_table(r, s, writers, options, "t" * 12)
                         for r, s in enumerate(specs) if r]
    del specs, writers
    row["vote_s"], row["vote_extrapolated"] = vote(tables, _ARGS.clients)
    docs = [t.to_json() for t in tables]
    del tables
    gc.collect()

    def merge() -> Manifest:
        parsed = [RankTable.from_json(json.loads(json.dumps(d))) for d in docs]
        return build_manifest(sim.payload(tensors, world), parsed)

    manifest, row["merge_s"] = _timed(merge)
    del docs
    row["chunks"] = sum(len(e.chunks) for e in manifest.tensors.values())
    raw, row["serialize_s"] = _timed(manifest.to_json)
    row["manifest_bytes"] = len(raw)
    del manifest
    gc.collect()
    manifest, row["validate_s"] = _timed(lambda: Manifest.from_json(raw, where="simulated"))
    del raw
    plans = []
    for m in sorted({world // 2, world - 8} - {0}):
        seconds, _ = load_plan(manifest, layout, m)
        plans.append(seconds)
    row["load_plan_s"] = max(plans)
    return row


def _fmt(value: float, extrapolated: bool) -> str:
    return ("~" if extrapolated else "") + f"{value:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="8,64,512,4096")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--clients", type=int, default=64,
                        help="real TCPStore client connections in the vote (the rest extrapolated)")
    parser.add_argument("--budget", type=float, default=120.0,
                        help="skip (and extrapolate) a world whose projected total exceeds this")
    parser.add_argument("--layers", type=int, default=sim.LAYERS)
    parser.add_argument("--no-optim", dest="optim", action="store_false",
                        help="parameters only (default: parameters and Adam state)")
    global _ARGS
    _ARGS = parser.parse_args()
    options = SaveOptions(write_threads=4)
    commit = common.code_version()
    print(f"### Planning seconds per phase (code {commit})\n")
    print(f"70B decoder, {_ARGS.layers} layers, bf16 parameters"
          + (" + fp32 Adam state" if _ARGS.optim else "")
          + f"; 8 MiB chunks; vote with up to {_ARGS.clients} real TCPStore clients. "
          "`~`: extrapolated (linear in chunks) from the two largest measured worlds.\n")
    print("| layout | ranks | chunks | manifest bytes | plan s | vote s | merge s | serialize s "
          "| validate s | load plan s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    phases = ("plan_s", "vote_s", "merge_s", "serialize_s", "validate_s", "load_plan_s")
    last = None
    for layout in _ARGS.layouts.split(","):
        measured: list[dict] = []
        for world in [int(r) for r in _ARGS.ranks.split(",")]:
            estimate = _extrapolate(measured, world, phases) if len(measured) >= 2 else None
            total = sum(estimate[p] for p in phases) if estimate else 0.0
            if estimate and total > _ARGS.budget:
                row, approx = estimate, True
            else:
                row, approx = run_world(layout, world, options), False
                measured.append(row)
            cells = [_fmt(row[p], approx or (p == "vote_s" and row.get("vote_extrapolated")))
                     for p in phases]
            print(f"| {layout} | {world} | {'~' if approx else ''}{row['chunks']:,} | "
                  f"{'~' if approx else ''}{row['manifest_bytes']:,} | " + " | ".join(cells) + " |",
                  flush=True)
            if layout == "fsdp":
                last = (row, approx)
    if last is not None:
        row, approx = last
        mark = "~" if approx else ""
        print(f"\nscale: ranks={row['ranks']} chunks={mark}{row['chunks']} "
              f"manifest_bytes={mark}{row['manifest_bytes']} plan_s={mark}{row['plan_s']:.3f} "
              f"merge_s={mark}{row['merge_s']:.3f} validate_s={mark}{row['validate_s']:.3f} "
              f"load_plan_s={mark}{row['load_plan_s']:.3f}")


def _extrapolate(measured: list[dict], world: int, phases: tuple[str, ...]) -> dict:
    """The largest measured world scaled linearly in ranks (chunks grow as ranks x tensors
    once every shard is smaller than a chunk)."""
    b = measured[-1]
    factor = world / b["ranks"]
    out = {key: b[key] * factor for key in ("chunks", "manifest_bytes", *phases)}
    out.update(layout=b["layout"], ranks=world, chunks=int(out["chunks"]),
               manifest_bytes=int(out["manifest_bytes"]))
    return out


_ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
