"""ElasticTrainer under real torchrun agents: nodes killed, a node joining (hung ranks:
test_hang.py).

Each "node" is one torchrun agent with one worker on this machine, joined by a c10d
rendezvous whose store the test hosts (see tests/support/elastic_job.py, LocalCluster). The job
trains the tiny LM for 40 steps at a global batch of 12 (micro batches of 2: 3 accumulation
steps at world size 2, 2 at world size 3), checkpointing every 10 steps.

What is checked after each disruption:
- the job reaches its final step and every surviving agent exits 0;
- the failure was detected and recorded by every survivor (how fast: benchmarks/bench_elastic.py);
- the global batch stayed 12 at every step, in micro batches of 2 (audit log);
- the samples trained, keeping per step the record of the newest attempt (a step redone
  after a restore replaces the lost one), are exactly the no-failure run's order: every
  sample once per epoch (the 128-sample corpus gives 3+ epochs in 40 steps);
- the loss curve continues: the mean loss of the last 10 steps is within 15% of an
  uninterrupted single-process run at the same global batch;
- the summary's restarts, world sizes and steps lost match what happened (printed; run
  pytest with -s to see the recovery timelines).
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.support import elastic_job as job
from tests.support.ranks import forkserver
from trainer import ResumableSampler
from trainer.elastic import (ElasticSummary, ElasticTrainer, check_world_size, read_audit,
                             read_jsonl, valid_world_sizes)
from trainer.heartbeat import Heartbeat
from trainer.tiny_lm import WindowDataset, make_corpus

STEPS, EVERY, GLOBAL, MICRO, SENTENCES, SEED = 40, 10, 12, 2, 60, 0
HEARTBEAT_TIMEOUT, COLLECTIVE_TIMEOUT = 5.0, 10.0
SAMPLE_SLEEP = 0.01  # simulated compute per sample: ~0.1 s steps, room to act mid-training
KILL_AT = 22         # act once the job passed this step (a checkpoint at 20 is committed)
LOSS_TOLERANCE = 0.15
JOB_TIMEOUT = 240.0  # a guard against a hang: the jobs run two at a time on a loaded machine


def job_args(tmp: Path, *, sleep: float = SAMPLE_SLEEP, hold: tuple = ()) -> list[str]:
    return [*hold, "--root", str(tmp / "ckpt"), "--run-dir", str(tmp / "run"), "--audit-dir",
            str(tmp / "audit"), "--steps", str(STEPS), "--every", str(EVERY),
            "--global-batch", str(GLOBAL), "--micro-batch", str(MICRO), "--sentences",
            str(SENTENCES), "--seed", str(SEED), "--sample-sleep", str(sleep),
            "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--collective-timeout",
            str(COLLECTIVE_TIMEOUT)]


def losses(run_dir: Path) -> dict[int, float]:
    """Loss per step, the newest attempt's value for a step trained twice."""
    out: dict[int, tuple[int, float]] = {}
    for adir in sorted(run_dir.glob("attempt-*")):
        a = int(adir.name.split("-")[1])
        for p in adir.glob("rank-*.jsonl"):
            for r in read_jsonl(p):
                if r["event"] == "step" and (r["step"] not in out or out[r["step"]][0] <= a):
                    out[r["step"]] = (a, r["loss"])
    return {s: v for s, (_, v) in sorted(out.items())}


def check_audit(audit_dir: Path, steps: int = STEPS) -> dict[int, dict]:
    """Constant global batch, micro batches of MICRO, and the no-failure sample order."""
    records = read_audit(audit_dir)
    assert sorted(records) == list(range(1, steps + 1)), "a step is missing from the audit"
    n = len(WindowDataset(make_corpus(SEED, SENTENCES)))
    expected = ResumableSampler(n, seed=SEED)
    seen: list[int] = []
    for step, rec in records.items():
        world = rec["world"]
        assert sorted(rec["ranks"]) == list(range(world)), (step, rec["ranks"].keys())
        batch = [i for r in range(world) for i in rec["ranks"][r]]
        assert len(batch) == GLOBAL, f"step {step}: global batch {len(batch)} at world {world}"
        assert all(m == MICRO for ms in rec["micro"].values() for m in ms), rec["micro"]
        assert len(rec["micro"][0]) == GLOBAL // (MICRO * world)
        assert batch == expected.next_indices(GLOBAL), f"step {step}: not the no-failure order"
        seen.extend(batch)
    for e in range(0, len(seen), n):  # exactly once per epoch
        epoch = seen[e:e + n]
        assert len(set(epoch)) == len(epoch) and (len(epoch) < n or set(epoch) == set(range(n)))
    return records


def summary_of(tmp: Path) -> ElasticSummary:
    return ElasticSummary.from_dict(json.loads((tmp / "run" / "summary.json").read_text()))


def check_loss(tmp: Path, reference: dict[int, float]) -> tuple[float, float]:
    got = losses(tmp / "run")
    assert sorted(got) == list(range(1, STEPS + 1))
    tail = sum(got[s] for s in range(STEPS - 9, STEPS + 1)) / 10
    ref = sum(reference[s] for s in range(STEPS - 9, STEPS + 1)) / 10
    assert abs(tail - ref) <= LOSS_TOLERANCE * ref, (
        f"mean loss of the last 10 steps {tail:.4f} vs uninterrupted {ref:.4f}")
    assert tail < got[1] * 0.7, "the model did not learn"
    return tail, ref


def failure_records(tmp: Path, attempt: int) -> list[dict]:
    adir = tmp / "run" / f"attempt-{attempt:04d}"
    return [r for p in adir.glob("rank-*.jsonl") for r in read_jsonl(p)
            if r["event"] == "failure"]


def at_step(run_dir: Path, world: int, step: int):
    """The newest attempt once it runs at ``world`` ranks and passed ``step``."""
    def check():
        p = job.progress(run_dir)
        if not p:
            return None
        a = max(p)
        ok = p[a]["world"] == world and p[a]["step"] >= step and len(p[a]["pids"]) == world
        return (a, p[a]) if ok else None
    return check


def plain_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=job.REPO)
    for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    return env


def run_plain(args: list[str], log: Path) -> None:
    """The job as a plain process (no torchrun), forked from the suite's fork server (no
    second import of torch); it must exit 0."""
    proc = forkserver().Process(target=job.run_plain, args=(args, plain_env(), str(log)))
    proc.start()
    proc.join(JOB_TIMEOUT)
    if proc.is_alive():
        proc.kill()
        proc.join()
    assert proc.exitcode == 0, (proc.exitcode, log.read_text(errors="replace")[-8000:])


def run_reference(tmp: Path) -> dict[int, float]:
    """An uninterrupted run as a plain single process (no torchrun, world size 1)."""
    run_plain(job_args(tmp, sleep=0.0), tmp / "reference.log")
    s = summary_of(tmp)
    assert (s.final_step, s.world_sizes, s.steps_lost, s.restarts) == (STEPS, [1], 0, 0)
    check_audit(tmp / "audit")
    assert all(m == GLOBAL // MICRO for m in
               [len(r["micro"][0]) for r in read_audit(tmp / "audit").values()])
    return losses(tmp / "run")


def finish(c: job.LocalCluster, survivors: list[job.Node], tmp: Path) -> ElasticSummary:
    deadline = time.time() + JOB_TIMEOUT
    for n in survivors:
        try:
            n.proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{n.name} still running after {JOB_TIMEOUT:.0f}s\n{c.logs()[-20000:]}")
    codes = {n.name: n.proc.returncode for n in survivors}
    assert set(codes.values()) == {0}, f"agent exit codes {codes}\n{c.logs()[-20000:]}"
    s = summary_of(tmp)
    print("\n" + s.format())
    assert s.final_step == STEPS
    return s


# ------------------------------------------------------------------------- quick unit checks


def test_world_sizes_that_do_not_split_the_global_batch_are_refused(monkeypatch, tmp_path):
    assert valid_world_sizes(12, 2) == [1, 2, 3, 6]
    assert check_world_size(12, 2, 3) == 2
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"world sizes that work: 1, 2, 3, 6"):
        ElasticTrainer(lambda: None, lambda p: None, [0] * 10, lambda m, b: None,
                       checkpoint_root=tmp_path, checkpoint_every=1, global_batch_size=12,
                       micro_batch_size=2)
    with pytest.raises(ValueError, match="none"):
        check_world_size(12, 5, 1)


def test_heartbeat_names_a_silent_peer_and_a_dead_store():
    """Three heartbeats on one store: one stops beating (a hung rank) -> the others name it
    within the timeout; then the store's host dies -> reported as a store failure fast."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def client(rank):
        s = dist.TCPStore("127.0.0.1", master.port, is_master=False,
                          timeout=datetime.timedelta(seconds=5))
        return dist.PrefixStore("hb", s)

    lost: dict[int, list] = {0: [], 1: [], 2: []}
    beats = [Heartbeat(client(r), r, 3, timeout=1.5, interval=0.25,
                       on_lost=lost[r].append).start() for r in range(3)]
    for b in beats:
        b.update(7)
    time.sleep(1.0)
    assert not any(lost.values()), lost
    # rank 2 hangs: its threads stop, its key stops changing (nothing marks it stopped)
    beats[2]._stopping.set()
    t0 = time.monotonic()
    while not (lost[0] and lost[1]) and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    took = time.monotonic() - t0
    assert lost[0] and lost[1], "the hung rank was not noticed"
    # silence counts from the last change seen, up to two beats (0.5 s) before the stop
    assert 1.0 <= took <= 1.5 + 1.5, took
    for r in (0, 1):
        assert lost[r][0].lost == [2] and lost[r][0].reason == "heartbeat"
        assert lost[r][0].last_steps == {2: 7}

    # a fresh pair whose store host goes away: refused connections, reported within ~2 beats
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    got: list = []
    hb = Heartbeat(dist.TCPStore("127.0.0.1", host.port, is_master=False,
                                 timeout=datetime.timedelta(seconds=5)), 1, 2, timeout=3.0,
                   interval=0.25, on_lost=got.append).start()
    peer = Heartbeat(dist.TCPStore("127.0.0.1", host.port, is_master=False,
                                   timeout=datetime.timedelta(seconds=5)), 0, 2, timeout=3.0,
                     interval=0.25).start()
    time.sleep(0.6)
    peer._stopping.set()
    del host  # the server goes with its last reference
    t0 = time.monotonic()
    while not got and time.monotonic() - t0 < 6:
        time.sleep(0.05)
    assert got and got[0].reason == "store" and got[0].lost == [0], got
    assert time.monotonic() - t0 < 3.0
    for b in (*beats, hb):
        b.stop()


@pytest.mark.slow
@pytest.mark.multiproc
def test_heartbeat_notices_a_hung_store_host():
    """The process hosting the store is stopped (rank 0 hangs): store calls block, yet the
    watchdog (which never calls the store) reports it after the timeout."""
    # the host: a process of its own, forked from the suite's fork server (torch imported)
    ctx = forkserver()
    ours, theirs = ctx.Pipe()
    host = ctx.Process(target=job.host_store, args=(theirs,), daemon=True)
    host.start()
    theirs.close()
    try:
        assert ours.poll(60), "the store's host did not start"
        port = ours.recv()
        got: list = []
        hb = Heartbeat(dist.TCPStore("127.0.0.1", port, is_master=False,
                                     timeout=datetime.timedelta(seconds=30)), 1, 2,
                       timeout=2.0, interval=0.25, on_lost=got.append).start()
        peer = Heartbeat(dist.TCPStore("127.0.0.1", port, is_master=False,
                                       timeout=datetime.timedelta(seconds=30)), 0, 2,
                         timeout=2.0, interval=0.25).start()
        time.sleep(0.6)
        assert not got
        os.kill(host.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        while not got and time.monotonic() - t0 < 8:
            time.sleep(0.05)
        assert got and got[0].reason == "store" and got[0].lost == [0], got
        assert "has not answered" in got[0].detail
    finally:
        host.kill()
        host.join()
    peer._stopping.set()
    hb._stopping.set()


def test_stopped_ranks_are_not_reported():
    """A rank that finished (stop() marks it) is not a lost rank."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    got: list = []
    a = Heartbeat(dist.PrefixStore("x", master), 0, 2, timeout=0.8, interval=0.2,
                  on_lost=got.append).start()
    b = Heartbeat(dist.PrefixStore("x", master), 1, 2, timeout=0.8, interval=0.2).start()
    time.sleep(0.5)
    b.stop(final_state="done")
    time.sleep(1.5)
    assert not got
    a.stop()


# ------------------------------------------------------------------------- torchrun scenarios
#
# The jobs of the selected tests run two at a time (a torchrun job spends much of its time
# waiting: for a rendezvous's last call, a peer's start, its sleeps per sample), the longest
# first, started by the first of these tests (they come after the quick checks above); each
# test asserts on the records of its own job.

# The jobs each test needs (the reference: the loss curve of an uninterrupted run), the
# longest first.
NEEDS = {"test_node_killed_survivors_resume_at_world_2": ("kills_and_a_join", "reference"),
         "test_rank0_node_killed_then_a_node_joins": ("kills_and_a_join", "reference"),
         "test_fsdp2_model_trains_and_resumes_on_another_world_size": ("fsdp2",),
         "test_users_data_loader_hooks_and_ema_survive_a_killed_node": ("loader",)}


class Results:
    """The jobs' futures; ``jobs[name]`` waits for that job (its error is the test's)."""

    def __init__(self, futures: dict[str, cf.Future]) -> None:
        self.futures = futures

    def __getitem__(self, name: str):
        return self.futures[name].result()


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    runs = {"kills_and_a_join": run_kills_and_a_join, "reference": run_reference,
            "loader": run_loader, "fsdp2": run_fsdp2}
    needed = {name for item in request.session.items if item.module is request.module
              for name in NEEDS.get(item.originalname, ())}
    wanted = [name for name in runs if name in needed]
    with cf.ThreadPoolExecutor(2) as pool:
        yield Results({name: pool.submit(runs[name], tmp_path_factory.mktemp(name))
                       for name in wanted})



def check_node_loss(s: ElasticSummary, rec, tmp: Path, victim: int, attempt: int,
                    killed_at: float, kill_at: int) -> float:
    """The recovery ``rec`` after the SIGKILL of rank ``victim``'s node during ``attempt``
    (at world size 3, past step ``kill_at``); returns how long after the kill the survivors
    had both noticed."""
    assert s.restarts >= 1
    assert rec.attempt == attempt, (rec, attempt)
    assert rec.world_before == 3 and rec.world_after == 2, rec
    assert rec.lost_ranks == [victim], rec
    # detected: both survivors recorded the failure (the wait for the job bounds how long)
    fails = failure_records(tmp, attempt)
    assert len(fails) == 2, fails
    detect = max(f["time"] for f in fails) - killed_at
    assert detect >= 0, detect  # how fast is measured by bench_elastic, not asserted here
    # resumed from the newest checkpoint before the failure; the steps after it were redone
    assert rec.restored_step is not None and rec.restored_step % EVERY == 0
    assert kill_at - 2 * EVERY <= rec.restored_step <= rec.last_step
    assert rec.steps_lost == rec.last_step - rec.restored_step
    assert s.steps_lost == sum(r.steps_lost for r in s.recoveries), s
    return detect


# One job, three membership changes, shared by the two tests below (a torchrun job costs
# more to start than a recovery): rank 0's node (its worker hosts the job's store) is
# SIGKILLed at world size 3 past step KILL_AT and the survivors resume at world size 2;
# a third node joins at step JOIN_AT (the workers hold there until the agents notice it)
# and the job trains at world size 3 again; then, with every rank paused before step
# PAUSE_AT, rank 1's node is SIGKILLed and the survivors resume at world size 2.
JOIN_AT = KILL_AT + 3
PAUSE_AT = 33  # a checkpoint at 30 is committed
# torchrun's agent log line for a worker that failed (each one uses up a --max-restarts)
_WORKER_FAILED = re.compile(r"failed \(exitcode: -?\d+\) local_rank: \d+ \(pid: (\d+)\)")


def paused(run_dir: Path, after: int):
    """The attempt and the pids of its three ranks once each paused before step PAUSE_AT,
    in an attempt after ``after``."""
    def check():
        for attempt in range(after + 1, max(job.progress(run_dir), default=0) + 1):
            marks = [run_dir / f"paused-s{PAUSE_AT}-a{attempt}-r{r}" for r in range(3)]
            if all(m.exists() for m in marks):
                return attempt, [int(m.read_text()) for m in marks]
        return None
    return check


def run_kills_and_a_join(tmp: Path) -> dict:
    hold = ("--hold-until-world", "3", "--hold-at", str(JOIN_AT), "--hold-at-below-world", "3",
            "--pause-at", str(PAUSE_AT), "--pause-at-world", "3")
    # max_restarts: the two node losses use up one each (the join none), and a loaded
    # machine may add one (see check_join_used_no_restart)
    c = job.LocalCluster(tmp, job_args(tmp, hold=hold), max_restarts=4, forked=True)
    facts: dict = {"tmp": tmp}
    try:
        nodes = [c.add_node() for _ in range(3)]
        attempt, info = job.wait_for(at_step(tmp / "run", 3, KILL_AT), JOB_TIMEOUT,
                                     "training at world size 3", cluster=c)
        dead = c.node_of(info["pids"][0])
        killed_at = dead.kill(signal.SIGKILL)  # the agent and its worker: a whole node
        facts["rank0"] = dict(attempt=attempt, step=info["step"], killed_at=killed_at)
        survivors = [n for n in nodes if n is not dead]
        shrunk, shrunk_info = job.wait_for(at_step(tmp / "run", 2, KILL_AT), JOB_TIMEOUT,
                                           "training at world size 2", cluster=c)
        facts["shrunk"] = shrunk
        facts["restarts_before_join"] = max(r["restart_count"] for r in shrunk_info["events"]
                                            if r["event"] == "start")
        survivors.append(c.add_node())  # waits at the rendezvous; the agents restart

        joined, pids = job.wait_for(paused(tmp / "run", shrunk), JOB_TIMEOUT, "every rank to "
                                    f"pause at step {PAUSE_AT} at world size 3", cluster=c)
        # the agents' logs of the join, before the second loss adds its failed workers
        facts["join_nodes"], facts["joined"] = list(survivors), joined
        facts["join_logs"] = {n.name: n.log() for n in survivors}
        dead = c.node_of(pids[1])
        killed_at = dead.kill(signal.SIGKILL)
        (tmp / "run" / f"release-s{PAUSE_AT}").touch()  # the survivors meet it in a collective
        facts["rank1"] = dict(attempt=joined, step=PAUSE_AT - 1, killed_at=killed_at)
        survivors = [n for n in survivors if n is not dead]
        facts["summary"] = finish(c, survivors, tmp)
    finally:
        c.close()
    return facts


@pytest.mark.slow
@pytest.mark.multiproc
def test_node_killed_survivors_resume_at_world_2(jobs):
    """Rank 1's node is SIGKILLed at world size 3 (the job's third membership change; rank 0's
    node, the host of the job's store, is killed in the first, see
    test_rank0_node_killed_then_a_node_joins); the two survivors resume at world size 2 and
    finish the job."""
    facts, reference = jobs["kills_and_a_join"], jobs["reference"]
    tmp = facts["tmp"]
    s, kill = facts["summary"], facts["rank1"]
    assert s.world_sizes[-1] == 2 and s.world_sizes[-2] == 3, s.world_sizes
    rec = s.recoveries[-1]
    detect = check_node_loss(s, rec, tmp, 1, kill["attempt"], kill["killed_at"], PAUSE_AT - 1)
    check_audit(tmp / "audit")
    tail, ref = check_loss(tmp, reference)
    print(f"killed rank 1's node at step {kill['step']}; survivors detected it {detect:.2f}s "
          f"later; mean loss of the last 10 steps {tail:.4f} (uninterrupted {ref:.4f})")


def check_join_used_no_restart(nodes: list, logs: dict[str, str], runs: dict[int, dict],
                               joined_from: int, joined: int) -> None:
    """Each agent stopped its worker of attempt ``joined_from`` for the join (a SIGTERM: a
    membership change) and never saw it fail, and every restart it counted after that is a
    worker it saw fail before that worker recorded a start. (Under heavy load a worker of
    the next round can start more than the collective timeout after its peers: their
    process group does not form, torchrun counts a restart, and no attempt is recorded.)
    ``joined``: the attempt at world size 3 after the join; ``logs``: each agent's log up to
    its training."""
    started = {e["pid"] for r in runs.values() for e in r["events"] if e["event"] == "start"}

    def restart_counts(attempt: int) -> dict[int, int]:
        return {e["pid"]: e["restart_count"] for e in runs[attempt]["events"]
                if e["event"] == "start"}
    before, after = restart_counts(joined_from), restart_counts(joined)
    assert len(before) == 2 and len(after) == 3, (before, after)
    for node in nodes:
        log = logs[node.name]
        stopped = [pid for pid in before if f"[pid {pid} " in log]  # the worker lines' prefix
        (now,) = [count for pid, count in after.items() if f"[pid {pid} " in log]
        after_join = log
        if stopped:  # one of the two nodes that trained at world size 2
            (pid,) = stopped
            stop_line = f"Sending process {pid} closing signal SIGTERM"
            assert stop_line in log, (node.name, pid, "its agent did not stop it for the join")
            after_join = log.split(stop_line, 1)[1]
        failed = [int(p) for p in _WORKER_FAILED.findall(after_join)]
        assert not set(failed) & started, (node.name, failed, "a started worker failed")
        assert now == sum(before[p] for p in stopped) + len(failed), (node.name, now, failed)


@pytest.mark.slow
@pytest.mark.multiproc
def test_rank0_node_killed_then_a_node_joins(jobs):
    """The job's first two membership changes. Rank 0's node (its worker hosts the job's
    store) is SIGKILLed at world size 3: the survivors resume at world size 2. Then a third
    node starts; the workers wait at step 25 for the agents to notice it (a slow agent start
    must not let the job go on first); the agents SIGTERM them and training continues at
    world size 3."""
    facts, reference = jobs["kills_and_a_join"], jobs["reference"]
    tmp = facts["tmp"]
    s, kill, shrunk = facts["summary"], facts["rank0"], facts["shrunk"]
    assert s.world_sizes[-4:] == [3, 2, 3, 2], s.world_sizes
    kill_rec, join = s.recoveries[-3:-1]
    assert join.attempt == shrunk, (join, shrunk)
    detect = check_node_loss(s, kill_rec, tmp, 0, kill["attempt"], kill["killed_at"], KILL_AT)
    # the join: SIGTERM from the agents became a checkpoint of the current step, nothing redone
    assert join.world_before == 2 and join.world_after == 3, join
    assert join.reason.startswith("SIGTERM") and join.lost_ranks == [], join
    assert join.steps_lost == 0 and join.restored_step == join.last_step == JOIN_AT, join
    # membership changes do not use up torchrun's --max-restarts; the node's death did
    assert facts["restarts_before_join"] >= 1, facts["restarts_before_join"]
    check_join_used_no_restart(facts["join_nodes"], facts["join_logs"],
                               job.progress(tmp / "run"), shrunk, facts["joined"])
    check_audit(tmp / "audit")
    tail, ref = check_loss(tmp, reference)
    print(f"killed rank 0's node at step {kill['step']}; survivors detected it "
          f"{detect:.2f}s later; a node joined at step {JOIN_AT}; mean loss of the last 10 "
          f"steps {tail:.4f} (uninterrupted {ref:.4f})")


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_model_trains_and_resumes_on_another_world_size(jobs):
    """fsdp=True: the model is sharded with fully_shard and checkpointed through
    ckpt.ModelOptimizer; the job trained on 3 ranks continues as one plain process."""
    tmp_path = jobs["fsdp2"]
    s = summary_of(tmp_path)
    print("\n" + s.format())
    assert (s.final_step, s.world_sizes, s.restores, s.steps_lost) == (12, [3, 1], [0, 8], 0)
    check_audit(tmp_path / "audit", steps=12)
    manifest = json.loads((tmp_path / "ckpt" / "step-00000008" / "manifest.json").read_text())
    assert "train" in manifest["items"] and "model" not in manifest["items"]
    assert manifest["world_size"] == 3


def run_fsdp2(tmp_path: Path) -> Path:
    """The job on 3 ranks under torchrun for 8 steps, then on as one plain process to 12."""
    args = job_args(tmp_path, sleep=0.0) + ["--fsdp"]
    # No restarts here: the group must form at the first try, however slowly the three
    # workers start beside another job (their first collective waits this long for them).
    args[args.index("--collective-timeout") + 1] = "30"
    args[args.index("--every") + 1] = "4"
    args[args.index("--steps") + 1] = "8"
    proc = job.torchrun_forked(["--standalone", f"--log-dir={tmp_path / 'torchelastic'}",
                                "--nproc-per-node=3", job.SCRIPT, *args], plain_env(),
                               tmp_path, JOB_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    args[args.index("--steps") + 1] = "12"
    run_plain(args, tmp_path / "plain.log")  # the same job, on as one plain process
    return tmp_path


LOADER_STEPS, LOADER_EVERY, LOADER_KILL_AT, EVAL_EVERY = 30, 5, 12, 4


def hook_records(hooks_dir: Path) -> dict[int, dict[str, list[dict]]]:
    """The hooks' records per step, of the newest attempt that ran the step (the records
    of a step redone after the restore replace the lost try): {step: {kind: [records]}}."""
    newest: dict[int, int] = {}
    records = [r for p in sorted(hooks_dir.glob("hooks-*.jsonl")) for r in read_jsonl(p)]
    for r in records:
        if r["kind"] in ("seen", "step"):
            newest[r["step"]] = max(newest.get(r["step"], -1), r["attempt"])
    out: dict[int, dict[str, list[dict]]] = {}
    for r in records:
        if r["kind"] != "ckpt" and r["attempt"] == newest.get(r["step"]):
            out.setdefault(r["step"], {}).setdefault(r["kind"], []).append(r)
    return dict(sorted(out.items()))


@pytest.mark.slow
@pytest.mark.multiproc
def test_users_data_loader_hooks_and_ema_survive_a_killed_node(jobs):
    """ElasticTrainer with a user's DataLoader factory (2 workers, its own collate_fn),
    hooks and extra checkpointed items (an EMA of the model, a counter), on two torchrun
    nodes; rank 1's node is SIGKILLed, the survivor resumes alone. The samples step_fn
    really received, per step of the surviving history, are the no-failure order: none
    skipped, none repeated, although the workers had fetched past the checkpoint. The
    hooks ran for every step (evaluation every 4); the EMA and the counter continued from
    the checkpoint; after_checkpoint came for the resumed run's checkpoints."""
    tmp_path = jobs["loader"]
    s = summary_of(tmp_path)
    print("\n" + s.format())
    assert s.final_step == LOADER_STEPS and 2 in s.world_sizes and s.world_sizes[-1] == 1
    restored = s.recoveries[-1].restored_step
    assert restored is not None and restored % LOADER_EVERY == 0 and restored >= LOADER_EVERY

    # The samples trained: the trainer's audit, and what step_fn really got from the loader.
    audit = check_audit(tmp_path / "audit", steps=LOADER_STEPS)
    hooks = hook_records(tmp_path / "hooks")
    assert sorted(hooks) == list(range(1, LOADER_STEPS + 1))
    for step, rec in audit.items():
        got = sorted(hooks[step]["seen"], key=lambda r: r["rank"])  # micro batches in order
        assert [i for r in got for i in r["ids"]] == [
            i for r in sorted(rec["ranks"]) for i in rec["ranks"][r]], step
        assert {r["attempt"] for r in got} == {rec["attempt"]}

    # Hooks: after_step on every rank at every step, evaluation every EVAL_EVERY steps.
    for step, rec in hooks.items():
        world = rec["step"][0]["world"]
        assert len(rec["step"]) == world and len(rec["ema"]) == world, (step, rec)
        assert len(rec.get("eval", [])) == (world if step % EVAL_EVERY == 0 else 0), step
        # the EMA and the counter continue across the restore: one update per step so far
        assert all(r["counter"] == r["ema_updates"] == step - 1 for r in rec["step"]), rec
    first = hooks[restored + 1]["step"][0]
    assert first["attempt"] > hooks[restored]["ema"][0]["attempt"]  # trained before the kill
    assert first["ema_before"] == hooks[restored]["ema"][0]["ema_after"]
    resumed = [r for p in (tmp_path / "hooks").glob(f"hooks-a{first['attempt']}-*.jsonl")
               for r in read_jsonl(p) if r["kind"] == "ckpt"]
    assert [r["step"] for r in resumed] == list(range(restored + LOADER_EVERY,
                                                      LOADER_STEPS + 1, LOADER_EVERY))


def run_loader(tmp_path: Path) -> Path:
    """Two torchrun nodes train with the user's data loader, hooks and extra state; rank 1's
    node is SIGKILLed past step LOADER_KILL_AT and the survivor finishes alone."""
    args = job_args(tmp_path)
    for flag, value in (("--steps", LOADER_STEPS), ("--every", LOADER_EVERY)):
        args[args.index(flag) + 1] = str(value)
    args += ["--hold-until-world", "2", "--loader-workers", "2", "--hooks-log",
             str(tmp_path / "hooks"), "--eval-every", str(EVAL_EVERY)]
    c = job.LocalCluster(tmp_path, args, nnodes="1:2", forked=True)
    try:
        nodes = [c.add_node() for _ in range(2)]
        attempt, info = job.wait_for(at_step(tmp_path / "run", 2, LOADER_KILL_AT),
                                     JOB_TIMEOUT, "training at world size 2", cluster=c)
        dead = c.node_of(info["pids"][1])
        dead.kill(signal.SIGKILL)
        [survivor] = [n for n in nodes if n is not dead]
        try:
            survivor.proc.wait(timeout=JOB_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after {JOB_TIMEOUT:.0f}s\n{c.logs()[-20000:]}")
        assert survivor.proc.returncode == 0, c.logs()[-20000:]
    finally:
        c.close()
    return tmp_path
