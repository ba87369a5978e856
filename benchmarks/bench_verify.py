"""``ckpt verify`` speed: the digest level against a raw read of the same files, and the
forward level on the demo model.

Digest: one step of ``--size`` bytes (fp32, 8 MiB chunks, two data files) is verified
``--reps`` times, interleaved with raw reads of the very same data files (8 MiB blocks into
a reused buffer: one thread, and ``--threads`` threads each reading a contiguous run).
Before every run the page cache
is dropped when this process may (root): then it is a cold read from the disk; otherwise,
or with ``--warm``, the cache is warm and the table says so. Goal (reported, not asserted): digest >= 0.8x the
faster raw read.

Forward: trainer/tiny_lm.py's model saved with a ckpt.Probe (8 x 64 tokens); the forward
level's time (structure + digest + fresh model + restore + rerun + compare), and the same
as a user runs it (``python -m ckpt verify --level forward``: Python and torch start-up
included).

Run from the repository root::

    python benchmarks/bench_verify.py [--size 1G] [--reps 5] [--threads 4] [--warm]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (puts the repository root on sys.path too)
import torch  # noqa: E402

import ckpt  # noqa: E402
import verify  # noqa: E402
from ckpt._format.names import step_dir  # noqa: E402

BLOCK = 8 << 20


def raw_read(paths: list[str], threads: int) -> int:
    """Read every byte of ``paths`` in 8 MiB blocks into a reused buffer per thread; with
    several threads each reads one contiguous run of the blocks, front to back (the best
    case for the kernel's read-ahead)."""
    blocks = [(p, off) for p in paths for off in range(0, os.path.getsize(p), BLOCK)]
    runs = [blocks[i * len(blocks) // threads:(i + 1) * len(blocks) // threads]
            for i in range(threads)]

    def read_run(run: list[tuple[str, int]]) -> int:
        buf, n = bytearray(BLOCK), 0
        for path, offset in run:
            fd = os.open(path, os.O_RDONLY)
            try:
                n += os.preadv(fd, [buf], offset)
            finally:
                os.close(fd)
        return n

    if threads == 1:
        return read_run(blocks)
    with cf.ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(read_run, runs))


def digest_rows(args: argparse.Namespace, root: str) -> tuple[list[common.Row], int, bool]:
    state = common.make_state(args.size, "few")
    with ckpt.CheckpointManager(root, async_save=False, options=ckpt.SaveOptions(
            write_threads=2)) as mgr:
        mgr.save(1, state, force=True)
    del state
    mgr = ckpt.CheckpointManager(root, read_only=True)
    manifest = mgr.manifest(1)
    paths = [os.path.join(root, step_dir(1), f) for f in manifest.files]
    nbytes = sum(os.path.getsize(p) for p in paths)
    cold = [True]

    def case(fn):
        def run(rep: int) -> dict[str, float]:
            if args.warm:  # the save just wrote the files: they are in the page cache
                cold[0] = False
            else:
                cold[0] = common.drop_page_cache() and cold[0]
            with common.Stopwatch() as sw:
                fn()
            return {"s": sw.seconds, "cpu": sw.cpu_seconds}
        return run

    def ckpt_digest(threads: int):
        def fn() -> None:
            report = verify.verify_step(mgr, 1, "digest", threads=threads)
            assert report.ok, report.problems
        return fn

    cases = [
        ("raw read, 1 thread", case(lambda: raw_read(paths, 1))),
        (f"raw read, {args.threads} threads", case(lambda: raw_read(paths, args.threads))),
        (f"verify digest, {args.threads} threads", case(ckpt_digest(args.threads))),
        ("verify digest, 1 thread", case(ckpt_digest(1))),
        ("verify structure", case(lambda: verify.verify_step(mgr, 1, "structure"))),
    ]
    timings = common.run_interleaved(cases, args.reps, progress="digest")
    rows = [common.Row(name, t["s"], t["cpu"]) for name, t in timings.items()]
    mgr.close()
    return rows, nbytes, cold[0]


def forward_rows(args: argparse.Namespace, root: str) -> tuple[list[common.Row], str]:
    from trainer.tiny_lm import TinyLM

    torch.manual_seed(0)
    model = TinyLM()
    probe = ckpt.Probe(model_key="model", inputs=torch.randint(0, 256, (8, 64)),
                       factory="trainer.tiny_lm:TinyLM")
    with ckpt.CheckpointManager(root, async_save=False,
                                options=ckpt.SaveOptions(probe=probe)) as mgr:
        mgr.save(1, {"model": model}, force=True)
    params = sum(p.numel() for p in model.parameters())
    env = {**os.environ, "PYTHONPATH": common.REPO_ROOT}

    def level(name: str):
        def run(rep: int) -> dict[str, float]:
            report = verify.verify(root, 1, name, trust_recorded=True)
            assert report.ok, report.problems
            out = {"s": report.seconds}
            if report.forward:
                out["forward"] = report.forward["seconds"]
            return out
        return run

    def cli(rep: int) -> dict[str, float]:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ckpt", "verify", root, "--level", "forward",
                        "--trust-recorded"], env=env, check=True, capture_output=True)
        return {"s": time.perf_counter() - t0}

    timings = common.run_interleaved([("digest level", level("digest")),
                                      ("forward level", level("forward")),
                                      ("ckpt verify --level forward (CLI)", cli)],
                                     args.reps, progress="forward")
    rows = [common.Row(n, t["s"]) for n, t in timings.items()]
    rows.insert(2, common.Row("  of which the forward check", timings["forward level"]["forward"]))
    return rows, f"TinyLM, {params / 1e6:.2f} M parameters, probe batch 8 x 64 tokens"


def _cache(cold: bool, warm: bool) -> str:
    if cold:
        return "cold (page cache dropped before each run)"
    return "warm page cache" + (" (--warm)" if warm else " (could not drop it: not root)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1G", help="checkpoint size (default 1G)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--dir", default=common.DEFAULT_DIR)
    parser.add_argument("--warm", action="store_true",
                        help="keep the page cache (measures the CPU side: copies and hashing)")
    args = parser.parse_args()
    args.size = common.parse_size(args.size)
    base = common.fresh_dir(os.path.join(args.dir, "verify"))
    try:
        rows, nbytes, cold = digest_rows(args, os.path.join(base, "digest"))
        fwd, what = forward_rows(args, os.path.join(base, "forward"))
    finally:
        common.remove(base)
    print(f"machine: {common.machine_description()}; load {common.load_average()}; "
          f"code {common.code_version()}")
    print(f"\n### digest level: {common.format_size(args.size)} checkpoint, 4 fp32 tensors, "
          f"8 MiB chunks, 2 files; {_cache(cold, args.warm)}; "
          f"median of {args.reps}, interleaved\n")
    anchors = [r.name for r in rows if r.name.startswith("raw read")]
    print(common.throughput_table(rows, nbytes, anchors))
    print(f"\n### forward level: {what}; median of {args.reps}, interleaved\n")
    print(common.time_table(fwd, ["digest level"]))


if __name__ == "__main__":
    main()
