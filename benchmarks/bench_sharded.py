"""Sharded save and load on several processes, and resharded loads (4 -> 3).

A state of fp32 DTensors sharded along dim 0 (like FSDP parameters) is saved by W ranks
(processes on this machine, gloo) and loaded back by the same W ranks, for W in 1, 2, 4; the
4-rank checkpoint is also loaded by 3 ranks (resharded). DCP saves and loads the same state
beside it. A time is the slowest rank's (the job waits for it), from a barrier before to a
barrier after; ckpt's save counts until the commit. Loads read cold when the page cache can
be dropped. The processes share 2 cores and one disk: world 4 measures contention, not
scaling — the point is the ratio of a resharded load to a same-world load (goal <= 1.2x) and
ckpt against DCP on the same state.

Run from the repository root::

    python benchmarks/bench_sharded.py [--sizes 256M] [--reps 3]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

warnings.filterwarnings("ignore")


def _state(total: int, world: int, zeros: bool):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    count, cols = 16, 1024
    rows = total // (count * cols * 4)
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(count):
        full = torch.zeros(rows, cols) if zeros else torch.rand(rows, cols, generator=g)
        out[f"w{i:02d}"] = distribute_tensor(full, mesh, [Shard(0)])
    return out


def _worker(rank: int, world: int, store: str, job: dict, queue) -> None:
    sys.path.insert(0, common.REPO_ROOT)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        state = _state(job["bytes"], world, zeros=job["op"] == "load")
        dist.barrier()
        t0 = time.perf_counter()
        if job["tool"] == "ckpt" and job["op"] == "save":
            with ckpt.CheckpointManager(job["path"], async_save=False) as mgr:
                mgr.save(1, state, force=True)
        elif job["tool"] == "ckpt":
            with ckpt.CheckpointManager(job["path"], read_only=True) as mgr:
                mgr.restore(state)
        elif job["op"] == "save":
            dcp.save(state, checkpoint_id=job["path"])
        else:
            dcp.load(state, checkpoint_id=job["path"])
        dist.barrier()
        seconds = time.perf_counter() - t0
        ok = True
        if job["op"] == "load":
            ref = _state(job["bytes"], world, zeros=False)
            ok = all(torch.equal(state[k].to_local(), ref[k].to_local()) for k in ref)
        queue.put((rank, seconds, ok))
    finally:
        dist.destroy_process_group()


def run_job(world: int, job: dict) -> float:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, "s"), job, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
    if not all(ok for _, _, ok in results):
        raise RuntimeError(f"{job} loaded wrong values")
    return max(s for _, s, _ in results)


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], default_reps=3)
    root = common.fresh_dir(os.path.join(args.dir, "sharded"))
    print(f"# {common.machine_description()}; load {common.load_average()}; "
          f"code {common.code_version()}\n")
    for size in args.sizes:
        rows = []
        for tool in ("ckpt", "dcp"):
            saved: dict[int, str] = {}
            cases = []
            for world in (1, 2, 4):
                path = os.path.join(root, f"{tool}-w{world}")

                def save(rep, world=world, path=path):
                    common.remove(path)
                    return {"s": run_job(world, {"tool": tool, "op": "save", "path": path,
                                                 "bytes": size})}
                saved[world] = path
                cases.append((f"save w{world}", save))
            t_save = common.run_interleaved(cases, args.reps, progress=f"{tool} saves")
            loads = [(f"load w{w}", lambda rep, w=w: {"s": run_job(w, {
                "tool": tool, "op": "load", "path": saved[w], "bytes": size})})
                for w in (1, 2, 4)]
            loads.append(("load w4->3", lambda rep: {"s": run_job(3, {
                "tool": tool, "op": "load", "path": saved[4], "bytes": size})}))

            def cold(fn):
                return lambda rep: (common.drop_page_cache(), fn(rep))[1]
            t_load = common.run_interleaved([(n, cold(f)) for n, f in loads], args.reps,
                                            progress=f"{tool} loads")
            for name, t in list(t_save.items()) + list(t_load.items()):
                s = common.median(t["s"])
                rows.append([tool, name, f"{s:.3f}", f"{common.gbps(size, s):.2f}"])
            same = common.median(t_load["load w4"]["s"])
            resharded = common.median(t_load["load w4->3"]["s"])
            rows.append([tool, "resharded / same-world (w4->3 / w4)", f"{resharded / same:.2f}",
                         "-"])
        print(f"## {common.format_size(size)}, 16 tensors sharded on dim 0\n")
        print(common.markdown_table(["tool", "case", "median s (slowest rank)", "GB/s"], rows))
        print()
    print(f"page cache dropped before loads: {common.drop_page_cache()}")
    print(common.GATE.summary())
    common.remove(root)


if __name__ == "__main__":
    main()
