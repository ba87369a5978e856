"""The same operations timed on two revisions of ckpt, interleaved in one run.

For a change that should not change speed (a restructuring, a refactor), this answers "is the
new code as fast as the old" with figures from one run: both revisions are checked out into
temporary worktrees, and a small child process imports ckpt from one or the other
(``PYTHONPATH``), alternating A B A B ..., each child timing one operation on a synthetic
state (benchmarks/common.py: fp32 tensors of 1024 columns) in a fresh directory:

- ``save``: ``ckpt.save`` (synchronous, durable: data and manifest fsynced);
- ``load``: ``ckpt.load`` into preallocated tensors (page cache warm: the same files were
  just written, so this times ckpt's own work, not the disk);
- ``async blocked``: the time ``CheckpointManager.save`` blocks with ``async_save=True``
  (the copy to host memory), the background write then awaited outside the timing;
- ``memory restore``: ``CheckpointManager.restore`` served by the memory tier (shared
  memory under /dev/shm) after a save that went to memory only.

Medians over ``--reps``, the spread, and the ratio B/A (below 1.0: B is faster). No timing is
asserted. Run from the repository root::

    python benchmarks/bench_revisions.py A_REV B_REV [--size 256M] [--reps 5] [--ops save,load]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

OPERATIONS = ("save", "load", "async blocked", "memory restore")

# The child runs with the revision's ckpt first on sys.path; it uses only the keywords both
# revisions understand, and silences deprecation warnings a newer revision may give.
CHILD = r"""
import json, os, sys, time, warnings
warnings.simplefilter("ignore")
import torch
import ckpt
op, nbytes, work, shm = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
n = 64
rows = max(1, nbytes // (n * 1024 * 4))
state = {f"t{i}": torch.randn(rows, 1024) for i in range(n)}
target = {k: torch.empty_like(v) for k, v in state.items()}
if op == "save":
    t = time.perf_counter(); ckpt.save(state, os.path.join(work, "c")); dt = time.perf_counter() - t
elif op == "load":
    ckpt.save(state, os.path.join(work, "c"))
    t = time.perf_counter(); ckpt.load(target, os.path.join(work, "c")); dt = time.perf_counter() - t
    assert all(torch.equal(target[k], state[k]) for k in state)
elif op == "async blocked":
    with ckpt.CheckpointManager(os.path.join(work, "r"), async_save=True) as mgr:
        mgr.save(0, state); mgr.wait()
        t = time.perf_counter(); mgr.save(1, state); dt = time.perf_counter() - t
        mgr.wait()
elif op == "memory restore":
    kw = dict(memory_tier=True, memory_dir=shm, persist_every=1000, memory_job="bench")
    with ckpt.CheckpointManager(os.path.join(work, "m"), **kw) as mgr:
        mgr.save(0, state); mgr.save(1, state); mgr.wait()
    with ckpt.CheckpointManager(os.path.join(work, "m"), **kw) as mgr:
        t = time.perf_counter(); step = mgr.restore(target); dt = time.perf_counter() - t
        assert step == 1 and all(torch.equal(target[k], state[k]) for k in state)
else:
    raise SystemExit(f"unknown operation {op}")
print(json.dumps({"seconds": dt}))
"""


def worktree(rev: str, where: str) -> str:
    """A detached checkout of ``rev`` under ``where`` (removed at the end of the run)."""
    path = os.path.join(where, rev.replace("/", "_"))
    subprocess.run(["git", "-C", common.REPO_ROOT, "worktree", "add", "--detach", "-f", path,
                    rev], check=True, capture_output=True)
    return path


def run_child(tree: str, op: str, nbytes: int, scratch: str) -> float:
    work = tempfile.mkdtemp(dir=scratch)
    shm = tempfile.mkdtemp(prefix="ckpt-bench-", dir="/dev/shm")
    try:
        env = dict(os.environ, PYTHONPATH=tree)
        out = subprocess.run([sys.executable, "-c", CHILD, op, str(nbytes), work, shm],
                             cwd=tree, env=env, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"{op} in {tree} failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="the reference revision (e.g. a commit before the change)")
    parser.add_argument("b", help="the revision compared with it (e.g. HEAD)")
    parser.add_argument("--size", type=common.parse_size, default=common.parse_size("256M"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=common.DEFAULT_DIR)
    parser.add_argument("--ops", default=",".join(OPERATIONS),
                        help=f"comma-separated operations among {', '.join(OPERATIONS)}")
    args = parser.parse_args()
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = [op for op in ops if op not in OPERATIONS]
    if unknown:
        parser.error(f"unknown operation(s) {unknown}; choose among {list(OPERATIONS)}")
    os.makedirs(args.dir, exist_ok=True)
    scratch = tempfile.mkdtemp(dir=args.dir)
    trees = {}
    try:
        for name, rev in (("A", args.a), ("B", args.b)):
            trees[name] = worktree(rev, scratch)
        times: dict[tuple[str, str], list[float]] = {}
        for rep in range(args.reps):
            order = ("A", "B") if rep % 2 == 0 else ("B", "A")
            for op in ops:
                for name in order:
                    times.setdefault((op, name), []).append(
                        run_child(trees[name], op, args.size, scratch))
        print(f"{common.format_size(args.size)} fp32 state, {args.reps} reps, interleaved; "
              f"A = {args.a}, B = {args.b}")
        print(f"{'operation':<16}{'A median s':>12}{'B median s':>12}{'B/A':>7}   spread A / B")
        for op in ops:
            a, b = times[(op, "A")], times[(op, "B")]
            ma, mb = statistics.median(a), statistics.median(b)
            print(f"{op:<16}{ma:>12.4f}{mb:>12.4f}{mb / ma:>7.2f}   "
                  f"{min(a):.4f}-{max(a):.4f} / {min(b):.4f}-{max(b):.4f}")
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", common.REPO_ROOT, "worktree", "remove", "--force", tree],
                           capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
