"""The run summary's wall time is the sum of each invocation's own wall time: a job
preempted, then launched again an hour later, does not count the hour it was not running
(neither in ``wall_s`` nor in the recovery's lost time)."""

from __future__ import annotations

import time

from trainer.progress import JsonLines, build_summary


def write_attempt(run_dir, number: int, *, pid: int, restart: int, start: float,
                  restored: int, steps: range, end_event: str) -> None:
    """Rank 0's progress records of one attempt, as trainer.records.RunRecords writes them."""
    out = JsonLines(run_dir / f"attempt-{number:04d}" / "rank-00000.jsonl")
    t = start
    out.write({"event": "start", "time": t, "rank": 0, "attempt": number, "world": 1,
               "pid": pid, "restart_count": restart, "process_start": start,
               "group_ready": start + 1})
    out.write({"event": "built", "time": start + 2, "rank": 0})
    out.write({"event": "restored", "time": start + 3, "rank": 0, "step": restored,
               "fresh": restored == 0, "seconds": 1.0})
    for i, step in enumerate(steps):
        t = start + 4 + i
        out.write({"event": "step", "time": t, "rank": 0, "step": step, "loss": 1.0})
    out.write({"event": end_event, "time": t + 0.5, "rank": 0, "step": steps[-1]})
    out.close()


def test_wall_time_sums_the_invocations_and_skips_the_idle_hour_between(tmp_path):
    now = time.time()
    # launch 1: 14 s, preempted at step 10; an hour idle; launch 2 (restart count 0 again, a
    # new process): 20 s up to now, resumed from step 10.
    write_attempt(tmp_path, 0, pid=100, restart=0, start=now - 3634, restored=0,
                  steps=range(1, 11), end_event="preempted")
    write_attempt(tmp_path, 1, pid=200, restart=0, start=now - 20, restored=10,
                  steps=range(11, 21), end_event="done")
    s = build_summary(tmp_path, total_steps=20, final_step=20, step_s=1.0)
    print(f"wall_s={s.wall_s} lost_s={s.lost_s}")
    assert 33 <= s.wall_s <= 40, s.wall_s  # 14.5 + 20 (+ the test's own seconds)
    assert s.lost_s < 30 and s.lost_fraction <= 1.0, (s.lost_s, s.lost_fraction)
    assert s.attempts == 2 and s.restores == [0, 10]


def test_a_restart_within_one_launch_counts_its_downtime(tmp_path):
    now = time.time()
    write_attempt(tmp_path, 0, pid=100, restart=0, start=now - 120, restored=0,
                  steps=range(1, 11), end_event="preempted")
    write_attempt(tmp_path, 1, pid=200, restart=1, start=now - 60, restored=10,
                  steps=range(11, 21), end_event="done")
    s = build_summary(tmp_path, total_steps=20, final_step=20, step_s=1.0)
    assert 119 <= s.wall_s <= 130, s.wall_s  # one launch: first start to now
    assert s.lost_s >= 50, s.lost_s  # torchrun's restart took the time between
