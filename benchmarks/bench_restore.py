"""Restore under a process group, and a cold load, against their floors and DCP.

Two parts, each in one run with its methods interleaved, medians and ratios:

* ``ddp``: ``--world`` (default 4) gloo ranks on this machine, each holding the same
  replicated state (DDP), save one step, then restore the newest step into every rank
  (``CheckpointManager.restore``). Rows: the cooperative restore (each rank reads its share
  of the chunks from the root, the ranks exchange the rest over gloo), the plain restore
  (every rank reads every chunk), and world 1 (rank 0 alone, the others idle). Reported:
  the slowest rank's time, and the bytes read from the root summed over the ranks as
  ``last_restore.ranks`` counts them, against the checkpoint's size. Before each repetition
  the checkpoint's pages are evicted from the page cache (``POSIX_FADV_DONTNEED``: no root
  needed), so the root is read cold.
* ``ddp-s3``: the same with the root on S3 (moto's server on loopback, started here): an
  object store has no page cache shared by the ranks, each read is a request, and N ranks
  reading the whole state make N times the requests and bytes. There the cooperative restore
  is what ``restore()`` does by default. One more column there: the bytes the store's
  responses carried, summed over the ranks (``last_restore`` counts what the load asked
  for; the storage's read cache fetches whole 8 MiB blocks around small reads).
* ``cold``: one process. ``ckpt.load`` into a state whose item is a dict of tensors (the
  load reads each chunk once into new tensors, digested as it lands, and hands them over
  only once every chunk passed), ``ckpt.load`` in place into the live tensors of a stateful
  object (every chunk verified before the first live byte changes: verified, then read
  again from the page cache; and the same with ``ckpt._load.staging.STAGE_FILE_SYSTEMS``
  on: read once into staging memory, then copied), ``CheckpointManager.restore`` of the
  newest step (one pass, digested where it lands), ``torch.distributed.checkpoint.load`` of
  the same state saved by ``dcp.save``, and a raw read of ckpt's own data files straight
  into the destinations (one thread per file, as ckpt reads them), each with the files
  evicted from the page cache first. Two more anchors: "raw read into new tensors" (the
  floor of a load that hands over new tensors, whose pages a read touches for the first
  time), and "raw, read twice": the same raw read, then again from the page cache: the
  floor of a load into live tensors that checks every byte before the first live one
  changes without staging the state (docs/design.md, "Loading: verify, then apply"); the
  same with the second read on every core (each file cut into contiguous runs, as ckpt's
  apply pass reads it: a page-cache read is a memory copy, bound by the CPU). Beside the
  table: each case's CPU split into user time (interpreter, planning, digests) and system
  time (the kernel's copies, page faults), and its minor page faults with the number of reps
  whose destinations were fresh pages (a cost this VM's allocator hands to any method).

On this machine the "disk" is the host's page cache behind a virtual disk, and 2 cores
serve every process: a world of 4 ranks shares them, and gloo's loopback transfers cost
CPU that a read from a warm cache does not. The bytes from the root are what the
cooperative restore saves on shared storage (Lustre, S3), where N ranks reading the whole
state cost N times the bytes.

Run from the repository root::

    python benchmarks/bench_restore.py [--parts ddp,ddp-s3,cold] [--sizes 256M] [--reps 5]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import resource
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (puts the repository root on sys.path too)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import ckpt  # noqa: E402
import ckpt.inspect  # noqa: E402

warnings.filterwarnings("ignore", "torch.distributed is disabled")


def evict(path: str) -> None:
    """Drop ``path``'s files (a file or a directory tree) from the page cache."""
    files = [path] if os.path.isfile(path) else [
        os.path.join(d, f) for d, _, names in os.walk(path) for f in names]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def restored(step: int | None, root: str) -> None:
    """A restore that found no committed step returns None and leaves the state as it was:
    say so, rather than report the state as not bit-exact."""
    assert step == 1, f"restore() of {root} loaded step {step}, not step 1: is the root gone?"


def set_cooperative(on: bool) -> None:
    """Switch the cooperative restore on or off in this process (a benchmark switch)."""
    try:
        from ckpt._load import cooperative
    except ImportError:  # code without it: every restore is plain
        return
    cooperative.MODE = "always" if on else "never"


# -- part ddp: world N gloo ranks -------------------------------------------------------------

def count_fetched() -> list[int]:
    """Count, in this process, the bytes an object store's requests return (what crossed
    the network, whole blocks of the storage's read cache included; ``last_restore``
    counts the bytes the load asked for): a one-item list the counts add to."""
    from storage_backends.fsspec_store import FsspecStorage

    fetched = [0]
    real_range, real_ranges = FsspecStorage._range, FsspecStorage._cat_ranges

    def counted_range(self, *args):
        data = real_range(self, *args)
        fetched[0] += len(data)
        return data

    def counted_ranges(self, *args):
        pieces = real_ranges(self, *args)
        fetched[0] += sum(len(p) for p in pieces)
        return pieces

    FsspecStorage._range, FsspecStorage._cat_ranges = counted_range, counted_ranges
    return fetched


def _ddp_rank(rank: int, world: int, store: str, root: str, nbytes: int, shape: str,
              reps: int, out: str, options: dict | None = None) -> None:
    """One rank of part ddp; ``root`` a directory, or an object store's URL with its
    ``options`` (nothing to evict there: every read is a request)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    fetched = count_fetched() if options is not None else [0]
    source = common.make_state(nbytes, shape)
    with ckpt.CheckpointManager(root, async_save=False, storage_options=options) as mgr:
        mgr.save(1, {"model": source}, force=True)
    size = sum(ckpt.inspect.open(root, storage_options=options).manifest(1).files.values())
    alone = dist.new_group([0])
    dest = {"model": common.empty_like_state(source)}
    mgr = ckpt.CheckpointManager(root, read_only=True, storage_options=options)
    solo = ckpt.CheckpointManager(root, read_only=True, process_group=alone,
                                  storage_options=options) if rank == 0 else None

    def restore(case: str) -> tuple[float, int]:
        fetched[0] = 0
        for t in dest["model"].values():
            t.zero_()
        if rank == 0 and options is None:
            evict(root)
        dist.barrier()
        if case == "world 1 (rank 0 alone)":
            took, nread = 0.0, 0
            if rank == 0:
                t0 = time.perf_counter()
                restored(solo.restore(dest), root)
                took = time.perf_counter() - t0
                nread = solo.last_restore.bytes_from_storage
                assert common.same_values(source, dest["model"])
            dist.barrier()
            return took, nread
        set_cooperative(case.startswith("cooperative"))
        t0 = time.perf_counter()
        step = mgr.restore(dest)
        took = time.perf_counter() - t0
        restored(step, root)
        assert common.same_values(source, dest["model"]), "a restore was not bit-exact"
        return took, sum(b for _, b in mgr.last_restore.ranks)

    cases = ["cooperative", "plain (every rank reads all)", "world 1 (rank 0 alone)"]
    results: dict[str, list[tuple[float, int]]] = {c: [] for c in cases}
    for c in cases:  # warm the code paths (not timed)
        restore(c)
    for rep in range(reps):
        for c in [cases[(rep + i) % len(cases)] for i in range(len(cases))]:
            took, nread = restore(c)
            everyone = [None] * world
            dist.all_gather_object(everyone, (took, fetched[0]))
            results[c].append((max(t for t, _ in everyone), nread,
                               sum(f for _, f in everyone)))
    mgr.close()
    if solo is not None:
        solo.close()
    if rank == 0:
        torch.save({"results": results, "size": size}, out)
    dist.barrier()
    dist.destroy_process_group()


def part_ddp(args: argparse.Namespace, base: str, nbytes: int, shape: str,
             s3: bool = False) -> str:
    """World ``--world`` against world 1; ``s3``: the root on S3 (moto's server)."""
    work = common.fresh_dir(os.path.join(base, f"ddp-{shape}-{nbytes}-{int(s3)}"))
    out = os.path.join(work, "results.pt")
    store = os.path.join(work, "store")
    server, root, options = None, os.path.join(work, "root"), None
    if s3:
        from bench_storage import start_moto

        try:
            server, endpoint, bucket = start_moto()
        except ImportError as e:  # moto and boto3 come with the test extra
            return f"\n(part ddp-s3 skipped: {e}; pip install -e '.[test]')\n"
        root, options = f"s3://{bucket}/ddp", {"client_kwargs": {"endpoint_url": endpoint}}
    try:
        mp.spawn(_ddp_rank, args=(args.world, store, root, nbytes, shape, args.reps, out,
                                  options), nprocs=args.world, join=True)
    finally:
        if server is not None:
            server.stop()
    data = torch.load(out)
    size = data["size"]
    rows = []
    anchor = common.median([t for t, _, _ in data["results"]["world 1 (rank 0 alone)"]])
    for name, runs in data["results"].items():
        took = common.median([t for t, _, _ in runs])
        nread = common.median([n for _, n, _ in runs])
        sent = common.median([f for _, _, f in runs])
        rows.append([name, f"{took:.3f}", f"{min(t for t, _, _ in runs):.3f}.."
                     f"{max(t for t, _, _ in runs):.3f}", f"{nread / size:.2f}"]
                    + ([f"{sent / size:.2f}"] if s3 else []) + [f"{took / anchor:.2f}"])
    common.remove(work)
    where = ("the root on S3 (moto's server on loopback: one Python process, every read a "
             "request)" if s3 else "root read cold")
    return (f"\n### world {args.world} (gloo), DDP restore of {common.format_size(nbytes)} "
            f"({shape}: {common.SHAPES[shape]} tensors), {where}; median of "
            f"{args.reps}, interleaved\n\n" + common.markdown_table(
                ["method", "median s (slowest rank)", "min..max s",
                 "bytes from the root, all ranks / checkpoint"]
                + (["bytes the store sent, all ranks / checkpoint"] if s3 else [])
                + ["time / world 1"], rows) + "\n")


# -- part cold: one process -------------------------------------------------------------------

class Holder:
    """A stateful object holding tensors by name: a load writes them in place."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.sd = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.sd

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for k, v in sd.items():
            if v is not self.sd[k]:  # (a load in place hands back the live tensors)
                self.sd[k].copy_(v)


def _raw_read(paths: list[str], dests: list[list[tuple[int, memoryview]]],
              streams: int = 1) -> None:
    """Each file's data bytes straight into their destinations, in file order, one thread
    per file; with ``streams``, each file's destinations cut into that many contiguous runs,
    one thread each (as ckpt's apply pass reads the page cache on every core)."""
    def one(path: str, views: list[tuple[int, memoryview]]) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            for pos, view in views:
                while view:
                    n = os.preadv(fd, [view], pos)
                    if n == 0:
                        raise EOFError(path)
                    pos, view = pos + n, view[n:]
        finally:
            os.close(fd)

    jobs = []
    for path, views in zip(paths, dests):
        size = -(-len(views) // streams) or 1
        jobs += [(path, views[i:i + size]) for i in range(0, len(views), size)]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        list(pool.map(one, *zip(*jobs)))


def part_cold(args: argparse.Namespace, base: str, nbytes: int, shape: str) -> str:
    import torch.distributed.checkpoint as dcp
    from ckpt._step.integrity import read_manifest
    from storage_backends import PosixStorage

    # One intra-op thread: on 2 cores shared with other jobs, OpenMP's spinning threads made
    # dcp.load's per-tensor copy_ 4-5x slower than one thread (measured while writing this).
    torch.set_num_threads(1)
    work = common.fresh_dir(os.path.join(base, f"cold-{shape}-{nbytes}"))
    source = common.make_state(nbytes, shape)
    one = os.path.join(work, "one")
    ckpt.save({"model": source}, one, step=1)
    root = os.path.join(work, "root")
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"model": source}, force=True)
    dcp_path = os.path.join(work, "dcp")
    dcp.save({"model": source}, checkpoint_id=dcp_path, no_dist=True)
    manifest = read_manifest(PosixStorage(work, create=False), "one")
    dest = {"model": common.empty_like_state(source)}
    chunks = sorted((c.file, c.start, key.split("/", 1)[1], c.offsets[0], c.shape[0])
                    for key, entry in manifest.tensors.items() for c in entry.chunks)
    files = sorted({c[0] for c in chunks})
    paths = [os.path.join(one, f) for f in files]

    def raw_read(into: dict[str, torch.Tensor] | None = None, streams: int = 1) -> None:
        """ckpt's data files read straight into the destinations (which a load may have
        replaced: taken afresh each time), as ckpt's chunks lay them out."""
        into = dest["model"] if into is None else into
        views = {f: [] for f in files}
        for f, start, name, row, rows in chunks:
            views[f].append((start, common.byte_view(into[name][row:row + rows])))
        _raw_read(paths, [views[f] for f in files], streams)

    # the second read of "raw, read twice" on every core (as ckpt's apply pass cuts it)
    streams = max(1, len(os.sched_getaffinity(0)) // len(files))

    def raw_read_new() -> None:
        """The same read into new tensors that then replace the old ones, as a load into
        new tensors does (their pages are touched for the first time by the read)."""
        new = {name: torch.empty_like(t) for name, t in dest["model"].items()}
        raw_read(new)
        dest["model"] = new

    # The same tensors held by a stateful object: a load writes them in place.
    live_one = os.path.join(work, "one-live")
    ckpt.save({"model": Holder(source)}, live_one, step=1)
    live = {"model": Holder(common.empty_like_state(source))}

    def live_load(staged: bool) -> None:
        from ckpt._load import staging
        staging.STAGE_FILE_SYSTEMS = staged
        try:
            ckpt.load(live, live_one)
        finally:
            staging.STAGE_FILE_SYSTEMS = False

    reader = ckpt.CheckpointManager(root, read_only=True)

    def case(name: str, path: str, load, into: dict = dest) -> tuple[str, object]:
        def run(rep: int) -> dict[str, float]:
            held = into["model"].sd if into is live else into["model"]
            for t in held.values():
                t.zero_()
            evict(path)
            before = resource.getrusage(resource.RUSAGE_SELF)
            with common.Stopwatch() as sw:
                load()
            after = resource.getrusage(resource.RUSAGE_SELF)
            held = into["model"].sd if into is live else into["model"]
            assert common.same_values(source, held), f"{name} was not bit-exact"
            return {"s": sw.seconds, "cpu": sw.cpu_seconds,
                    "user": after.ru_utime - before.ru_utime,
                    "sys": after.ru_stime - before.ru_stime,
                    "faults": after.ru_minflt - before.ru_minflt}
        return name, run

    cases = [
        case("raw read of ckpt's files", one, raw_read),
        case("raw, read twice (cold, then from the page cache)", one,
             lambda: (raw_read(), raw_read())),
        case(f"raw, read twice (the second on {streams} threads per file)", one,
             lambda: (raw_read(), raw_read(streams=streams))),
        case("raw read into new tensors", one, raw_read_new),
        case("ckpt.load into new tensors (one read)", one, lambda: ckpt.load(dest, one)),
        case("ckpt.load in place (verify, then read again)", live_one,
             lambda: live_load(False), live),
        case("ckpt.load in place, staged (one read, then copy)", live_one,
             lambda: live_load(True), live),
        case("ckpt restore(), newest step (one pass)", root,
             lambda: restored(reader.restore(dest), root)),
        case("dcp.load", dcp_path, lambda: dcp.load(dest, checkpoint_id=dcp_path,
                                                    no_dist=True)),
    ]
    for _, fn in cases:
        fn(0)
    timings = common.run_interleaved(cases, args.reps, progress=f"cold {shape} {nbytes}")
    reader.close()
    rows = [common.Row(n, t["s"], t["cpu"]) for n, t in timings.items()]
    # Fresh pages cost more than the copy into them on this VM (its balloon reports freed
    # pages to the host, which takes them back: the next touch of one is a host fault too).
    # Whether a rep's destinations are fresh is up to the allocator, not the method: a rep
    # that faulted in most of the state's pages (memory recycled costs none) is counted, so
    # a median it moved can be told from a slow method.
    fresh = common.state_bytes(source) // resource.getpagesize() // 2
    faults = "; ".join(
        f"{n}: {common.median(t['faults']) / 1000:.0f}k, "
        f"{sum(f > fresh for f in t['faults'])} of {len(t['faults'])}"
        for n, t in timings.items())
    # user: the interpreter, planning, digests; system: the kernel's copies out of the page
    # cache and page faults. The system time of the same cold read moves 2-3x from rep to
    # rep under load, whatever the method, so a median can flip with a few slow reps; the
    # minimum is the cost with the least interference.
    split = "; ".join(f"{n}: {common.median(t['user']):.2f} / {common.median(t['sys']):.2f}"
                      f" (min {min(t['cpu']):.2f})" for n, t in timings.items())
    common.remove(work)
    return (f"\n### cold load of {common.format_size(nbytes)} ({shape}: "
            f"{common.SHAPES[shape]} tensors, {len(paths)} data files); median of "
            f"{args.reps}, interleaved\n\n" + common.throughput_table(
                rows, common.state_bytes(source),
                anchors=["raw read of ckpt's files", "raw read into new tensors", "dcp.load"])
            + "\n\n(x anchor: throughput ratio, > 1 is faster than the anchor; the in-place "
            "rows load a copy of the same tensors saved from a stateful object)\n\n"
            f"minor page faults per load, median, and the reps that faulted in fresh pages "
            f"for over half the state: {faults}\n\n"
            f"CPU s per load, user / system, medians (the least CPU of a rep): {split}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="ddp,ddp-s3,cold")
    parser.add_argument("--sizes", default="256M")
    parser.add_argument("--shapes", default="many")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=common.DEFAULT_DIR)
    args = parser.parse_args()
    sizes = [common.parse_size(s) for s in args.sizes.split(",") if s]
    shapes = [s for s in args.shapes.split(",") if s]
    # A directory of this run's own: two runs given the same --dir (the default is shared by
    # everyone working in the tree) must not remove or rewrite each other's checkpoints.
    os.makedirs(args.dir, exist_ok=True)
    base = tempfile.mkdtemp(prefix="restore-", dir=args.dir)
    print(f"machine: {common.machine_description()}; load {common.load_average()}; "
          f"code {common.code_version()}")
    try:
        for part in args.parts.split(","):
            for nbytes in sizes:
                for shape in shapes:
                    fn = {"ddp": part_ddp, "cold": part_cold,
                          "ddp-s3": lambda *a: part_ddp(*a, s3=True)}[part]
                    print(fn(args, base, nbytes, shape), flush=True)
    finally:
        common.remove(base)
    print(f"load average at the end: {common.load_average()}")


if __name__ == "__main__":
    main()
