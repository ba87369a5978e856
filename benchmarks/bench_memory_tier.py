"""The memory tier and warm restarts: restore time by tier, and the elastic recovery timeline.

1. **Restore by tier**: the same state (``--sizes``, default 1 GiB per rank) restored by a
   ``CheckpointManager`` from

   - the memory tier (the segment in ``/dev/shm`` that an earlier process published, as a
     worker restarted by torchrun finds it); and, for reference, the same with chunk digests
     not checked (``verify="structure"``: the cost of the digest pass), and the same without
     the memory key's tag check and the owner checks of every directory and file it opens
     (the cost of authentication; goal: at most 5% slower with them, ``--auth`` measures
     only this pair and the raw read);
   - the POSIX root with the page cache dropped before each restore ("cold", needs root;
     otherwise the row says "warm") and, for reference, with a warm page cache;
   - S3 (moto's server on loopback, as in bench_storage.py: a Python server, so the S3
     figure says more about moto than about AWS; a smaller state, ``--s3-max``);
   - anchors, the floor of each tier on this machine: the same data files read raw (two
     threads, 512 KiB ``pread`` blocks straight into one preallocated buffer, each block
     digested with xxh3; no parsing, planning or checks) from the segment in ``/dev/shm`` and
     from the root with the page cache dropped. Their ratio is the most the memory tier's
     speed-up over a cold disk can be here.

   Then at world 2 (two gloo ranks, each one "node"): from own memory, from a peer's replica
   (node B's segments moved out of sight: its shards come from the replica on node A) and
   from the root with the page cache dropped.

   Every restore but the reference row checks every chunk's digest; the table also shows the
   tier ``mgr.last_restore`` reported and the bytes it read from the persistent root.
   Methods run interleaved (A B C D, B C D A, ...); medians over ``--reps``. Goals: memory
   >= 10x faster than S3 and >= 3x faster than a cold local disk.

2. **Recovery timeline** of ``trainer.ElasticTrainer`` (the tiny LM of the demo, the job of
   tests/support/memory_job.py) under local torchrun agents (torchrun's default monitor interval,
   0.1 s), with the memory tier (the trainer's default under torchrun) and without it
   (``memory_tier=False``), each with cold workers (``torchrun ... SCRIPT``) and with warm
   restarts (``torchrun ... -m trainer.warm SCRIPT``: workers forked from a zygote that has
   imported torch; docs/warm-restarts.md), one after the other:

   - *worker killed*: one node, one worker, SIGKILLed mid-training; its agent restarts it;
   - *node killed*: three nodes, one of them SIGKILLed (agent and worker) and its
     shared-memory segments removed; the two survivors go on at world 2.

   From the kill (t = 0) to the first step of the new attempt, from the run records and the
   agents' logs. torchrun's own part (from the last agent seeing its worker exit to the last
   agent's "Rendezvous complete") is shown and excluded from the recovery the goal is about:
   under 2 s with the memory tier. ``--quick``: the killed worker only, cold and warm with
   the memory tier.

3. **Save cost** (``--save-cost``, alone; ``benchmarks/memory_save_cost.py``): a save into the
   memory tier against GEMINI's capture (lm-resiliency, which ``make bench`` installs beside
   the venv) and the copy floor, beside a training-like CPU loop: blocking, training time lost
   per save, and the bytes resident in ``/dev/shm`` and the process's resident set. Goal:
   training time lost <= 1.2x the copy floor's. Default sizes 256 MiB and 1 GiB, 5 repetitions.

Run from the repository root::

    python benchmarks/bench_memory_tier.py [--sizes 1G] [--reps 3] [--quick] [--auth]
        [--no-restore] [--no-peer] [--no-timeline] [--pad-mb 0] [--timeline-reps 1]
    python benchmarks/bench_memory_tier.py --save-cost [--sizes 256M,1G] [--reps 5]

It never asserts on timings.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import itertools
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (puts the repository root on sys.path too)
import memory_save_cost  # noqa: E402
import torch  # noqa: E402
import xxhash  # noqa: E402

import ckpt  # noqa: E402
from ckpt._format.names import step_dir  # noqa: E402
from ckpt._memory.tier import PREFIX, SHM_DIR, private_path  # noqa: E402
from storage_backends import open_storage  # noqa: E402

logging.getLogger("werkzeug").setLevel(logging.ERROR)
logging.getLogger("ckpt").setLevel(logging.ERROR)  # "segment kept: step in memory only"

GOALS = {"S3 (moto)": 10.0, "POSIX root, cold": 3.0}  # memory at least this many times faster
NO_DIGESTS = "memory tier, digests not checked"
NO_CHECKS = "memory tier, no key or owner checks"
GOAL_AUTH = 1.05  # the memory tier with its checks takes at most this times as long
RAW_SHM = "raw read of the segment's files"
RAW_COLD = "raw read of the root's files, cold"
ALL_CASES = ("memory tier", NO_DIGESTS, NO_CHECKS, "POSIX root, cold", "POSIX root, warm",
             "S3 (moto)")
SEGMENTS = private_path(SHM_DIR)  # this user's segments
RAW_THREADS, RAW_BLOCK = 2, 512 << 10  # as the restore reads: a thread per core, 512 KiB


def raw_read(paths: list[str], into: torch.Tensor, threads: int = RAW_THREADS,
             block: int = RAW_BLOCK) -> None:
    """The floor of a restore: every byte of ``paths`` (back to back) read with ``pread`` in
    ``block``-byte blocks straight into ``into`` (a preallocated, resident uint8 tensor),
    each block digested (xxh3) as it lands; the bytes are cut into ``threads`` contiguous
    runs, one per thread. Nothing is parsed, planned or checked."""
    sizes = [os.path.getsize(p) for p in paths]
    ends = list(itertools.accumulate(sizes))
    out = common.byte_view(into)

    def read_run(i: int) -> None:
        lo, hi = ends[-1] * i // threads, ends[-1] * (i + 1) // threads
        hashing = xxhash.xxh3_64()
        for path, size, end in zip(paths, sizes, ends):
            first, last = max(lo, end - size), min(hi, end)
            if first >= last:
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                for at in range(first, last, block):
                    part = out[at:min(at + block, last)]
                    if os.preadv(fd, [part], at - (end - size)) != len(part):
                        raise EOFError(path)
                    hashing.update(part)
            finally:
                os.close(fd)

    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(read_run, range(threads)))


@contextlib.contextmanager
def unchecked():
    """The memory tier's restore without the memory key's tag check and the owner checks of
    the directories and files it opens (plain ``O_NOFOLLOW`` opens): the reference row."""
    import ckpt._memory.shm_reader as reader
    import ckpt._memory.tier as tier

    saved = (reader.authenticate_manifest, reader.open_checked, reader.check_dir,
             tier.authenticate_manifest)
    reader.authenticate_manifest = tier.authenticate_manifest = lambda *a, **k: None
    reader.open_checked = lambda path: os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    reader.check_dir = lambda *a, **k: None
    try:
        yield
    finally:
        (reader.authenticate_manifest, reader.open_checked, reader.check_dir,
         tier.authenticate_manifest) = saved


class Tiers:
    """One state saved once per tier; ``case(name)`` restores it from there (timed)."""

    def __init__(self, state, shape: str, workdir: str,
                 s3: tuple[str, dict, int] | None) -> None:
        self.state, self.dest = state, common.empty_like_state(state)
        self.job = f"bench{uuid.uuid4().hex[:10]}"
        self.mem_root = os.path.join(workdir, "mem-root")
        self.disk_root = os.path.join(workdir, "disk-root")
        self.cold = common.drop_page_cache()
        # A step in memory only (persist_every not reached): its segment outlives the
        # manager, as it outlives a killed worker.
        tier = ckpt.MemoryTierOptions(persist_every=1_000_000, job=self.job)
        with ckpt.CheckpointManager(self.mem_root, memory_tier=tier, async_save=False,
                                    schedule=ckpt.Schedule(handle_sigterm=False)) as mgr:
            mgr.save(1, state)
            self.segment, self.key = mgr._publisher.tier.path, mgr._publisher.tier.key
        with ckpt.CheckpointManager(self.disk_root, async_save=False,
                                    schedule=ckpt.Schedule(handle_sigterm=False)) as mgr:
            mgr.save(1, state)
        self.s3_root = None
        self.nbytes = {name: common.state_bytes(state) for name in ALL_CASES}
        if s3 is not None:
            url, options, s3_max = s3
            # moto (one Python server, objects in its memory) fails large multipart uploads
            # on a busy machine: S3 gets a smaller state; the ratios are by GB/s.
            self.s3_state = state if common.state_bytes(state) <= s3_max else \
                common.make_state(s3_max, shape)
            self.s3_dest = common.empty_like_state(self.s3_state)
            self.nbytes["S3 (moto)"] = common.state_bytes(self.s3_state)
            self.s3_root = open_storage(url, create=True, storage_options=options)
            with ckpt.CheckpointManager(self.s3_root, async_save=False,
                                        schedule=ckpt.Schedule(handle_sigterm=False)) as mgr:
                mgr.save(1, self.s3_state)
        self.seen: dict[str, set[tuple[str, int]]] = {}
        self.files = {RAW_SHM: _data_files(os.path.join(self.segment, step_dir(1))),
            RAW_COLD: _data_files(os.path.join(self.disk_root, step_dir(1)))}
        for name, paths in self.files.items():
            self.nbytes[name] = sum(os.path.getsize(p) for p in paths)
        self.raw_dest = torch.zeros(max(self.nbytes[RAW_SHM], self.nbytes[RAW_COLD]),
                                    dtype=torch.uint8)  # resident before any timed read

    def raw(self, name: str):
        def case(rep: int) -> dict[str, float]:
            if name == RAW_COLD:
                common.drop_page_cache()
            with common.Stopwatch() as sw:
                raw_read(self.files[name], self.raw_dest)
            return {"restore": sw.seconds}
        return case

    def _restore(self, name: str, mgr: ckpt.CheckpointManager,
                 verify: str = "digest") -> dict[str, float]:
        state, dest = (self.s3_state, self.s3_dest) if name == "S3 (moto)" else (
            self.state, self.dest)
        for t in dest.values():  # outside the timed part: nothing left from a rep before
            t.zero_()
        with common.Stopwatch() as sw:
            step = mgr.restore(dest, verify=verify)
        assert step == 1 and common.same_values(state, dest), name
        info = mgr.last_restore
        self.seen.setdefault(name, set()).add((info.tier, info.bytes_from_storage))
        return {"restore": sw.seconds}

    def memory(self, digests: bool, checks: bool = True):
        def case(rep: int) -> dict[str, float]:
            # A new manager with the job's id: what a restarted worker builds.
            tier = ckpt.MemoryTierOptions(persist_every=1_000_000, job=self.job)
            with ckpt.CheckpointManager(self.mem_root, memory_tier=tier,
                                        schedule=ckpt.Schedule(handle_sigterm=False)) as mgr:
                if not checks:
                    with unchecked():
                        return self._restore(NO_CHECKS, mgr)
                if digests:
                    return self._restore("memory tier", mgr)
                return self._restore(NO_DIGESTS, mgr, verify="structure")
        return case

    def disk(self, cold: bool):
        def case(rep: int) -> dict[str, float]:
            if cold:
                common.drop_page_cache()
            else:  # warm: read once untimed
                with ckpt.CheckpointManager(self.disk_root, read_only=True) as mgr:
                    mgr.restore(self.dest)
            with ckpt.CheckpointManager(self.disk_root, read_only=True) as mgr:
                return self._restore(disk_name(cold and self.cold), mgr)
        return case

    def s3(self, rep: int) -> dict[str, float]:
        with ckpt.CheckpointManager(self.s3_root, read_only=True) as mgr:
            return self._restore("S3 (moto)", mgr)

    def close(self) -> None:
        for entry in os.listdir(SEGMENTS):
            if entry.startswith(f"{PREFIX}{self.job}-"):
                shutil.rmtree(os.path.join(SEGMENTS, entry), ignore_errors=True)
        if self.s3_root is not None:
            self.s3_root.delete("")


def _data_files(step: str) -> list[str]:
    """The data files of a step directory (what a restore of the whole state reads)."""
    return sorted(os.path.join(step, f) for f in os.listdir(step) if f.startswith("data-"))


def disk_name(cold: bool) -> str:
    return "POSIX root, cold" if cold else "POSIX root, warm"


def restore_table(timings: common.Timings, seen: dict, nbytes: dict[str, int],
                  anchors: list[str]) -> str:
    """Median restore time per tier, its GB/s, and how many times faster than each anchor
    (by GB/s, so a row measured at another size compares fairly)."""
    rate = {name: common.gbps(nbytes[name], common.median(t["restore"]))
            for name, t in timings.items()}
    headers = ["tier", "size", "last_restore", "bytes from root", "median s", "min..max s",
               "GB/s"] + [f"x {a}" for a in anchors if a in rate]
    rows = []
    for name, t in timings.items():
        s = t["restore"]
        tiers = sorted(seen.get(name, ()))
        cells = [name, common.format_size(nbytes[name]), ", ".join(tier for tier, _ in tiers)
                 or "-", ", ".join(str(b) for _, b in tiers) or "-",
                 f"{common.median(s):.3f}", f"{min(s):.3f}..{max(s):.3f}", f"{rate[name]:.2f}"]
        cells += [f"{rate[name] / rate[a]:.1f}" for a in anchors if a in rate]
        rows.append(cells)
    return common.markdown_table(headers, rows)


def goals(timings: common.Timings, nbytes: dict[str, int]) -> list[str]:
    def rate(name: str) -> float:
        return common.gbps(nbytes[name], common.median(timings[name]["restore"]))

    out = []
    for anchor, want in GOALS.items():
        if anchor not in timings:
            out.append(f"- memory vs {anchor}: not measured (goal >= {want:g}x)")
            continue
        got = rate("memory tier") / rate(anchor)
        out.append(f"- memory vs {anchor}: {got:.1f}x faster by GB/s (goal >= {want:g}x: "
                   f"{'met' if got >= want else 'NOT met'})")
    if RAW_SHM in timings and RAW_COLD in timings:
        out.append(f"- this machine's ceiling for that ratio: the {RAW_SHM} is "
                   f"{rate(RAW_SHM) / rate(RAW_COLD):.1f}x as fast as the {RAW_COLD} "
                   f"({RAW_THREADS} threads, {RAW_BLOCK >> 10} KiB blocks, each digested, "
                   "straight into one preallocated buffer: no parsing, planning or checks)")
    if NO_CHECKS in timings:
        ratio = (common.median(timings["memory tier"]["restore"])
                 / common.median(timings[NO_CHECKS]["restore"]))
        out.append(f"- authentication (the memory key's tag, owner checks): the memory tier's "
                   f"restore takes {ratio:.3f}x the time without them (medians; goal <= "
                   f"{GOAL_AUTH:g}x: {'met' if ratio <= GOAL_AUTH else 'NOT met'})")
    if RAW_SHM in timings:
        extra = (common.median(timings["memory tier"]["restore"])
                 - common.median(timings[RAW_SHM]["restore"]))
        more = "more" if extra >= 0 else "less"
        out.append(f"- the memory tier's restore takes {abs(extra) * 1e3:.0f} ms {more} than "
                   f"the {RAW_SHM} (medians)")
    return out


def check_cost(segment: str, key: bytes, reps: int = 200) -> str:
    """The checks of one restore timed on their own (load hides a few percent of a restore
    on a busy machine): the manifest's tag and the owner check of every file opened, against
    plain ``O_NOFOLLOW`` opens of the same files."""
    from ckpt._memory.private import check_dir, open_checked
    from ckpt._memory.tier import authenticate_manifest

    files = _data_files(os.path.join(segment, step_dir(1))) + [
        os.path.join(segment, step_dir(1), "manifest.json")]

    def checked() -> None:
        check_dir(os.path.join(segment, step_dir(1)))
        authenticate_manifest(segment, step_dir(1), key)
        for path in files:
            os.close(open_checked(path))

    def plain() -> None:
        for path in files:
            os.close(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC))

    times = {}
    for name, fn in (("checked", checked), ("plain", plain)) * 2:
        runs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        times[name] = common.median(runs)
    return (f"- the checks timed alone ({len(files)} files, manifest tag and owner checks): "
            f"{times['checked'] * 1e6:.0f} us per restore against {times['plain'] * 1e6:.0f} "
            f"us for plain opens of the same files (medians of {reps})")


def bench_restore(args) -> None:
    from bench_storage import start_moto

    server, endpoint, bucket = start_moto() if not args.no_s3 else (None, None, None)
    s3_options = {"client_kwargs": {"endpoint_url": endpoint}}
    os.makedirs(args.dir, exist_ok=True)
    try:
        for size in args.sizes:
            for shape in args.shapes:
                state = common.make_state(size, shape)
                nbytes = common.state_bytes(state)
                with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                    s3 = None if server is None else (
                        f"s3://{bucket}/mem-{uuid.uuid4().hex[:6]}", s3_options, args.s3_max)
                    tiers = Tiers(state, shape, tmp, s3)
                    try:
                        cases = [("memory tier", tiers.memory(True)),
                                 (NO_CHECKS, tiers.memory(True, checks=False))]
                        if not args.auth:
                            cases += [(NO_DIGESTS, tiers.memory(False)),
                                      (disk_name(tiers.cold), tiers.disk(True))]
                        if tiers.cold and not args.auth:
                            cases += [(disk_name(False), tiers.disk(False)),
                                      (RAW_COLD, tiers.raw(RAW_COLD))]
                        cases.append((RAW_SHM, tiers.raw(RAW_SHM)))
                        if s3 is not None and not args.auth:
                            cases.append(("S3 (moto)", tiers.s3))
                        timings = common.run_interleaved(
                            cases, args.reps, progress=f"restore {common.format_size(size)}")
                        cost = check_cost(tiers.segment, tiers.key)
                    finally:
                        tiers.close()
                label = f"{shape} ({common.SHAPES[shape]} tensors)"
                print(f"\n### Restore by tier: {common.format_size(nbytes)} per rank, {label}, "
                      f"one process, {args.reps} reps\n")
                print(restore_table(timings, tiers.seen, tiers.nbytes,
                                    [a for a in (*GOALS, RAW_COLD) if a in timings]))
                print("\n" + "\n".join(goals(timings, tiers.nbytes)))
                print(cost)
    finally:
        if server is not None:
            server.stop()


# -- two nodes: own memory, a peer's replica, cold disk -------------------------------------

NODES = ("benchA", "benchB")


def _aside(shm: str, job: str, node: str, back: bool) -> None:
    """Move a node's segments out of sight (its memory is lost) or back (instant: tmpfs)."""
    live, hidden = f"{PREFIX}{job}-{node}-", f".aside-{PREFIX}{job}-{node}-"
    for entry in os.listdir(shm):
        if not back and entry.startswith(live):
            os.rename(os.path.join(shm, entry), os.path.join(shm, f".aside-{entry}"))
        elif back and entry.startswith(hidden):
            target = os.path.join(shm, entry[len(".aside-"):])
            shutil.rmtree(target, ignore_errors=True)  # an empty one a restore made
            os.rename(os.path.join(shm, entry), target)


def peer_ranks(rank: int, world: int, size: int, reps: int, work: str, job: str) -> dict:
    """One rank of a two-node world: S bytes of row shards per rank, saved to memory (with a
    replica on the other node) and to a POSIX root; then, interleaved, restored by a new
    manager from its own node's memory, from the peer's replica after node B's memory is
    gone, and from the root with the page cache dropped. Times: the slowest rank's."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    local = common.make_state(size, "many", seed=rank)
    state = {k: DTensor.from_local(v, mesh, [Shard(0)]) for k, v in local.items()}
    dest = {k: DTensor.from_local(torch.zeros_like(v), mesh, [Shard(0)])
            for k, v in local.items()}
    mem_root, disk_root = os.path.join(work, "mem-root"), os.path.join(work, "disk-root")

    def manager(**kw) -> ckpt.CheckpointManager:
        tier = ckpt.MemoryTierOptions(node=NODES[rank], job=job, persist_every=1_000_000,
                                      replicas=1)
        return ckpt.CheckpointManager(mem_root, memory_tier=tier,
                                      schedule=ckpt.Schedule(handle_sigterm=False), **kw)

    with manager(async_save=False) as mgr:
        mgr.save(1, state)
        assert mgr.wait_replicated(600), "the replica was not stored"
        dist.barrier()
    with ckpt.CheckpointManager(disk_root, async_save=False,
                                schedule=ckpt.Schedule(handle_sigterm=False)) as mgr:
        mgr.save(1, state)
    cold = common.drop_page_cache() if rank == 0 else False
    cold = [cold]
    dist.broadcast_object_list(cold, src=0)
    names = ["own memory", "peer replica (node B's memory lost)", disk_name(cold[0])]
    out: dict = {"seconds": {n: [] for n in names}, "tiers": {n: set() for n in names},
                 "cold": cold[0]}
    for rep in range(reps):
        for name in [names[(rep + i) % len(names)] for i in range(len(names))]:
            if rank == 0 and name == names[1]:
                _aside(SEGMENTS, job, NODES[1], back=False)
            if rank == 0 and name == names[2] and cold[0]:
                common.drop_page_cache()
            for t in dest.values():
                t.to_local().zero_()
            dist.barrier()
            mgr = (ckpt.CheckpointManager(disk_root, read_only=True) if name == names[2]
                   else manager())
            with common.Stopwatch() as sw:
                step = mgr.restore(dest)
            info = mgr.last_restore
            mgr.close()
            assert step == 1 and all(torch.equal(dest[k].to_local(), local[k]) for k in local)
            out["tiers"][name].add((info.tier, info.bytes_from_storage))
            times: list = [None] * world
            dist.all_gather_object(times, sw.seconds)
            out["seconds"][name].append(max(times))
            dist.barrier()
            if rank == 0 and name == names[1]:
                _aside(SEGMENTS, job, NODES[1], back=True)
            dist.barrier()
    return out


def bench_peer(args) -> None:
    from tests.support.ranks import run_ranks

    for size in args.sizes:
        job = f"bench{uuid.uuid4().hex[:10]}"
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            try:
                results = run_ranks(2, peer_ranks, size, args.reps, tmp, job, timeout=3600)
            finally:
                for entry in os.listdir(SEGMENTS):
                    if job in entry:
                        shutil.rmtree(os.path.join(SEGMENTS, entry), ignore_errors=True)
        r0 = results[0]
        timings = {name: {"restore": secs} for name, secs in r0["seconds"].items()}
        seen = {name: set().union(*(r["tiers"][name] for r in results)) for name in timings}
        nbytes = size  # per rank
        disk = disk_name(r0["cold"])
        print(f"\n### Restore by tier at world 2: {common.format_size(nbytes)} per rank "
              f"(row shards, 256 tensors), two nodes of one process each, {args.reps} reps\n")
        print(restore_table(timings, seen, {name: nbytes for name in timings}, [disk]))
        mem, peer = (common.median(timings[n]["restore"]) for n in list(timings)[:2])
        speed = common.median(timings[disk]["restore"]) / peer
        print(f"\n- the peer replica restores at {speed:.2f}x the speed of the {disk}; own "
              f"memory at {peer / mem:.2f}x the speed of the peer "
              "replica (the slowest rank's time; GB/s per rank)")


# -- the recovery timeline -----------------------------------------------------------------

GOAL_RECOVERY_S = 2.0
SCENARIOS = {"worker": "worker killed (agent alive), world 1 -> 1",
             "node": "node killed, world 3 -> 2"}


#: The timeline's runs: (column, warm restarts, memory tier).
TIMELINE_CONFIGS = [("cold start, memory tier", False, True),
                    ("warm start (trainer.warm), memory tier", True, True),
                    ("cold start, no memory tier", False, False),
                    ("warm start, no memory tier", True, False)]


def timeline_run(work: Path, scenario: str, memory: bool, args, warm: bool = False) -> dict:
    """One job, one kill; the times of the recovery (seconds after the kill). ``warm``:
    the agents start the workers through ``-m trainer.warm`` (forked from a zygote)."""
    from tests.support import memory_job as jobs
    from tests.support.elastic_job import progress, wait_for
    from bench_elastic import agent_events, attempt_times
    from trainer.elastic import read_jsonl

    memjob = f"bt{uuid.uuid4().hex[:10]}"
    nodes_n = 1 if scenario == "worker" else 3
    job_args = ["--root", str(work / "ckpt"), "--run-dir", str(work / "run"), "--digests",
                str(work / "digests"), "--steps", str(args.timeline_steps), "--every", "5",
                "--memory-job", memjob, "--memory", "on" if memory else "off",
                "--sample-sleep", "0.01", "--pad-mb", str(args.pad_mb)]
    if nodes_n > 1:
        job_args += ["--hold-until-world", str(nodes_n)]
    # torchrun's own monitor interval (0.1 s; the tests' harness polls every 0.5 s)
    c = jobs.Cluster(work, job_args, memjob, nnodes="1:1" if nodes_n == 1 else "2:3",
                     extra_env={"LOGLEVEL": "INFO"}, warm=warm, monitor_interval=0.1)
    kill_at = args.timeline_steps // 3 + 3
    try:
        nodes = [c.add_node() for _ in range(nodes_n)]

        def ready():
            p = progress(work / "run")
            a = max(p) if p else None
            return a is not None and p[a]["world"] == nodes_n and len(
                p[a]["pids"]) == nodes_n and p[a]["step"] >= kill_at and p[a]

        info = wait_for(ready, 300, f"training at world {nodes_n}", cluster=c)
        pid = info["pids"][min(1, nodes_n - 1)]
        if scenario == "worker":
            killed_at = time.time()
            os.kill(pid, signal.SIGKILL)
            survivors = nodes
        else:
            # a warm worker is its zygote's child: its node is the one of its launcher
            victim = c.node_of(_launcher_of(work / "run", pid) if warm else pid)
            killed_at = victim.kill(signal.SIGKILL)
            if warm:  # the node's zygote and workers go with it
                os.kill(pid, signal.SIGKILL)
            lost = c.node_name(c.nodes.index(victim))
            for entry in os.listdir(SEGMENTS):  # the node's RAM went with it
                if entry.startswith(f"{PREFIX}{memjob}-{lost}-"):
                    shutil.rmtree(os.path.join(SEGMENTS, entry), ignore_errors=True)
            survivors = [n for n in nodes if n is not victim]
        for n in survivors:
            n.proc.wait(timeout=300)
        codes = [n.proc.returncode for n in survivors]
        logs = "\n".join(n.log() for n in survivors)
    finally:
        c.close()
        for entry in os.listdir(SEGMENTS):
            if entry.startswith(f"{PREFIX}{memjob}-"):
                shutil.rmtree(os.path.join(SEGMENTS, entry), ignore_errors=True)
    p = progress(work / "run")
    nxt_attempt = max(p)
    nxt = attempt_times(work / "run", nxt_attempt)
    recs = [r for f in (work / "run" / f"attempt-{nxt_attempt:04d}").glob("rank-*.jsonl")
            for r in read_jsonl(f)]
    starts = [r for r in recs if r["event"] == "start"]
    restored = [r for r in recs if r["event"] == "restored"]
    exits = [t for t in agent_events(logs, "failed (exitcode") if t > killed_at]
    rdzv = [t for t in agent_events(logs, "Rendezvous complete") if t > killed_at]
    k = killed_at
    forked = [r for r in starts if r.get("zygote")]
    out = {
        "ok": set(codes) == {0},
        "killed_step": info["step"],
        "restored_step": restored[0]["step"] if restored else None,
        "tier": ",".join(sorted({r.get("tier") or "-" for r in restored})),
        "bytes": sum(r.get("bytes_from_storage") or 0 for r in restored),
        "warm": f"{len(forked)} of {len(starts)}",
        "exit": max(exits) - k if exits else None,
        "rdzv": max(rdzv) - k if rdzv else None,
        # the process torchrun started: the launcher of a warm start, else the worker
        "spawn": min(r.get("launcher_start") or r["process_start"] for r in starts) - k,
        "forked": (max(r["process_start"] for r in forked) - k) if forked else None,
        "created": max(r["created"] for r in starts) - k,
        "group": nxt["group"] - k,
        "built": nxt["built"] - k,
        "restore_start": max(r["started"] for r in restored) - k,
        "restored": nxt["restored"] - k,
        "first_step": nxt["first_step"] - k,
    }
    out["torchrun"] = (out["rdzv"] - out["exit"]) if None not in (out["rdzv"], out["exit"]) \
        else None
    out["recovery"] = out["first_step"] - (out["torchrun"] or 0.0)
    return out


def _launcher_of(run_dir: Path, worker: int) -> int:
    """The launcher (trainer.warm) of a warm worker, from its start record."""
    from trainer.elastic import read_jsonl

    return next(r["launcher"] for p in run_dir.glob("attempt-*/rank-*.jsonl")
                for r in read_jsonl(p) if r["event"] == "start" and r["pid"] == worker)


TIMELINE_ROWS = [
    ("agents see their workers exit (last)", "exit"),
    ("rendezvous complete (last agent)", "rdzv"),
    ("new worker processes start (first; warm: the launcher)", "spawn"),
    ("warm: worker forked from the zygote (last rank)", "forked"),
    ("trainer constructed: imports done (last rank)", "created"),
    ("process group formed", "group"),
    ("model, DDP, optimizer built", "built"),
    ("restore begins", "restore_start"),
    ("checkpoint restored", "restored"),
    ("first step finished", "first_step"),
]


def timeline_median(reps: list[dict]) -> dict:
    """The median of each time over the repetitions of one configuration (the other
    fields from the first; ``ok`` only if every run finished)."""
    out = dict(reps[0])
    for key in {k for _, k in TIMELINE_ROWS} | {"torchrun", "recovery"}:
        values = [r[key] for r in reps if r.get(key) is not None]
        out[key] = common.median(values) if values else None
    out["ok"] = all(r["ok"] for r in reps)
    out["each"] = [r["recovery"] for r in reps]
    out["restore_s"] = common.median([r["restored"] - r["restore_start"] for r in reps])
    return out


def timeline_table(runs: dict[str, dict]) -> str:
    def cell(r: dict, key: str) -> str:
        return "-" if r.get(key) is None else f"{r[key]:.2f}"

    headers = ["seconds after the kill"] + list(runs)
    rows = [[what] + [cell(r, key) for r in runs.values()] for what, key in TIMELINE_ROWS]
    rows += [["killed at step / restored step"] + [
        f"{r['killed_step']} / {r['restored_step']}" for r in runs.values()],
        ["restored from (tier), bytes from root"] + [
        f"{r['tier']}, {r['bytes']}" for r in runs.values()],
        ["workers forked from a zygote"] + [r["warm"] for r in runs.values()],
        ["torchrun's rendezvous (excluded)"] + [cell(r, "torchrun") for r in runs.values()],
        ["**recovery, rendezvous excluded**"] + [cell(r, "recovery") for r in runs.values()]]
    if any(len(r.get("each", [])) > 1 for r in runs.values()):
        rows.append(["recovery of each run"] + [
            " ".join(f"{v:.2f}" for v in r.get("each", [])) for r in runs.values()])
    rows.append(["job finished"] + ["yes" if r["ok"] else "FAILED" for r in runs.values()])
    return common.markdown_table(headers, rows)


def bench_timeline(args) -> None:
    scenarios = ["worker"] if args.quick else list(SCENARIOS)
    configs = TIMELINE_CONFIGS[:2] if args.quick else TIMELINE_CONFIGS
    for scenario in scenarios:
        reps: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
        with tempfile.TemporaryDirectory(prefix="bench-memory-timeline-") as tmp:
            for rep in range(args.timeline_reps):  # interleaved: A B C D, A B C D, ...
                for i, (name, warm, memory) in enumerate(configs):
                    print(f"  [timeline {scenario} {rep + 1}/{args.timeline_reps}] {name} "
                          f"(load {common.load_average()})", file=sys.stderr, flush=True)
                    reps[name].append(timeline_run(Path(tmp) / f"{scenario}-{i}-{rep}",
                                                   scenario, memory, args, warm=warm))
        runs = {name: timeline_median(r) for name, r in reps.items()}
        print(f"\n### Recovery timeline: {SCENARIOS[scenario]}, tiny LM"
              + (f" + {args.pad_mb:g} MB" if args.pad_mb else "")
              + f", {args.timeline_steps} steps, checkpoint every 5; "
              + (f"medians of {args.timeline_reps} interleaved runs"
                 if args.timeline_reps > 1 else "one run each")
              + f" (load {common.load_average()})\n")
        print(timeline_table(runs))
        for name, warm, memory in configs:
            if not memory:
                continue
            r = runs[name]
            print(f"\n- {name}: recovery, torchrun's rendezvous excluded: "
                  f"{r['recovery']:.2f} s (goal < {GOAL_RECOVERY_S:g} s: "
                  f"{'met' if r['recovery'] < GOAL_RECOVERY_S else 'NOT met'}); of which "
                  f"the restore {r['restore_s']:.2f} s")


def main() -> None:
    def extra(p):
        p.set_defaults(sizes="1G", shapes="many")
        p.add_argument("--quick", action="store_true",
                       help="512 MiB (fixed costs would hide the ratios at less), 2 reps; "
                            "the timeline of a killed worker only")
        p.add_argument("--no-s3", action="store_true", help="skip the S3 (moto) tier")
        p.add_argument("--auth", action="store_true",
                       help="only the memory tier with and without its authentication and "
                            "owner checks (and the raw read), one process; no S3, peers or "
                            "timeline")
        p.add_argument("--s3-max", type=common.parse_size, default=common.parse_size("256M"),
                       help="the S3 tier's state is at most this big (moto fails large "
                            "uploads on a busy machine; default 256M)")
        p.add_argument("--no-restore", action="store_true", help="skip the restore tables")
        p.add_argument("--no-peer", action="store_true", help="skip the world-2 restore table")
        p.add_argument("--no-timeline", action="store_true", help="skip the timeline")
        p.add_argument("--timeline-steps", type=int, default=60)
        p.add_argument("--timeline-reps", type=int, default=1,
                       help="timeline: runs of each configuration (interleaved; medians)")
        p.add_argument("--pad-mb", type=float, default=0.0,
                       help="timeline: checkpoint this many MB besides the tiny LM")
        p.add_argument("--save-cost", action="store_true",
                       help="only what a save costs training: the memory tier against "
                            "GEMINI's capture and the copy floor (memory_save_cost.py; "
                            "default sizes 256M,1G, 5 reps)")
        p.add_argument("--save-memory-probe", help=argparse.SUPPRESS)

    args = common.parse_args(__doc__.splitlines()[0], 3, extra)
    if args.save_memory_probe:  # a child of --save-cost: one method's resident memory
        print(json.dumps(memory_save_cost.memory_probe(args.save_memory_probe, args.sizes[0],
                                                       args.dir)))
        return
    if args.save_cost:
        if "--sizes" not in sys.argv:
            args.sizes = [common.parse_size("256M"), common.parse_size("1G")]
        if "--reps" not in sys.argv:
            args.reps = 5
        print(f"# bench_memory_tier --save-cost  ({common.machine_description()}; load "
              f"{common.load_average()}; code {common.code_version()})\n")
        print(memory_save_cost.run(args))
        print(common.GATE.summary())
        print(f"\nload average at the end: {common.load_average()}")
        return
    if args.auth:
        args.no_s3 = args.no_peer = args.no_timeline = True
    if args.quick:
        args.sizes, args.reps = [common.parse_size("512M")], min(args.reps, 2)
        args.timeline_steps = min(args.timeline_steps, 40)
    print(f"# bench_memory_tier  ({common.machine_description()}; load "
          f"{common.load_average()}; code {common.code_version()})")
    if not args.no_restore:
        bench_restore(args)
        print("\n" + common.GATE.summary())
        if not args.no_peer:
            bench_peer(args)
    if not args.no_timeline:
        bench_timeline(args)
    print(f"\nload average at the end: {common.load_average()}")


if __name__ == "__main__":
    main()
