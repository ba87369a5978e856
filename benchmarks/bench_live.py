"""Recovery of a replica group lost mid-training: live recovery (trainer.live, torchft)
against the restart path, on the same job.

The job (tests/support/live_job.py): three replica groups, one process each, an MLP with
AdamW on 96 samples, a checkpoint every 4 steps, under ``trainer.live.supervisor`` in a
network namespace of its own. In each mode it SIGKILLs a group mid-training ``--trials``
times (each once the job is whole again and has committed 3 more steps) and measures,
from the kill:

- ``survivors_next_step_s``: the survivors' next committed step (live: the same
  processes' first commit of a step past every step committed before the kill, not the
  step in flight when it came; restart: the first step of the restarted job);
- ``replacement_first_step_s``: the lost group's replacement's first committed step;
- ``steps_lost``: steps committed before the kill and trained again after it.

Modes: ``live`` (the survivors go on, the replacement heals from a peer), ``restart``
(every group stopped and started again, resuming from ckpt; the torchrun path without its
re-rendezvous, so a lower bound of it: docs/elastic.md has torchrun's own timeline) and
``restart-warm`` (the same, from spare processes that imported torch already).

    python benchmarks/bench_live.py [--trials 3] [--heartbeat-timeout 1.0]

Medians; the last line is machine-readable. It never asserts on timings.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.live_job import (finish, group_records, read, start_job,  # noqa: E402
                                    stop, stop_soon, wait_for)

MODES = {"live": [], "restart": ["--mode", "restart"],
         "restart-warm": ["--mode", "restart", "--spares", "3"]}


def _commits(run_dir: Path) -> list[dict]:
    return [r for recs in group_records(run_dir).values() for r in recs
            if r["event"] == "commit"]


def _current_pids(run_dir: Path) -> dict[int, int]:
    return {e["group"]: e["pid"] for e in read(run_dir / "supervisor.jsonl")
            if e["event"] == "group"}


def _whole_since(run_dir: Path, since: float, steps: int) -> bool:
    """Whether every current group process committed ``steps`` steps after ``since``."""
    pids = _current_pids(run_dir)
    if len(pids) < 3:
        return False
    recent = [r for r in _commits(run_dir) if r["time"] > since]
    return all(sum(r["pid"] == pid for r in recent) >= steps for pid in pids.values())


def run_mode(mode: str, trials: int, heartbeat_timeout: float, work: Path) -> list[dict]:
    """One job in ``mode`` with ``trials`` kills; one timeline per kill."""
    tmp = work / mode
    run_dir = tmp / "run"
    proc = start_job(tmp, steps=100000, heartbeat_timeout=heartbeat_timeout,
                     extra=MODES[mode])
    timelines = []
    try:
        since = 0.0
        for trial in range(trials):
            wait_for(lambda: _whole_since(run_dir, since, 3), 600, "a whole job")
            victim = 1 + trial % 2
            pids = _current_pids(run_dir)
            old = set(pids.values())
            killed = time.time()
            os.kill(pids[victim], signal.SIGKILL)
            wait_for(lambda: _whole_since(run_dir, killed, 1), 600, "the recovery")
            commits = _commits(run_dir)
            after = [r for r in commits if r["time"] > killed]
            new = [r for r in after if r["pid"] not in old]  # processes started since
            new_pid = _current_pids(run_dir)[victim]
            # live: the survivors are the processes that ran before the kill; restart:
            # they are stopped too (what they commit meanwhile is lost), and the job's
            # next step is the restarted processes' first
            survivors = [r for r in after if r["pid"] in old] if mode == "live" else new
            if mode == "live":
                # Each group records its own commit of a step: the victim's record of step
                # S may precede the kill and the survivors' records of the same S follow it.
                # That S is not recovery: the survivors' next step is one past every step
                # committed before the kill, and a step is lost when a survivor commits
                # again a step it had committed before.
                last = max(r["step"] for r in commits if r["time"] <= killed)
                nxt = [r for r in survivors if r["step"] > last]
                lost = max(
                    max((r["step"] for r in commits
                         if r["pid"] == pid and r["time"] <= killed), default=0)
                    - min(r["step"] for r in survivors if r["pid"] == pid) + 1
                    for pid in {r["pid"] for r in survivors})
            else:
                # what the stopped processes committed and the restarted ones trained again
                last = max(r["step"] for r in commits if r["pid"] in old)
                nxt = survivors
                lost = last - min(r["step"] for r in survivors) + 1
            timelines.append({
                "survivors_next_step_s": min((r["time"] for r in nxt),
                                             default=float("nan")) - killed,
                "replacement_first_step_s": min(r["time"] for r in new
                                                if r["pid"] == new_pid) - killed,
                "steps_lost": max(0, lost),
            })
            since = killed
        stop_soon(run_dir)
        finish(proc, timeout=600)
    finally:
        stop(proc)
    restarts = sum(e["event"] in ("restart", "quorum_lost")
                   for e in read(run_dir / "supervisor.jsonl"))
    for t in timelines:
        t["restarts"] = restarts
    return timelines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--heartbeat-timeout", type=float, default=1.0)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    a = p.parse_args()
    work = Path(a.dir or tempfile.mkdtemp(prefix="bench-live-"))
    results: dict[str, list[dict]] = {}
    for mode in a.modes.split(","):
        t0 = time.time()
        results[mode] = run_mode(mode, a.trials, a.heartbeat_timeout, work)
        print(f"# {mode}: {len(results[mode])} kills in {time.time() - t0:.0f} s",
              flush=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(t[key] for t in results[mode])

    print(f"\nRecovery of one lost replica group of 3 (medians of {a.trials} kills, "
          f"heartbeat timeout {a.heartbeat_timeout:g} s, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f})\n")
    print("| mode | kill -> survivors' next step (s) | kill -> replacement's first step "
          "(s) | steps lost | job restarts |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for mode in results:
        print(f"| {mode} | {med(mode, 'survivors_next_step_s'):.2f} | "
              f"{med(mode, 'replacement_first_step_s'):.2f} | "
              f"{med(mode, 'steps_lost'):g} | {results[mode][0]['restarts']} |")
    for mode in results:
        runs = ", ".join(f"{t['survivors_next_step_s']:.2f}" for t in results[mode])
        print(f"- {mode}: survivors' next step per kill: {runs} s")
    live = "live" in results
    restart = "restart" in results
    if live and restart:
        ratio = med("restart", "survivors_next_step_s") / med("live", "survivors_next_step_s")
        print(f"- restart path / live: {ratio:.1f}x")
    if live:
        print(f"live: survivors_next_step_s={med('live', 'survivors_next_step_s'):.2f} "
              f"replacement_first_step_s={med('live', 'replacement_first_step_s'):.2f} "
              f"steps_lost={int(sum(t['steps_lost'] for t in results['live']))} "
              f"restarts={results['live'][0]['restarts']} "
              f"restart_path_s="
              f"{med('restart', 'survivors_next_step_s') if restart else float('nan'):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
