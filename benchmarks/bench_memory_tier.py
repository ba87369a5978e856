"""The memory tier (issue #14): restore time by tier, and the elastic recovery timeline.

1. **Restore by tier**: the same state (``--sizes``, default 1 GiB per rank) restored by a
   ``CheckpointManager`` from

   - the memory tier (the segment in ``/dev/shm`` that an earlier process published, as a
     worker restarted by torchrun finds it);
   - a peer's replica (the shards of a lost node, from another node's memory): a row marked
     "not built" until peer replication exists in ``ckpt``;
   - the POSIX root with the page cache dropped before each restore ("cold", needs root;
     otherwise the row says "warm") and, for reference, with a warm page cache;
   - S3 (moto's server on loopback, as in bench_storage.py: a Python server, so the S3
     figure says more about moto than about AWS).

   Every restore checks every chunk's digest, whatever the tier; the table also shows the
   tier ``mgr.last_restore`` reported and the bytes it read from the persistent root.
   Methods run interleaved (A B C D, B C D A, ...); medians over ``--reps``. Goals: memory
   >= 10x faster than S3 and >= 3x faster than a cold local disk.

Run from the repository root::

    python benchmarks/bench_memory_tier.py [--sizes 1G] [--reps 3] [--quick]

It never asserts on timings.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (puts the repository root on sys.path too)

import ckpt  # noqa: E402
from ckpt.memory_tier import PREFIX, SHM_DIR  # noqa: E402
from storage_backends import open_storage  # noqa: E402

logging.getLogger("werkzeug").setLevel(logging.ERROR)
logging.getLogger("ckpt").setLevel(logging.ERROR)  # "segment kept: step in memory only"

GOALS = {"S3 (moto)": 10.0, "POSIX root, cold": 3.0}  # memory at least this many times faster
NOT_BUILT = "peer replica"


def peer_supported() -> bool:
    """Whether ``ckpt`` replicates to peers yet (the ``replicas=`` keyword)."""
    import inspect

    return "replicas" in inspect.signature(ckpt.CheckpointManager).parameters


class Tiers:
    """One state saved once per tier; ``case(name)`` restores it from there (timed)."""

    def __init__(self, state, workdir: str, s3: tuple[str, dict] | None) -> None:
        self.state, self.dest = state, common.empty_like_state(state)
        self.job = f"bench{uuid.uuid4().hex[:10]}"
        self.mem_root = os.path.join(workdir, "mem-root")
        self.disk_root = os.path.join(workdir, "disk-root")
        self.cold = common.drop_page_cache()
        # A step in memory only (persist_every not reached): its segment outlives the
        # manager, as it outlives a killed worker.
        with ckpt.CheckpointManager(self.mem_root, memory_tier=True, persist_every=1_000_000,
                                    memory_job=self.job, async_save=False,
                                    handle_sigterm=False) as mgr:
            mgr.save(1, state)
        with ckpt.CheckpointManager(self.disk_root, async_save=False,
                                    handle_sigterm=False) as mgr:
            mgr.save(1, state)
        self.s3_root = None
        if s3 is not None:
            url, options = s3
            self.s3_root = open_storage(url, create=True, storage_options=options)
            with ckpt.CheckpointManager(self.s3_root, async_save=False,
                                        handle_sigterm=False) as mgr:
                mgr.save(1, state)
        self.seen: dict[str, set[tuple[str, int]]] = {}

    def _restore(self, name: str, mgr: ckpt.CheckpointManager) -> dict[str, float]:
        for t in self.dest.values():  # outside the timed part: nothing left from a rep before
            t.zero_()
        with common.Stopwatch() as sw:
            step = mgr.restore(self.dest)
        assert step == 1 and common.same_values(self.state, self.dest), name
        info = mgr.last_restore
        self.seen.setdefault(name, set()).add((info.tier, info.bytes_from_storage))
        return {"restore": sw.seconds}

    def memory(self, rep: int) -> dict[str, float]:
        # A new manager with the job's id: what a restarted worker builds.
        with ckpt.CheckpointManager(self.mem_root, memory_tier=True, persist_every=1_000_000,
                                    memory_job=self.job, handle_sigterm=False) as mgr:
            return self._restore("memory tier", mgr)

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
        for entry in os.listdir(SHM_DIR):
            if entry.startswith(f"{PREFIX}{self.job}-"):
                shutil.rmtree(os.path.join(SHM_DIR, entry), ignore_errors=True)
        if self.s3_root is not None:
            self.s3_root.delete("")


def disk_name(cold: bool) -> str:
    return "POSIX root, cold" if cold else "POSIX root, warm"


def restore_table(timings: common.Timings, seen: dict, nbytes: int, anchors: list[str]) -> str:
    by_name = {name: common.median(t["restore"]) for name, t in timings.items()}
    headers = ["tier", "last_restore", "bytes from root", "median s", "min..max s", "GB/s"] + [
        f"x {a}" for a in anchors if a in by_name]
    rows = []
    for name, t in timings.items():
        s = t["restore"]
        tiers = sorted(seen.get(name, ()))
        cells = [name, ", ".join(tier for tier, _ in tiers) or "-",
                 ", ".join(str(b) for _, b in tiers) or "-", f"{by_name[name]:.3f}",
                 f"{min(s):.3f}..{max(s):.3f}", f"{common.gbps(nbytes, by_name[name]):.2f}"]
        cells += [f"{by_name[a] / by_name[name]:.1f}" for a in anchors if a in by_name]
        rows.append(cells)
    if not peer_supported():  # an honest gap, not a figure
        rows.insert(1, [NOT_BUILT, "-", "-", "not built", "-", "-"]
                    + ["-"] * (len(headers) - 6))
    return common.markdown_table(headers, rows)


def goals(timings: common.Timings) -> list[str]:
    mem = common.median(timings["memory tier"]["restore"])
    out = []
    for anchor, want in GOALS.items():
        if anchor not in timings:
            out.append(f"- memory vs {anchor}: not measured (goal >= {want:g}x)")
            continue
        got = common.median(timings[anchor]["restore"]) / mem
        out.append(f"- memory vs {anchor}: {got:.1f}x faster (goal >= {want:g}x: "
                   f"{'met' if got >= want else 'NOT met'})")
    return out


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
                        f"s3://{bucket}/mem-{uuid.uuid4().hex[:6]}", s3_options)
                    tiers = Tiers(state, tmp, s3)
                    try:
                        cases = [("memory tier", tiers.memory),
                                 (disk_name(tiers.cold), tiers.disk(True))]
                        if tiers.cold:
                            cases.append((disk_name(False), tiers.disk(False)))
                        if s3 is not None:
                            cases.append(("S3 (moto)", tiers.s3))
                        timings = common.run_interleaved(
                            cases, args.reps, progress=f"restore {common.format_size(size)}")
                    finally:
                        tiers.close()
                label = f"{shape} ({common.SHAPES[shape]} tensors)"
                print(f"\n### Restore by tier: {common.format_size(nbytes)} per rank, {label}, "
                      f"one process, {args.reps} reps\n")
                print(restore_table(timings, tiers.seen, nbytes,
                                    [a for a in GOALS if a in timings]))
                print("\n" + "\n".join(goals(timings)))
                if not peer_supported():
                    print(f"- {NOT_BUILT}: not built yet (peer replication, issue #14); "
                          "no figure")
    finally:
        if server is not None:
            server.stop()


def main() -> None:
    def extra(p):
        p.set_defaults(sizes="1G", shapes="many")
        p.add_argument("--quick", action="store_true", help="128 MiB, 2 reps")
        p.add_argument("--no-s3", action="store_true", help="skip the S3 (moto) tier")

    args = common.parse_args(__doc__.splitlines()[0], 3, extra)
    if args.quick:
        args.sizes, args.reps = [common.parse_size("128M")], min(args.reps, 2)
    print(f"# bench_memory_tier  ({common.machine_description()}; load "
          f"{common.load_average()}; code {common.code_version()})")
    bench_restore(args)
    print("\n" + common.GATE.summary())


if __name__ == "__main__":
    main()
