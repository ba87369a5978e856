"""Save and load planning at 8 to 4,096 ranks, simulated: metadata only, no tensor bytes.

For a 70B decoder (Llama-3-70B shapes, bf16) and its Adam state (fp32) laid out by FSDP,
HSDP or tensor parallel + FSDP, plus a ``ckpt.RNGState`` per rank as a trainer saves one
(``--no-rng`` leaves it out), this runs the planning path of a real save and load in
format 2 (rank tables; benchmarks/scale_sim.py explains which functions) and prints seconds
per phase:

* ``plan``: what one rank computes in the blocking part and the writer of a save: every
  tensor's layout, which of its boxes it writes (``snapshot.written_here``), their chunks and
  data files, and its chunk table's bytes (rank 0's; the faster of two saves);
* ``vote``: the commit vote through a real ``TCPStore``: every rank's report (table name,
  size, digest, data files) is published, and the coordinator collects them all. The
  machine allows ``--clients`` client connections (64 by default); past that, ranks share
  them (each connection publishes its ranks' reports in turn, so the time is an upper
  bound), marked ``*``;
* ``merge``: the coordinator's top-level manifest from every report;
* ``serialize`` / ``validate``: that manifest to JSON, and JSON back through full validation
  (what every restore, ``ckpt ls`` and ``ckpt verify`` do first);
* ``load_plan``: one rank of the next world (N/2 and N-8 ranks, the slower counts) finding the
  chunks that overlap its boxes of every tensor, as ``reader.load_step`` does: the rank
  tables it needs are read at once (``sharding.prefetch``), checked against their digests,
  validated in batches and searched.

Merge, serialize, validate and load plan are the faster of two runs (a busy machine only
adds time). Rank 0, the first ``--clients`` ranks and the ranks whose tables a load plan reads run the
real code; the reports of the other ranks (needed by the vote and the merge only for their
count, names and sizes) are stand-ins with rank 0's sizes. ``chunks`` is the exact total, counted from the layouts.

The last line is machine-readable::

    scale: ranks=4096 chunks=<n> manifest_bytes=<n> plan_s=<x> merge_s=<x> validate_s=<x> load_plan_s=<x>

Run from the repository root: ``python benchmarks/bench_scale.py [--ranks 8,64,512,4096]``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (also puts the repository root on sys.path)
import scale_sim as sim  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402

from ckpt._shared.distributed import Group  # noqa: E402
from ckpt._save.commit import build_top_manifest  # noqa: E402
from ckpt._format.manifest import Manifest  # noqa: E402
from ckpt._format.layout import cells_overlapping  # noqa: E402
from ckpt.options import SaveOptions  # noqa: E402
from ckpt._save.chunking import data_file_name  # noqa: E402
from ckpt._format.ranktable import table_name  # noqa: E402
from ckpt._shared.sharding import overlapping, prefetch  # noqa: E402
from ckpt._step.tables import bind_tables  # noqa: E402

LAYOUTS = ("fsdp", "hsdp", "tp_fsdp")
TOKEN = "t" * 12


def _timed(fn, repeat: int = 1):
    """(result, fastest of ``repeat`` runs' seconds): a busy machine only adds time."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def _store_group(store: TCPStore, rank: int, world: int) -> Group:
    """A ``Group`` whose store calls go to ``store`` (the real publish/collect code)."""
    group = Group.__new__(Group)
    group.enabled, group.pg, group.rank, group.world_size = True, None, rank, world
    group._store = store
    return group


def vote(reports: list[dict], clients: int) -> tuple[float, bool]:
    """Every rank's report published through ``clients`` real client connections (rank r on
    connection r % clients, each connection's in turn), all collected by the coordinator;
    returns (seconds until the coordinator holds them all, whether ranks shared connections)."""
    world = len(reports)
    n = min(clients, world)
    master = TCPStore("127.0.0.1", 0, n + 1, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=120))
    stores = [TCPStore("127.0.0.1", master.port, n + 1, is_master=False,
                       timeout=datetime.timedelta(seconds=120)) for _ in range(n)]

    def publish(c: int) -> None:
        for r in range(c, world, n):
            _store_group(stores[c], r, world).publish(f"tok/rank{r}", {"ok": reports[r]})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=publish, args=(c,)) for c in range(n)]
    for t in threads:
        t.start()
    _store_group(master, 0, world).collect([f"tok/rank{r}" for r in range(world)], timeout=300)
    seconds = time.perf_counter() - t0
    for t in threads:
        t.join()
    del stores, master
    return seconds, n < world


def _stand_in(report: dict, rank: int) -> dict:
    """Rank ``rank``'s report with rank 0's sizes (names as that rank would write them)."""
    files = {data_file_name(TOKEN, rank, i): size
             for i, size in enumerate(report["files"].values())}
    name = table_name(TOKEN, rank)
    return {**report, "table": [name, *report["table"][1:]], "files": files}


def _reader(layout: str, world: int):
    if layout != "fsdp" and world % 8:
        layout = "fsdp"
    return sim.model_state(layout, world, optimizer=_ARGS.optim, layers=_ARGS.layers)


def run_world(layout: str, world: int, options: SaveOptions) -> dict:
    row: dict = {"layout": layout, "ranks": world}
    mesh, tensors = sim.model_state(layout, world, optimizer=_ARGS.optim, layers=_ARGS.layers)
    rng = sim.rng_state(world) if _ARGS.rng else None
    plans = []
    for _ in range(2):  # the first includes one-time imports and caches; a job saves often
        layouts, t_layouts = _timed(lambda: sim.layouts_of(mesh, tensors, rng))
        (name0, raw0, report0), t_rank = _timed(
            lambda: sim.save_rank(mesh, tensors, layouts, 0, options, TOKEN, rng))
        plans.append(t_layouts + t_rank)
    row["plan_s"] = min(plans)
    row["table_bytes"] = len(raw0)
    row["chunks"] = sim.count_chunks(tensors, layouts, options) + (len(rng[1]) if rng else 0)
    # The ranks whose tables the load plans read (found with the layout code, untimed).
    readers = []
    for m in sorted({world // 2, world - 8} - {0}):
        r_mesh, r_tensors = _reader(layout, m)
        readers.append((m, list(zip(r_tensors, sim.rank_boxes(r_mesh, r_tensors, 0)))))
    needed = {w for _, boxes in readers for t, box in boxes
              for _, w in cells_overlapping(t.key, t.shape, layouts[t.key], box)}
    sampled = set(range(min(_ARGS.clients, world))) | needed
    real = {0: (name0, raw0, report0)}
    for r in sorted(sampled - {0}):
        real[r] = sim.save_rank(mesh, tensors, layouts, r, options, TOKEN, rng)
    reports = [real[r][2] if r in real else _stand_in(report0, r) for r in range(world)]
    files = {name: raw for name, raw, _ in real.values()}
    row["vote_s"], row["vote_shared"] = vote(reports, _ARGS.clients)
    gc.collect()
    manifest, row["merge_s"] = _timed(lambda: build_top_manifest(
        sim.payload(tensors, world, layouts, token=TOKEN, rng=rng), reports), 2)
    raw, row["serialize_s"] = _timed(manifest.to_json, 2)
    row["manifest_bytes"] = len(raw)
    del manifest, reports
    gc.collect()
    parsed, row["validate_s"] = _timed(lambda: Manifest.from_json(raw, where="simulated"), 2)
    plans, tables_read = [], 0
    for m, boxes in readers:
        read: list[str] = []

        def plan() -> int:  # a fresh manifest each time: no table read before
            read.clear()
            fresh = Manifest.from_json(raw, where="simulated")
            bind_tables(fresh, lambda n: read.append(n) or files[n], "simulated")
            t0 = time.perf_counter()
            prefetch(fresh, [(t.key, box) for t, box in boxes])  # what load_step does first
            sum(len(overlapping(fresh.tensors[t.key], box)) for t, box in boxes)
            return time.perf_counter() - t0
        plans.append(min(plan() for _ in range(2)))
        tables_read = max(tables_read, len(read))
    row["load_plan_s"] = max(plans)
    row["tables_read"] = tables_read
    del parsed
    return row


def _fmt(value: float, shared: bool) -> str:
    return f"{value:.3f}" + ("*" if shared else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="8,64,512,4096")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--clients", type=int, default=64,
                        help="real TCPStore client connections in the vote (more ranks share them)")
    parser.add_argument("--layers", type=int, default=sim.LAYERS)
    parser.add_argument("--no-optim", dest="optim", action="store_false",
                        help="parameters only (default: parameters and Adam state)")
    parser.add_argument("--no-rng", dest="rng", action="store_false",
                        help="no per-rank RNG state (default: each rank saves a "
                        "ckpt.RNGState, as a trainer does)")
    global _ARGS
    _ARGS = parser.parse_args()
    options = SaveOptions(write_threads=4)
    commit = common.code_version()
    print(f"### Planning seconds per phase, format 2 (code {commit})\n")
    print(f"70B decoder, {_ARGS.layers} layers, bf16 parameters"
          + (" + fp32 Adam state" if _ARGS.optim else "")
          + (" + a ckpt.RNGState per rank (its tree in its rank table, its "
             "tensors written by their rank)" if _ARGS.rng else "")
          + f"; 8 MiB chunks; vote through a real TCPStore with {_ARGS.clients} client "
          "connections (`*`: ranks shared them, an upper bound). Load plan: one "
          "rank of N/2 and of N-8 ranks, the slower; tables read: how many rank tables it "
          "read.\n")
    print("| layout | ranks | chunks | manifest bytes | rank-0 table bytes | plan s | vote s "
          "| merge s | serialize s | validate s | load plan s | tables read |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    phases = ("plan_s", "vote_s", "merge_s", "serialize_s", "validate_s", "load_plan_s")
    last = None
    for layout in _ARGS.layouts.split(","):
        for world in [int(r) for r in _ARGS.ranks.split(",")]:
            row = run_world(layout, world, options)
            cells = [_fmt(row[p], p == "vote_s" and row["vote_shared"]) for p in phases]
            print(f"| {layout} | {world} | {row['chunks']:,} | {row['manifest_bytes']:,} | "
                  f"{row['table_bytes']:,} | " + " | ".join(cells)
                  + f" | {row['tables_read']} |", flush=True)
            if layout == "fsdp":
                last = row
            gc.collect()
    if last is not None:
        print(f"\nscale: ranks={last['ranks']} chunks={last['chunks']} "
              f"manifest_bytes={last['manifest_bytes']} plan_s={last['plan_s']:.3f} "
              f"merge_s={last['merge_s']:.3f} validate_s={last['validate_s']:.3f} "
              f"load_plan_s={last['load_plan_s']:.3f}")


_ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
