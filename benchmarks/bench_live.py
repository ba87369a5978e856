"""Recovery of a replica group lost mid-training: live recovery (trainer.live, torchft)
against the restart path under real torchrun agents, on the same job.

The job: an MLP with AdamW + StepLR on 96 samples, global batch 12, a checkpoint every 4
steps, in three replicas. Live: tests/support/live_job.py, three replica groups of one
process under ``trainer.live.supervisor`` in a network namespace of its own. torchrun:
tests/support/live_torchrun_job.py, the same model, data, batch, seed and checkpoint
interval trained by ``trainer.ElasticTrainer`` with its defaults under three torchrun agents
(one worker each, c10d rendezvous on localhost; benchmarks/live_torchrun.py). In each mode
it SIGKILLs one group (torchrun: a whole node, agent and worker) mid-training ``--trials``
times (each once the job is whole again and has committed 3 more steps); the lost group's
replacement starts at once. From the kill it measures:

- ``survivors_next_step_s``: the survivors' next committed step (live: the same
  processes' first commit of a step past every step committed before the kill, not the
  step in flight when it came; restart paths: the first step of the restarted job on the
  surviving groups or nodes, which may train again steps committed before the kill);
- ``past_kill_step_s``: the job's first commit of a step past every step committed before
  the kill (training is ahead again);
- ``replacement_first_step_s``: the lost group's replacement's first committed step;
- ``steps_lost``: steps committed before the kill and trained again after it.

Modes:

- ``live``: the survivors go on, the replacement heals from a peer;
- ``torchrun``, ``torchrun-warm``: the restart path, cold and with warm restarts (workers
  forked from a zygote per node, ``-m trainer.warm``); the replacement node's agent starts
  at once and joins the survivors' re-rendezvous;
- ``torchrun-warm-late``: as ``torchrun-warm``, but the replacement starts once the
  survivors committed a step at world 2 (a replacement slower than the survivors' restart:
  the survivors' best case; the replacement's join then restarts them once more);
- ``restart``, ``restart-warm``: the live job's supervisor restarting every group (from
  spare processes that imported torch with ``-warm``): the restart path without torchrun's
  rendezvous, a lower bound of it.

torchrun's rendezvous is shortened from its defaults (live_torchrun.RDZV_CONF says how and
why; ``--rdzv-defaults`` keeps torchrun's own); the trainer runs with its defaults (memory tier on, async checkpoints, resumes from
the newest verified step) apart from micro batches of 2 (the global batch must split at
world 3 and 2).

    python benchmarks/bench_live.py [--trials 3] [--heartbeat-timeout 1.0] [--modes ...] [--rdzv-defaults]

Medians; a line per mode, then the machine-readable last line, whose ``restart_path_s`` is
the best median of the torchrun modes (the line before it names which). It never asserts
on timings.
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

from benchmarks.live_torchrun import RDZV_CONF, RDZV_DEFAULTS, run_torchrun  # noqa: E402
from tests.support.live_job import (finish, group_records, read, start_job,  # noqa: E402
                                    stop, stop_soon, wait_for)

#: the modes run by the live job's supervisor, with its arguments
SUPERVISED = {"live": [], "restart": ["--mode", "restart"],
              "restart-warm": ["--mode", "restart", "--spares", "3"]}
TORCHRUN = ("torchrun", "torchrun-warm", "torchrun-warm-late")
MODES = ("live", *TORCHRUN, "restart", "restart-warm")


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
                     extra=SUPERVISED[mode])
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
            # training ahead again: a step past every one committed before (restart: by
            # the stopped processes)
            wait_for(lambda: any(r["step"] > last and r["time"] > killed
                                 for r in _commits(run_dir)), 600, f"a step past {last}")
            ahead = min(r["time"] for r in _commits(run_dir)
                        if r["step"] > last and r["time"] > killed)
            timelines.append({
                "survivors_next_step_s": min((r["time"] for r in nxt),
                                             default=float("nan")) - killed,
                "past_kill_step_s": ahead - killed,
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


def run(mode: str, a: argparse.Namespace, work: Path) -> list[dict]:
    if mode in TORCHRUN:
        return run_torchrun(work / mode, a.trials, warm="-warm" in mode,
                            late=mode.endswith("-late"),
                            rdzv_conf=RDZV_DEFAULTS if a.rdzv_defaults else RDZV_CONF)
    return run_mode(mode, a.trials, a.heartbeat_timeout, work)


def restarts(timelines: list[dict], mode: str) -> int:
    """Job restarts over the mode's kills (the supervisor counts them per job)."""
    if mode in TORCHRUN:
        return sum(t["restarts"] for t in timelines)
    return timelines[0]["restarts"] if timelines else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--heartbeat-timeout", type=float, default=1.0)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rdzv-defaults", action="store_true",
                   help="torchrun's own rendezvous timings (last call 30 s, a node's "
                   "keep-alive 5 s x 3) instead of the shortest safe ones")
    p.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    a = p.parse_args()
    work = Path(a.dir or tempfile.mkdtemp(prefix="bench-live-"))
    results: dict[str, list[dict]] = {}
    loads = []
    for mode in a.modes.split(","):
        if mode not in MODES:
            p.error(f"unknown mode {mode!r} (modes: {', '.join(MODES)})")
        t0 = time.time()
        loads.append(os.getloadavg()[0])
        results[mode] = run(mode, a, work)
        loads.append(os.getloadavg()[0])
        print(f"# {mode}: {len(results[mode])} kills in {time.time() - t0:.0f} s",
              flush=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(t[key] for t in results[mode])

    print(f"\nRecovery of one lost replica of 3 (medians of {a.trials} kills; live heartbeat "
          f"timeout {a.heartbeat_timeout:g} s; torchrun rendezvous "
          f"{'defaults' if a.rdzv_defaults else 'shortened'}: "
          f"{RDZV_DEFAULTS if a.rdzv_defaults else RDZV_CONF}; {os.cpu_count()} CPUs, load "
          f"average {min(loads):.1f}-{max(loads):.1f} while it ran)\n")
    print("| mode | kill -> survivors' next step (s) | kill -> a step past the kill's (s) "
          "| kill -> replacement's first step (s) | steps lost per kill | job restarts |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for mode, tl in results.items():
        print(f"| {mode} | {med(mode, 'survivors_next_step_s'):.2f} | "
              f"{med(mode, 'past_kill_step_s'):.2f} | "
              f"{med(mode, 'replacement_first_step_s'):.2f} | "
              f"{med(mode, 'steps_lost'):g} | {restarts(tl, mode)} |")
    print()
    for mode, tl in results.items():
        runs = ", ".join(f"{t['survivors_next_step_s']:.2f}" for t in tl)
        print(f"- {mode}: survivors' next step per kill: {runs} s")
        if mode in TORCHRUN:
            print(f"  survivors' restart (medians, s after the kill): failure seen "
                  f"{med(mode, 'detect_s'):.2f}, new workers started {med(mode, 'spawn_s'):.2f}, "
                  f"process group formed {med(mode, 'group_s'):.2f}; world sizes until whole "
                  f"again: {'; '.join(','.join(map(str, t['worlds'])) for t in tl)}")
    anchors = [m for m in TORCHRUN if m in results]
    best = min(anchors, key=lambda m: med(m, "survivors_next_step_s"), default=None)
    restart_path = med(best, "survivors_next_step_s") if best else float("nan")
    if "live" in results and best:
        print(f"- restart path (best torchrun mode, {best}) / live: "
              f"{restart_path / med('live', 'survivors_next_step_s'):.1f}x")
    print()
    for mode, tl in results.items():
        print(f"mode {mode}: survivors_next_step_s={med(mode, 'survivors_next_step_s'):.2f} "
              f"past_kill_step_s={med(mode, 'past_kill_step_s'):.2f} "
              f"replacement_first_step_s={med(mode, 'replacement_first_step_s'):.2f} "
              f"steps_lost={int(sum(t['steps_lost'] for t in tl))} "
              f"restarts={restarts(tl, mode)}")
    if best:
        print(f"restart path: mode={best} survivors_next_step_s={restart_path:.2f}")
    if "live" in results:
        print(f"live: survivors_next_step_s={med('live', 'survivors_next_step_s'):.2f} "
              f"replacement_first_step_s={med('live', 'replacement_first_step_s'):.2f} "
              f"steps_lost={int(sum(t['steps_lost'] for t in results['live']))} "
              f"restarts={restarts(results['live'], 'live')} "
              f"restart_path_s={restart_path:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
