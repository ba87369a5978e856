"""Recovery of an elastic job from a lost node: the timeline, the time lost, and the interval.

Runs the tiny LM under three local torchrun agents (one worker each, c10d rendezvous on a
store this script hosts; see tests/support/elastic_job.py), kills one whole node (agent + worker)
with SIGKILL mid-training, and lets the two survivors finish at world size 2. Prints:

1. the recovery timeline, from the kill (t = 0): survivors detect it, their agents see the
   workers exit, the re-rendezvous completes, the new workers start, the process group
   forms, the model is built, the checkpoint is restored, the first step finishes;
2. the time lost: downtime (kill to first step) plus the steps trained again, as a fraction
   of the run's wall time, and the wall time against the same job without a failure;
3. the checkpoint cost here (blocking time of an async save, and a full synchronous save)
   and the Young/Daly checkpoint interval sqrt(2 x cost x MTBF) for a few failure rates,
   with the expected fraction of time lost at that interval.

Run from the repository root::

    python benchmarks/bench_elastic.py [--victim 1] [--steps 120] [--every 10]

It never asserts on timings; its output is the "Elastic recovery" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support import elastic_job as job  # noqa: E402
from trainer.elastic import ElasticSummary, read_jsonl  # noqa: E402

_AGENT_LINE = re.compile(r"^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d+) ")


def agent_events(log: str, needle: str) -> list[float]:
    """Wall times of torchrun agent log lines containing ``needle``."""
    out = []
    year = time.localtime().tm_year
    for line in log.splitlines():
        m = _AGENT_LINE.match(line)
        if m and needle in line:
            t = datetime.datetime.strptime(f"{year}{m.group(1)} {m.group(2)}",
                                           "%Y%m%d %H:%M:%S.%f")
            out.append(t.timestamp())
    return out


def job_args(tmp: Path, a: argparse.Namespace) -> list[str]:
    return ["--hold-until-world", "3", "--root", str(tmp / "ckpt"), "--run-dir",
            str(tmp / "run"), "--audit-dir",
            str(tmp / "audit"), "--steps", str(a.steps), "--every", str(a.every),
            "--global-batch", "12", "--micro-batch", "2", "--sentences", "60",
            "--sample-sleep", str(a.sample_sleep), "--heartbeat-timeout",
            str(a.heartbeat_timeout), "--collective-timeout", str(a.collective_timeout)]


def run_job(tmp: Path, a: argparse.Namespace, kill_at: int | None) -> dict:
    c = job.LocalCluster(tmp, job_args(tmp, a), extra_env={"LOGLEVEL": "INFO"},
                         last_call_timeout=a.last_call_timeout)
    out: dict = {}
    try:
        nodes = [c.add_node() for _ in range(3)]
        out["started"] = min(n.started for n in nodes)
        survivors = nodes
        if kill_at is not None:
            def ready():
                p = job.progress(tmp / "run")
                if p and p[max(p)]["world"] == 3 and p[max(p)]["step"] >= kill_at \
                        and len(p[max(p)]["pids"]) == 3:
                    return p[max(p)]
                return None
            info = job.wait_for(ready, 180, "training at world size 3", cluster=c)
            victim = c.node_of(info["pids"][a.victim])
            out["killed_step"] = info["step"]
            out["killed_at"] = victim.kill(signal.SIGKILL)
            survivors = [n for n in nodes if n is not victim]
        for n in survivors:
            n.proc.wait(timeout=300)
        out["ended"] = time.time()
        out["codes"] = [n.proc.returncode for n in survivors]
        out["logs"] = {n.name: n.log() for n in survivors}
    finally:
        c.close()
    out["summary"] = ElasticSummary.from_dict(json.loads((tmp / "run" / "summary.json")
                                                         .read_text()))
    return out


def attempt_times(run_dir: Path, attempt: int) -> dict[str, float]:
    recs = [r for p in (run_dir / f"attempt-{attempt:04d}").glob("rank-*.jsonl")
            for r in read_jsonl(p)]
    starts = [r for r in recs if r["event"] == "start"]
    restored = [r for r in recs if r["event"] == "restored"]
    first_step = restored[0]["step"] + 1 if restored else None
    return {
        "spawn": min(r["process_start"] for r in starts),
        "group": max(r["group_ready"] for r in starts),
        "built": max(r["time"] for r in recs if r["event"] == "built"),
        "restored": max(r["time"] for r in restored),
        "first_step": max(r["time"] for r in recs
                          if r["event"] == "step" and r["step"] == first_step),
    }


def checkpoint_cost(reps: int) -> dict[str, float]:
    """Blocking time of an async save and time of a sync save of the tiny LM's state."""
    import torch

    import ckpt
    from trainer.tiny_lm import make_training, train_step

    torch.set_num_threads(1)
    tr = make_training(0, batch_size=12)
    train_step(tr)  # optimizer state exists
    state = {"model": tr.model, "optim": tr.optimizer, "sched": tr.scheduler,
             "rng": ckpt.RNGState(), "data": tr.sampler}
    out: dict[str, list[float]] = {"async_blocking_s": [], "async_write_s": [],
                                   "sync_s": []}
    root = Path(tempfile.mkdtemp(prefix="bench-elastic-ckpt-"))
    try:
        with ckpt.CheckpointManager(root / "a", keep_last=2, async_save=True) as mgr:
            for step in range(1, reps + 2):
                t0 = time.perf_counter()
                h = mgr.save(step, state)
                t1 = time.perf_counter()
                h.wait()
                t2 = time.perf_counter()
                if step > 1:  # the first call sets up staging buffers
                    out["async_blocking_s"].append(t1 - t0)
                    out["async_write_s"].append(t2 - t0)
        with ckpt.CheckpointManager(root / "s", keep_last=2, async_save=False) as mgr:
            for step in range(1, reps + 2):
                t0 = time.perf_counter()
                mgr.save(step, state)
                if step > 1:
                    out["sync_s"].append(time.perf_counter() - t0)
        size = sum(p.stat().st_size for p in (root / "s").rglob("*") if p.is_file()) / 2
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res = {k: statistics.median(v) for k, v in out.items()}
    res["bytes"] = size
    return res


def young_daly(cost_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * cost_s * mtbf_s)


def expected_loss(interval_s: float, cost_s: float, mtbf_s: float, restart_s: float) -> float:
    """Fraction of time lost: checkpoint overhead C/T plus, per failure, restart R and on
    average half an interval of recomputation, over the MTBF."""
    return cost_s / interval_s + (restart_s + interval_s / 2) / mtbf_s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--victim", type=int, default=1, help="rank whose node is killed")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=None, help="default: steps/3 + 3")
    p.add_argument("--sample-sleep", type=float, default=0.01)
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
    p.add_argument("--collective-timeout", type=float, default=10.0)
    p.add_argument("--last-call-timeout", type=int, default=3)
    p.add_argument("--no-baseline", action="store_true", help="skip the no-failure run")
    p.add_argument("--ckpt-reps", type=int, default=10)
    p.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    a = p.parse_args()
    kill_at = a.kill_at or a.steps // 3 + 3
    work = Path(a.dir or tempfile.mkdtemp(prefix="bench-elastic-"))
    if work.exists() and a.dir:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    print(f"tiny LM, {a.steps} steps, global batch 12, checkpoint every {a.every}, 3 nodes "
          f"-> kill rank {a.victim}'s node at step {kill_at}; heartbeat timeout "
          f"{a.heartbeat_timeout:.0f}s, collective timeout {a.collective_timeout:.0f}s, "
          f"last_call_timeout {a.last_call_timeout}s; work dir "
          f"{'given with --dir' if a.dir else 'a temporary directory'}", flush=True)

    base = None
    if not a.no_baseline:
        base = run_job(work / "baseline", a, None)
        bs = base["summary"]
        print(f"\nno failure: wall {bs.wall_s:.1f}s at world 3, step {bs.step_s * 1e3:.0f} ms",
              flush=True)

    run = run_job(work / "kill", a, kill_at)
    s: ElasticSummary = run["summary"]
    k = run["killed_at"]
    rec = s.recoveries[-1]
    fails = [r for pth in (work / "kill" / "run" / "attempt-0000").glob("rank-*.jsonl")
             for r in read_jsonl(pth) if r["event"] == "failure"]
    logs = "\n".join(run["logs"].values())
    exits = [t for t in agent_events(logs, "failed (exitcode") if t > k]
    rdzv = [t for t in agent_events(logs, "Rendezvous complete") if t > k]
    nxt = attempt_times(work / "kill" / "run", len(s.world_sizes) - 1)
    print(f"\nkilled rank {a.victim}'s node at step {run['killed_step']}; "
          f"the job {'finished' if set(run['codes']) == {0} else 'FAILED'}: "
          f"world sizes {s.world_sizes}, restored step {rec.restored_step}, "
          f"{rec.steps_lost} steps trained again")
    print("\nrecovery timeline (seconds after the SIGKILL):")
    rows = [
        ("survivors detect the loss (first / last)",
         f"{min(f['time'] for f in fails) - k:6.2f} / {max(f['time'] for f in fails) - k:.2f}"),
        ("agents see their workers exit (last)", f"{max(exits) - k:6.2f}" if exits else "-"),
        ("re-rendezvous complete at world 2 (last agent)",
         f"{max(rdzv) - k:6.2f}" if rdzv else "-"),
        ("new workers started (first process)", f"{nxt['spawn'] - k:6.2f}"),
        ("process group formed (init_process_group)", f"{nxt['group'] - k:6.2f}"),
        ("model + DDP + optimizer built", f"{nxt['built'] - k:6.2f}"),
        ("checkpoint restored (resharded 3 -> 2)", f"{nxt['restored'] - k:6.2f}"),
        ("first step finished", f"{nxt['first_step'] - k:6.2f}"),
    ]
    for what, t in rows:
        print(f"  {what:48} {t}")
    downtime = nxt["first_step"] - k
    redo = (rec.steps_lost or 0) * (s.step_s or 0)
    wall = run["ended"] - run["started"]
    print(f"\ntime lost: downtime {downtime:.1f}s + {rec.steps_lost} steps trained again "
          f"({redo:.1f}s at {s.step_s * 1e3:.0f} ms/step at world 2) = {downtime + redo:.1f}s "
          f"of {wall:.1f}s wall ({100 * (downtime + redo) / wall:.0f}%)")
    if base is not None:
        bwall = base["ended"] - base["started"]
        print(f"wall time against the no-failure run: {wall:.1f}s vs {bwall:.1f}s "
              f"(+{wall - bwall:.1f}s; the steps after the failure also ran on 2 ranks "
              "instead of 3)")
    print(s.format())

    cost = checkpoint_cost(a.ckpt_reps)
    print(f"\ncheckpoint of the tiny LM's state ({cost['bytes'] / 1e6:.2f} MB): async save "
          f"blocks {cost['async_blocking_s'] * 1e3:.1f} ms (written in "
          f"{cost['async_write_s'] * 1e3:.0f} ms in the background); sync save "
          f"{cost['sync_s'] * 1e3:.0f} ms")
    restart = downtime
    print(f"\nYoung/Daly interval T = sqrt(2 C M) and the expected fraction of time lost "
          f"C/T + (R + T/2)/M with R = {restart:.1f}s (the downtime above):")
    print(f"  {'MTBF M':>10} {'C (s)':>8} {'T (s)':>9} {'steps':>7} {'lost':>7}")
    for mtbf_h in (1, 6, 24, 24 * 7):
        for label, c in (("async", cost["async_blocking_s"]), ("sync", cost["sync_s"])):
            t = young_daly(c, mtbf_h * 3600)
            print(f"  {mtbf_h:>8} h {c:8.3f} {t:9.1f} {t / (s.step_s or 1):7.0f} "
                  f"{100 * expected_loss(t, c, mtbf_h * 3600, restart):6.2f}%  ({label})")
    if not a.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
