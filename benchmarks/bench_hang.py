"""Hung ranks: what the progress markers cost, and how soon a stuck rank is named.

1. **Marker cost**: the markers the trainer moves in one step (step, data, forward and
   backward per micro batch, collective, optimizer, save) timed over many steps, minus an
   empty loop; as a fraction of a 100 ms step (target < 1%). Also the cost of one beat's
   progress payload (the beat thread's work, once per heartbeat interval).
2. **Detection, ranks as threads** (tests/support/thread_ranks.py): three ranks with a
   100 ms step in one process, one stuck in its data section, sleeping or spinning in
   Python, while its heartbeat runs: seconds from the stop until every rank named it.
3. **Detection under torchrun** (tests/support/elastic_job.py ``--stall``): the tiny LM on
   three local agents (warm restarts); rank 1 sleeps in its data loader, later rank 2
   spins in Python.
   From the run records: the typical step, the limit, and how long after the stop the
   first rank and all ranks named the culprit (the culprit names itself too).

Run from the repository root::

    python benchmarks/bench_hang.py [--no-torchrun]

Times are printed, never asserted. The last line is machine-readable::

    hang: typical_step_s=X detect_s=Y named_rank=R marker_cost=F straggler_detect_windows=N

(typical step and detection of the torchrun data-loader scenario when it ran, else of the
thread scenario; marker cost as a fraction of a 100 ms step; N from
:func:`trainer.stragglers.detect_windows`).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support import elastic_job as job  # noqa: E402
from tests.support.thread_ranks import ThreadRanks  # noqa: E402
from trainer.elastic import read_jsonl  # noqa: E402
from trainer.hangs import HangRule  # noqa: E402
from trainer.heartbeat import Heartbeat  # noqa: E402
from trainer.sections import Sections  # noqa: E402
from trainer.stragglers import detect_windows  # noqa: E402

REFERENCE_STEP_S = 0.1


def marker_cost(steps: int = 20000, micro: int = 2) -> tuple[float, float]:
    """Seconds of markers per training step (median of 5 runs, empty loop subtracted), and
    seconds to build one beat's progress payload."""
    def one_run(mark: bool) -> float:
        s = Sections()
        enter = s.enter
        t0 = time.perf_counter()
        for i in range(steps):
            if mark:
                s.step(i)
                enter("data")
                for _ in range(micro):
                    enter("data")
                    enter("forward")
                    enter("backward")
                enter("collective")
                enter("optimizer")
                enter("save")
                s.discard()
        return (time.perf_counter() - t0) / steps

    runs = [one_run(True) - one_run(False) for _ in range(5)]
    s = Sections()
    for i in range(100):
        s.step(i)
        for name in ("data", "forward", "backward", "collective", "optimizer"):
            s.enter(name)
    hb = Heartbeat(None, 0, 2, sections=s, hang_rule=HangRule(), interval=1.0, timeout=5.0)
    t0 = time.perf_counter()
    for _ in range(1000):
        hb._payload()
    return statistics.median(runs), (time.perf_counter() - t0) / 1000


def thread_scenario(how: str) -> tuple[float, float, float, list[int]]:
    """(typical step, seconds until the first and every rank named the culprit, the ranks
    named)."""
    ranks = ThreadRanks(3, (1, 8, how), HangRule(factor=2.0, floor=0.2, ceiling=5.0),
                        step_sleep=REFERENCE_STEP_S, interval=0.05)
    typical, first, detect = ranks.run()
    named = sorted({r for v in ranks.lost.values() for r in v[0].lost})
    return typical, first, detect, named


def torchrun_scenarios(tmp: Path) -> list[dict]:
    """Rank 1 sleeps in its data loader at step 9, rank 2 spins at step 17; per stall: the
    typical step, limit, first and last detection, the culprit, its section."""
    stalls = ("1:9:sleep", "2:17:spin")
    args = ["--hold-until-world", "3", "--root", str(tmp / "ckpt"), "--run-dir",
            str(tmp / "run"), "--audit-dir", str(tmp / "audit"), "--steps", "24", "--every",
            "4", "--global-batch", "12", "--micro-batch", "2", "--sentences", "60",
            "--sample-sleep", "0.04", "--heartbeat-timeout", "3", "--heartbeat-interval",
            "0.1", "--collective-timeout", "30", "--hang-factor", "2", "--hang-floor", "0.5",
            *(a for s in stalls for a in ("--stall", s))]
    c = job.LocalCluster(tmp, args, restart_grace=2.0, max_restarts=6, warm=True)
    try:
        for _ in range(3):
            c.add_node()
        codes = c.wait(400)
    finally:
        c.close()
    if set(codes.values()) != {0}:
        raise SystemExit(f"the job failed: {codes}\n{c.logs()[-8000:]}")
    out = []
    for adir in sorted((tmp / "run").glob("attempt-*")):
        records = [r for p in sorted(adir.glob("rank-*.jsonl")) for r in read_jsonl(p)]
        naming = [r for r in records if r["event"] == "failure" and r.get("hung")]
        if not naming:
            continue
        culprit = naming[0]["lost"][0]
        hung = naming[0]["hung"][str(culprit)]
        entered = min(f["last_seen"][str(culprit)] for f in naming)
        verdicts = [f.get("detected_at") or f["time"] for f in naming]  # not the exits
        times = sorted(r["time"] for r in records if r["event"] == "step" and r["rank"] == 0)
        out.append({"culprit": culprit, "section": hung["section"], "limit": hung["limit"],
                    "typical": statistics.median(b - a for a, b in zip(times, times[1:])),
                    "first": min(verdicts) - entered, "all": max(verdicts) - entered,
                    "named_by": sorted(f["rank"] for f in naming)})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-torchrun", action="store_true", help="skip the torchrun scenarios")
    a = p.parse_args()
    logging.getLogger("trainer.heartbeat").addHandler(logging.NullHandler())
    logging.getLogger("trainer.heartbeat").propagate = False  # the verdicts, printed below

    cost, beat = marker_cost()
    fraction = cost / REFERENCE_STEP_S
    print(f"markers per step (2 micro batches, 12 markers): {cost * 1e6:.1f} us = "
          f"{100 * fraction:.4f}% of a {REFERENCE_STEP_S * 1e3:.0f} ms step; one beat's "
          f"progress payload {beat * 1e6:.0f} us (beat thread, once per interval)")

    print("\nranks as threads (3 ranks, one stuck in data; factor 2, floor 0.2 s, "
          "beats every 50 ms):")
    summary = {}
    for how in ("sleep", "spin"):
        typical, first, detect, named = thread_scenario(how)
        summary.setdefault("thread", (typical, detect, named))
        print(f"  {how:5}: typical step {typical:.3f}s, named {named} first {first:.2f}s "
              f"({first / typical:.1f} steps), by every rank {detect:.2f}s "
              f"({detect / typical:.1f} steps) after it stopped")

    headline = summary["thread"]
    if not a.no_torchrun:
        print("\nunder torchrun (tiny LM, 3 agents; factor 2, floor 0.5 s, beats every "
              "100 ms):")
        with tempfile.TemporaryDirectory(prefix="bench_hang_") as d:
            for s in torchrun_scenarios(Path(d)):
                print(f"  rank {s['culprit']} stuck in {s['section']:8}: typical step "
                      f"{s['typical']:.3f}s, limit {s['limit']:.2f}s, first named "
                      f"{s['first']:.2f}s ({s['first'] / s['typical']:.1f} steps), by "
                      f"ranks {s['named_by']} within {s['all']:.2f}s "
                      f"({s['all'] / s['typical']:.1f} steps)")
                if s["section"] == "data":
                    headline = (s["typical"], s["all"], [s["culprit"]])
    typical, detect, named = headline
    print(f"hang: typical_step_s={typical:.3f} detect_s={detect:.2f} "
          f"named_rank={','.join(map(str, named))} marker_cost={fraction:.6f} "
          f"straggler_detect_windows={detect_windows()}")


if __name__ == "__main__":
    main()
