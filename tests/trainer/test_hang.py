"""A rank that stops making progress: found by its progress markers while its heartbeat
thread beats on, named with its section and Python stack, dropped, and the job resumed;
a rank that stops altogether: found by its silent heartbeat.

The rule (trainer.hangs) is checked directly; the detection through the heartbeat with
threads standing in for ranks (one process, one c10d store); the whole path under real
torchrun agents (tests/support/elastic_job.py's --stall): the culprit exits, torchrun
restarts the group, the job resumes from its newest verified checkpoint and trains every
sample exactly once (audit log). Times are measured and printed, never asserted.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.support import elastic_job as job
from tests.support.thread_ranks import ThreadRanks
from trainer import ResumableSampler
from trainer.elastic import ElasticSummary, read_audit, read_jsonl
from trainer.exits import EXIT_HUNG
from trainer.hangs import HangRule, RankProgress, judge
from trainer.heartbeat import Heartbeat
from trainer.metrics import TrainerMetrics
from trainer.sections import Sections
from trainer.tiny_lm import WindowDataset, make_corpus

# ------------------------------------------------------------------------- the rule


def stats(**typical: float) -> dict[str, dict[str, float]]:
    return {k: {"count": 10, "typical": v, "best": v, "last": v, "worst": v}
            for k, v in typical.items()}


def test_a_sections_limit_is_k_typical_durations_within_floor_and_ceiling():
    rule = HangRule(factor=3.0, floor=1.0, ceiling=20.0)
    # a short section is measured against the step: 3 x 2.0 s
    assert rule.limit("data", stats(data=0.01, step=2.0)) == pytest.approx(6.0)
    assert rule.limit("save", stats(save=5.0, step=2.0)) == pytest.approx(15.0)
    assert rule.limit("data", stats(data=0.01, step=0.1)) == pytest.approx(1.0)   # floor
    assert rule.limit("save", stats(save=50.0, step=0.1)) == pytest.approx(75.0)  # 1.5 x worst
    s = stats(save=8.0, step=0.1)
    s["save"]["worst"] = 9.0
    assert rule.limit("save", s) == pytest.approx(20.0)                          # ceiling
    # not judged: never seen twice, or a section whose length is nobody's rule
    few = stats(data=0.01, step=0.1)
    few["data"]["count"] = 1
    assert rule.limit("data", few) is None
    for name in ("restore", "user", "idle", "finish"):
        assert rule.limit(name, stats(**{name: 0.1}, step=0.1)) is None
    with pytest.raises(ValueError, match="floor <= ceiling"):
        HangRule(floor=5.0, ceiling=2.0)


def progress(rank, section, mark, age, limit=1.0, n=3):
    return RankProgress(rank, section, age, mark, n, limit)


def test_the_rank_the_others_wait_for_is_named_not_the_waiting():
    # rank 1 never entered collective 4: the others (ahead, over any limit) wait for it
    view = {0: progress(0, "collective", 40, 9.0, n=4), 1: progress(1, "data", 37, 1.5),
            2: progress(2, "collective", 40, 9.0, n=4)}
    hang = judge(view)
    assert hang is not None and hang.culprits == [1] and not hang.together
    assert "rank 1 in data" in hang.describe()
    assert "ranks [0, 2] wait for it in collective 4" in hang.describe()
    # the same picture, rank 1 still within its limit: no verdict
    view[1] = progress(1, "data", 37, 0.5)
    assert judge(view) is None
    # all inside the same collective, over the limit: all named, none behind
    together = {r: progress(r, "collective", 40, 3.0, n=4) for r in range(3)}
    hang = judge(together)
    assert hang is not None and hang.culprits == [0, 1, 2] and hang.together


def test_markers_cost_little_and_record_each_sections_durations():
    s = Sections()
    for step in range(1, 51):
        s.step(step)
        s.enter("data")
        s.enter("forward")
        s.enter("backward")
        s.enter("collective")
        s.enter("optimizer")
        s.enter("save")
        s.discard()  # no save due
    with s.user("eval"):
        assert s.position().section == "eval"
    pos = s.position()
    assert (pos.section, pos.mark, pos.collectives, pos.step) == ("save", 300, 50, 50)
    st = s.stats()
    assert st["data"].count == 50 and st["collective"].count == 50
    assert st["step"].count == 49 and "save" not in st   # discarded saves are no saves
    payload = s.payload()
    assert json.loads(json.dumps(payload))["stats"]["backward"]["count"] == 50
    with pytest.raises(ValueError):
        with s.user("data"):
            pass


def test_a_named_hang_is_in_the_metrics(tmp_path):
    """The hung rank and its section as Prometheus series (written to the textfile before
    the process leaves), with this rank's section age."""
    metrics = TrainerMetrics(labels={"rank": "0"})
    textfile = tmp_path / "train.prom"
    metrics.export(textfile=str(textfile))
    metrics.hang_detected(culprit=1, section="data")
    metrics.write_textfile()
    text = textfile.read_text()
    assert 'ckpt_train_hung_rank{culprit_rank="1",rank="0",section="data"} 1.0' in text, text
    assert 'ckpt_train_hangs_total{rank="0"} 1.0' in text
    assert "ckpt_train_section_age_seconds" in text


# ------------------------------------------------------------------------- ranks as threads

@pytest.mark.parametrize("how", ["sleep", "spin"])
def test_a_rank_stuck_in_its_data_loader_is_named_by_every_rank(how):
    """Rank 1 stops in its data section at step 6 while its heartbeat thread runs; ranks 0
    and 2 wait in collective 6. Every rank (rank 1 too) names rank 1, in data, with the
    stack of its training thread; nobody names the waiting ranks."""
    rule = HangRule(factor=2.0, floor=0.3, ceiling=5.0)
    ranks = ThreadRanks(3, (1, 6, how), rule, step_sleep=0.15)
    typical, first, detect = ranks.run()
    for r in range(3):
        loss = ranks.lost[r][0]
        assert loss.reason == "hang" and loss.lost == [1], (r, loss)
        culprit = loss.hang.progress[1]
        assert culprit.section == "data" and culprit.collectives == 5
        assert culprit.stack and (f"{how}_in_" in culprit.stack), culprit.stack
        for w in (0, 2):  # ahead of it (as last published: maybe before collective 6)
            assert loss.hang.progress[w].mark > culprit.mark
            assert loss.hang.progress[w].collectives >= 5
    print(f"\n{how}: typical step {typical * 1e3:.0f} ms, limit {culprit.limit:.2f}s, "
          f"named first {first:.2f}s, by all 3 ranks {detect:.2f}s after it stopped "
          f"({detect / typical:.1f} typical steps)")


def test_forged_beats_in_the_store_crash_nothing_and_name_nobody():
    """Threat: anyone who reaches the job's c10d store (it has no authentication) can write
    a rank's key. Beats that are not objects, or whose progress is malformed (strings,
    NaN, negative or huge numbers, a megabyte of "stack"), must neither stop the watchdog
    nor name a rank; the real silence rule still applies (here: none)."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    sections = Sections()
    sections.begin_attempt()
    got: list = []
    hb = Heartbeat(dist.PrefixStore("hb", master), 0, 2, timeout=5.0, interval=0.05,
                   on_lost=got.append, sections=sections,
                   hang_rule=HangRule(factor=2.0, floor=0.05, ceiling=1.0)).start()
    forged = dist.PrefixStore("hb", master)
    for step in range(1, 4):  # rank 0 trains a little: its sections get limits
        sections.step(step)
        sections.enter("data")
        sections.enter("collective")
        time.sleep(0.02)
    big = "x" * 1_000_000
    for beat in ([1, 2], "hung", {"state": "alive", "section": "data", "age": "NaN",
                                  "mark": 0, "collectives": 0, "limit": 0.01},
                 {"state": "alive", "section": "data", "age": float("inf"), "mark": 0,
                  "collectives": 0, "limit": 0.0},
                 {"state": "alive", "section": big, "age": 99.0, "mark": 0,
                  "collectives": 0, "limit": 0.01},
                 {"state": "alive", "section": "data", "age": -5.0, "mark": -1,
                  "collectives": 0, "limit": 0.01},
                 {"state": "alive", "section": "data", "age": 99.0, "mark": "0",
                  "collectives": 0, "limit": 0.01}):
        forged.set("1", json.dumps(beat, allow_nan=True))
        time.sleep(0.15)
        assert not got, (beat if not isinstance(beat, dict) else beat.get("age"), got)
    # the watchdog still judges: a well-formed beat of a rank over its limit is named,
    # its stack cut to a bounded size (rank 1 in step 3's data: behind rank 0, inside
    # collective 3, and past the two collectives rank 0 completed)
    forged.set("1", json.dumps({"state": "alive", "section": "data", "age": 99.0, "mark": 5,
                                "collectives": 2, "limit": 0.01, "stack": big}))
    deadline = time.monotonic() + 3
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
    hb.stop()
    assert got and got[0].reason == "hang" and got[0].lost == [1]
    assert len(got[0].hang.progress[1].stack) <= 6000


# ------------------------------------------------------------------------- under torchrun

STEPS, EVERY, GLOBAL, MICRO, SENTENCES, SEED = 24, 4, 12, 2, 60, 0
SAMPLE_SLEEP = 0.04     # ~0.16 s of sleep per step and rank at world size 3, plus compute
HANG = dict(interval=0.1, factor=2.0, floor=0.5)
VERIFIED_WINDOW = 2  # a checkpoint is verified after 2 healthy steps; resumes prefer those
STALLS = ("1:9:sleep", "2:17:spin")   # rank:step:how, each once per job
HEARTBEAT_TIMEOUT, COLLECTIVE_TIMEOUT = 3.0, 30.0
JOB_TIMEOUT = 300.0


def job_args(tmp: Path, stalls: tuple[str, ...] = ()) -> list[str]:
    return ["--hold-until-world", "3", "--root", str(tmp / "ckpt"), "--run-dir",
            str(tmp / "run"), "--audit-dir", str(tmp / "audit"), "--steps", str(STEPS),
            "--every", str(EVERY), "--global-batch", str(GLOBAL), "--micro-batch", str(MICRO),
            "--sentences", str(SENTENCES), "--seed", str(SEED), "--sample-sleep",
            str(SAMPLE_SLEEP), "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT),
            "--heartbeat-interval", str(HANG["interval"]), "--collective-timeout",
            str(COLLECTIVE_TIMEOUT), "--hang-factor", str(HANG["factor"]), "--hang-floor",
            str(HANG["floor"]), "--verified-window", str(VERIFIED_WINDOW),
            *(a for s in stalls for a in ("--stall", s))]


def check_audit(audit_dir: Path) -> None:
    """Every step trained once in the end, each sample once per epoch, in the order of a
    run without failures (no sample skipped or repeated)."""
    records = read_audit(audit_dir)
    assert sorted(records) == list(range(1, STEPS + 1)), "a step is missing from the audit"
    expected = ResumableSampler(len(WindowDataset(make_corpus(SEED, SENTENCES))), seed=SEED)
    for step, rec in records.items():
        batch = [i for r in range(rec["world"]) for i in rec["ranks"][r]]
        assert batch == expected.next_indices(GLOBAL), f"step {step}: not the no-failure order"


def attempt_records(run_dir: Path, attempt: int) -> list[dict]:
    adir = run_dir / f"attempt-{attempt:04d}"
    return [r for p in sorted(adir.glob("rank-*.jsonl")) for r in read_jsonl(p)]


def run_cluster(tmp: Path, args: list[str], act=None) -> tuple[job.LocalCluster, ElasticSummary]:
    """Three torchrun agents (restart grace 2 s, warm restarts: a worker is forked from its
    node's zygote instead of importing torch again) run the job; ``act(cluster)`` meanwhile."""
    c = job.LocalCluster(tmp, args, restart_grace=2.0, max_restarts=6, warm=True,
                         forked=True)
    try:
        nodes = [c.add_node() for _ in range(3)]
        if act is not None:
            act(c)
        codes = c.wait(JOB_TIMEOUT)
        assert set(codes.values()) == {0}, f"agent exit codes {codes}\n{c.logs()[-20000:]}"
    finally:
        c.close()
    s = ElasticSummary.from_dict(json.loads((tmp / "run" / "summary.json").read_text()))
    print("\n" + s.format())
    assert s.final_step == STEPS and len(nodes) == 3
    return c, s


_VERIFIED = re.compile(r"\[pid (\d+) rank \d+\] ckpt\.trainer INFO train\.verified step=(\d+)")


def newest_verified(c: job.LocalCluster, run_dir: Path, attempt: int) -> int | None:
    """The newest step the workers of attempts up to ``attempt`` marked verified (their
    ``train.verified`` lines)."""
    pids = {r["pid"] for a in range(attempt + 1) for r in attempt_records(run_dir, a)
            if r["event"] == "start"}
    return max((int(step) for pid, step in _VERIFIED.findall(c.logs()) if int(pid) in pids),
               default=None)


def typical_step(records: list[dict]) -> float:
    """The median time between rank 0's consecutive step records."""
    times = sorted(r["time"] for r in records if r["event"] == "step" and r["rank"] == 0)
    return statistics.median(b - a for a, b in zip(times, times[1:]))


STOP_AT = 20  # after both stalls, rank 1 is SIGSTOPped once the job passed this step


def stop_rank_1_after_the_stalls(tmp: Path, stopped: dict[str, float]):
    """``act`` for run_cluster: once both stalls happened and a new attempt trains at world
    size 3 past STOP_AT, SIGSTOP its rank 1 (the whole process: its heartbeat stops too)."""
    def ready(c: job.LocalCluster):
        if not (tmp / "run" / f"stalled-{len(STALLS) - 1}").exists():
            return None
        p = job.progress(tmp / "run")
        a = max(p, default=None)
        if a is None or any(r["event"] == "failure" for r in p[a]["events"]):
            return None
        ok = p[a]["world"] == 3 and len(p[a]["pids"]) == 3 and p[a]["step"] >= STOP_AT
        return (a, p[a]) if ok else None

    def act(c: job.LocalCluster) -> None:
        attempt, info = job.wait_for(lambda: ready(c), JOB_TIMEOUT, "the third attempt",
                                     cluster=c)
        os.kill(info["pids"][1], signal.SIGSTOP)
        stopped.update(at=time.time(), attempt=attempt)
    return act


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_hung_rank_is_named_dropped_and_the_job_resumes(tmp_path):
    """Under torchrun at world size 3, three hangs in one job. Rank 1 sleeps in its data
    loader at step 9, later rank 2 spins in Python at step 17, each while its heartbeat
    thread runs: every rank records the culprit with its section and its training
    thread's stack, the culprit exits with EXIT_HUNG. Then rank 1's process is SIGSTOPped
    (its heartbeat stops too): the others name it from its silence, its agent kills it
    after the restart grace. Each time torchrun restarts the group and the job resumes
    from its newest verified checkpoint (healthy for 2 steps after it); in the end every
    sample was trained exactly once, none skipped or repeated."""
    stopped: dict[str, float] = {}
    c, s = run_cluster(tmp_path, job_args(tmp_path, STALLS),
                       stop_rank_1_after_the_stalls(tmp_path, stopped))
    ended = [a for a in range(s.attempts) if any(
        r["event"] == "failure" for r in attempt_records(tmp_path / "run", a))]
    assert len(ended) == 3 and ended[-1] == stopped["attempt"], (ended, stopped, s)
    for attempt, stall in zip(ended, STALLS):
        rank, step, how = stall.split(":")
        culprit = int(rank)
        records = attempt_records(tmp_path / "run", attempt)
        fails = [r for r in records if r["event"] == "failure"]
        assert sorted(f["rank"] for f in fails) == [0, 1, 2], fails
        # the culprit and at least one other rank name it (a third may instead see the
        # store or a collective go with the first to leave)
        naming = [f for f in fails if f["reason"] == "hung rank"]
        assert culprit in {f["rank"] for f in naming} and len(naming) >= 2, fails
        for f in naming:
            assert f["lost"] == [culprit], f
            hung = f["hung"][rank]
            assert hung["section"] == ("data" if how == "sleep" else "forward"), hung
            assert hung["step"] == int(step) - 1
            frame = "__getitem__" if how == "sleep" else "step_fn"
            assert frame in hung["stack"] and "maybe_stall" in hung["stack"], hung["stack"]
            assert all(w.startswith(("collective", "backward"))
                       for w in f["waiting"].values()), f["waiting"]
        rec = next(r for r in s.recoveries if r.attempt == attempt)
        # the summary lists every rank's reason: the third rank's may be the collective
        assert rec.lost_ranks == [culprit] and "hung rank" in rec.reason.split(", "), rec
        # resumed from the newest verified checkpoint (not a newer one still unconfirmed)
        assert rec.restored_step == newest_verified(c, tmp_path / "run", attempt), rec
        typical = typical_step(records)
        verdicts = [f.get("detected_at") or f["time"] for f in naming]
        first = min(verdicts)
        entered = min(f["last_seen"][rank] for f in naming)
        print(f"attempt {attempt}: rank {culprit} stuck ({how}) in step {step}; typical step "
              f"{typical:.3f}s, limit {naming[0]['hung'][rank]['limit']:.2f}s, first named "
              f"{first - entered:.2f}s after it stopped ({(first - entered) / typical:.1f} "
              f"typical steps), by all ranks {max(verdicts) - entered:.2f}s; "
              f"resumed from step {rec.restored_step}")
    # the culprits left with their own status (their agents logged it), and the ckpt.trainer
    # log names each one with its section and the innermost line of its stack
    logs = c.logs()
    assert len(re.findall(rf"exitcode: {EXIT_HUNG}\b", logs)) == 2, logs[-5000:]
    for rank, section, line in (("1", "data", "time.sleep"), ("2", "forward", "while True")):
        hangs = re.findall(rf"train\.hang rank=\d culprit={rank} section={section} .*", logs)
        assert len(hangs) >= 2 and all(line in h for h in hangs), hangs

    # the stopped rank: named from its silent heartbeat by the first to notice (the other
    # may instead see the first one leave: a failed collective, or the store gone with
    # rank 0's process)
    fails = sorted((r for r in attempt_records(tmp_path / "run", stopped["attempt"])
                    if r["event"] == "failure"), key=lambda f: f["time"])
    assert fails and fails[0]["reason"] == "lost ranks (heartbeat)", fails
    assert fails[0]["lost"] == [1], fails
    rec = next(r for r in s.recoveries if r.attempt == stopped["attempt"])
    assert rec.lost_ranks == [1] and "lost ranks (heartbeat)" in rec.reason, rec
    assert rec.restored_step == newest_verified(c, tmp_path / "run", stopped["attempt"]), rec
    assert rec.steps_lost == rec.last_step - rec.restored_step
    print(f"attempt {stopped['attempt']}: rank 1 SIGSTOPped, named "
          f"{fails[0]['time'] - stopped['at']:.2f}s later (heartbeat timeout "
          f"{HEARTBEAT_TIMEOUT:.0f}s); resumed from step {rec.restored_step}")
    check_audit(tmp_path / "audit")
