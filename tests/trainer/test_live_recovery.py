"""Live recovery (trainer.live, on torchft): a lost replica group costs the others a
heartbeat timeout, not a restart; a replacement heals from a peer to the job's state.

Real processes: the supervisor, the lighthouse and three replica groups (gloo, CPU) in a
network namespace of their own (torchft's manager server listens on every interface),
faults injected with SIGKILL and SIGSTOP (tests/support/live_job.py). One job (heartbeat
timeout 1 s, three warm spares) runs the faults in turn, and the tests read its records:

- one group SIGKILLed in the middle of a step, later another while its peers wait inside
  the gradient all-reduce: the survivors go on without a restart (the time from the kill
  to their next committed step is measured and reported), no step is lost or repeated,
  every sample is trained exactly once per epoch, and each replacement heals to the
  survivors' model and optimizer, with the RNG streams and data position an
  uninterrupted run has at that step;
- a majority of groups lost (frozen, so nothing replaces them within the quorum
  timeout): the job restarts and resumes from ckpt's newest good step;
- the lighthouse SIGKILLed and restarted within the retry window: training goes on in
  the same processes;
- as an attacker on the job's network: the heal server and the lighthouse listen on the
  job's address only (the heal transport as that attacker: test_live_transport.py).
"""
from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from tests.support.live_job import (committed_at_least, finish, group_records, hold, held,
                                    netns_ok, read, release, start_job, stop, stop_soon,
                                    uninterrupted, wait_for)

pytest.importorskip("torchft")

pytestmark = pytest.mark.multiproc


needs_netns = pytest.mark.skipif(not netns_ok(), reason="needs unshare -n (root)")


def _commits(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r["event"] == "commit"]


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of the sockets listening in ``pid``'s network namespace."""
    out = set()
    for name, width in (("tcp", 8), ("tcp6", 32)):
        path = Path(f"/proc/{pid}/net/{name}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state != "0A":  # LISTEN
                continue
            addr, port = local.split(":")
            raw = bytes.fromhex(addr)
            if width == 8:
                text = socket.inet_ntop(socket.AF_INET, raw[::-1])
            else:  # four little-endian 32-bit words
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                text = socket.inet_ntop(socket.AF_INET6, words)
            out.add((text, int(port, 16)))
    return out


# -- the job (runs once per module) ------------------------------------------------------
def _whole_since(run_dir: Path, since: float, pids: set[int] | None = None) -> bool:
    """Every group committed 2 steps with all three groups since ``since`` (by one of
    ``pids`` when given)."""
    recs = group_records(run_dir)
    return all(len([r for r in _commits(recs[g]) if r["time"] > since
                    and r["participants"] == 3 and (pids is None or r["pid"] in pids)]) >= 2
               for g in range(3))


def _held(run_dir: Path) -> int:
    """Hold every group at a step boundary; returns the step once all three wait."""
    step = hold(run_dir)
    wait_for(lambda: held(run_dir, step), 300, f"every group held after step {step}")
    return step


@pytest.fixture(scope="module")
def live_job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One job, its faults in turn:

    1. group 2 SIGKILLed mid-step from step 4, then group 1 at the gradient all-reduce of
       the first step from 6 on with the whole quorum; each replaced (live recovery);
    2. with every group held at a step boundary, groups 0 and 1 frozen (SIGSTOP: alive to
       the supervisor, so nothing replaces them; silent to the lighthouse): group 2 finds
       no quorum for ``quorum_timeout`` and the job restarts from ckpt;
    3. with every group held at a step boundary, the lighthouse SIGKILLed and the groups
       let go at once: they ask a dead lighthouse, the supervisor restarts it, their
       quorum retries reach it.

    The lighthouse goes last, in groups formed after the restart: torchft 0.2.0's
    lighthouse numbers its quorums afresh when restarted, and a process whose store
    already hosted a quorum of that number rendezvouses gloo on stale keys (docs/elastic.md,
    "Live recovery", limitations).
    """
    if not netns_ok():
        pytest.skip("needs unshare -n (root)")
    tmp = tmp_path_factory.mktemp("live")
    run_dir = tmp / "run"
    # a replacement 3 s after a loss (a node's replacement time): longer than the heartbeat
    # timeout, so the survivors commit without the victim first and the replacement,
    # whose own checkpoint is behind them by then, heals from a peer
    # three warm spares (imports paid while the job trains): the second kill does not wait
    # for the first replacement's spare to import torch, and the majority's restart starts
    # all three groups warm instead of importing torch in two of them (tens of seconds)
    proc = start_job(tmp, steps=100000, kill="2:4:forward,1:6:allreduce", timeout=8.0,
                     quorum_timeout=10.0, respawn_delay=3.0, step_pause=0.1,
                     extra=["--spares", "3"])
    out: dict = {"run": run_dir}
    try:
        wait_for(lambda: committed_at_least(run_dir, 2), 900, "the first commits")
        first = [r for r in read(run_dir / "supervisor.jsonl") if r["event"] == "group"]
        out["sockets"] = _listening(first[0]["pid"])
        out["heal_ports"] = {r["group"]: r["heal_port"] for recs in
                             group_records(run_dir).values()
                             for r in recs if r["event"] == "start"}

        def second_replacement_committed() -> bool:
            kills = read(run_dir / "kills.jsonl")
            if len(kills) < 2:
                return False
            victim = kills[1]
            return any(r["event"] == "commit" and r["pid"] != victim["pid"]
                       and r["time"] > victim["time"]
                       for r in group_records(run_dir)[victim["group"]])

        wait_for(second_replacement_committed, 900, "both replacements to commit")
        wait_for(lambda: _whole_since(run_dir, read(run_dir / "kills.jsonl")[1]["time"]),
                 300, "whole quorums after the replacements")

        # 2. a majority lost
        _held(run_dir)
        groups = {e["group"]: e["pid"] for e in read(run_dir / "supervisor.jsonl")
                  if e["event"] == "group"}
        out["majority_kill"] = time.time()
        for g in (0, 1):
            os.kill(groups[g], signal.SIGSTOP)
        release(run_dir)

        def restarted() -> set[int]:
            return {e["pid"] for e in read(run_dir / "supervisor.jsonl")
                    if e["event"] == "group" and e["why"] == "restart"
                    and e["time"] > out["majority_kill"]}

        wait_for(lambda: len(restarted()) == 3
                 and _whole_since(run_dir, out["majority_kill"], restarted()), 900,
                 "the restarted job's whole quorums")

        # 3. the lighthouse lost and restarted
        _held(run_dir)
        lighthouse = [e for e in read(run_dir / "supervisor.jsonl")
                      if e["event"] == "lighthouse"][-1]
        out["lighthouse_sockets"] = _listening(lighthouse["pid"])  # all of the namespace
        cmdline = Path(f"/proc/{lighthouse['pid']}/cmdline").read_bytes().split(b"\0")
        out["lighthouse_port"] = int(cmdline[cmdline.index(b"--bind") + 1].rsplit(b":", 1)[1])
        out["lighthouse_kill"] = time.time()
        os.kill(lighthouse["pid"], signal.SIGKILL)
        release(run_dir)
        wait_for(lambda: _whole_since(run_dir, out["lighthouse_kill"]), 300,
                 "every group's commits after the lighthouse restart")
        stop_soon(run_dir)
        finish(proc)
    finally:
        stop(proc)
    return out


def _before(recs: dict[int, list[dict]], t: float) -> dict[int, list[dict]]:
    return {g: [r for r in rows if r["time"] < t] for g, rows in recs.items()}


def _uninterrupted(group: int, step: int) -> tuple[str, dict]:
    """The RNG digest and data position ``group`` starts ``step`` with in a run without
    failures (tests/support/live_job.py)."""
    return uninterrupted(group, step)


def _report(name: str, values: list[float]) -> None:
    print(f"\n{name}: " + ", ".join(f"{v:.2f}s" for v in values))


# -- a lost group ---------------------------------------------------------------------------
@needs_netns
def test_survivors_commit_next_step_without_restart(live_job: dict) -> None:
    """After each kill the survivors commit again in the processes they started in (no
    restart), the step the victim died in included; the delay is reported."""
    run_dir, end = live_job["run"], live_job["majority_kill"]
    recs = _before(group_records(run_dir), end)
    kills = read(run_dir / "kills.jsonl")
    assert [k["where"] for k in kills] == ["forward", "allreduce"]
    supervisor = [e for e in read(run_dir / "supervisor.jsonl") if e["time"] < end]
    assert not [e for e in supervisor if e["event"] in ("quorum_lost", "lighthouse_lost")]
    lost = [e for e in supervisor if e["event"] == "group_lost"]
    assert sorted(e["pid"] for e in lost) == sorted(k["pid"] for k in kills)
    delays = []
    for kill in kills:
        for g in {0, 1, 2} - {kill["group"]}:
            before = [r for r in recs[g] if r["time"] < kill["time"]]
            after = [r for r in _commits(recs[g]) if r["time"] > kill["time"]]
            if not before:
                continue  # a replacement that was still starting
            pid = before[-1]["pid"]
            # the same process commits again, and commits the step the victim died in
            assert after and after[0]["pid"] == pid, (g, kill)
            assert after[0]["step"] <= kill["step"] + 1
            delays.append(after[0]["time"] - kill["time"])
    # group 0 was never restarted: one process from the first record to the last
    assert len({r["pid"] for r in recs[0]}) == 1
    _report("kill -> survivors' next committed step", delays)


@needs_netns
def test_killed_inside_allreduce_fails_only_that_commit(live_job: dict) -> None:
    """A peer lost while the others wait inside the gradient all-reduce: their step is not
    committed (no update from a partial average) and is committed next with the groups
    left, by the same processes."""
    run_dir = live_job["run"]
    kill = read(run_dir / "kills.jsonl")[1]
    for g in {0, 1, 2} - {kill["group"]}:
        mine = [r for r in group_records(run_dir)[g] if r["time"] > kill["time"]]
        assert mine[0]["event"] == "failed" and mine[0]["participants"] == 3, mine[:2]
        nxt = next(r for r in mine if r["event"] == "commit")
        assert nxt["step"] == mine[0]["step"] and nxt["participants"] == 2
        assert nxt["pid"] == mine[0]["pid"]


@needs_netns
def test_no_step_lost_or_repeated(live_job: dict) -> None:
    """Every step up to the majority's loss is committed, in order, once per group (a
    group whose own vote failed while the others committed heals to their step and goes
    on), with one global batch and one resulting model in every group that committed it."""
    recs = _before(group_records(live_job["run"]), live_job["majority_kill"])
    by_step: dict[int, list[dict]] = {}
    for g in recs:
        for pid in {r["pid"] for r in recs[g]}:
            mine = [r for r in recs[g] if r["pid"] == pid and r["event"] in ("commit", "heal")]
            steps = [r["step"] for r in mine]
            assert steps == sorted(set(steps)), f"group {g} went back or repeated a step"
            for prev, cur in zip(mine, mine[1:]):
                if cur["event"] == "commit":  # a commit follows the step before it
                    assert cur["step"] == prev["step"] + 1, (g, prev, cur)
        for r in _commits(recs[g]):
            by_step.setdefault(r["step"], []).append(r)
    assert sorted(by_step) == list(range(1, max(by_step) + 1))
    for step, rows in by_step.items():
        assert len({tuple(r["batch"]) for r in rows}) == 1, step
        assert len({r["model"] for r in rows}) == 1, step
        assert len({r["optim"] for r in rows}) == 1, step
    jumps = [r for g in recs for r in recs[g] if r["event"] == "heal"]
    print(f"\nheals: {[(r['group'], r['step']) for r in jumps]}")


@needs_netns
def test_every_sample_trained_once_per_epoch(live_job: dict) -> None:
    """The audit: each committed step's global batch is split into disjoint shares of the
    groups of its quorum, and the job's committed batches (up to the majority's loss)
    cover each epoch's samples exactly once."""
    recs = _before(group_records(live_job["run"]), live_job["majority_kill"])
    rows: dict[int, list[dict]] = {}
    for g in recs:
        for r in _commits(recs[g]):
            rows.setdefault(r["step"], []).append(r)
    trained: list[int] = []
    for step in sorted(rows):
        group = rows[step]
        batch = group[0]["batch"]
        shares = [i for r in group for i in r["indices"]]
        assert len(shares) == len(set(shares)) and set(shares) <= set(batch), step
        assert len(group) <= group[0]["participants"], step
        assert all(len(r["indices"]) == len(batch) // r["participants"] for r in group)
        trained.extend(batch)
    samples = 96
    for start in range(0, len(trained), samples):
        epoch = trained[start:start + samples]
        assert len(set(epoch)) == len(epoch), f"a sample twice in epoch {start // samples}"
        if len(epoch) == samples:
            assert sorted(epoch) == list(range(samples))


@needs_netns
def test_replacement_heals_to_uninterrupted_state(live_job: dict) -> None:
    """Each replacement heals to the survivors' model and optimizer at the step it joins,
    then starts its first step with the RNG streams and data position that group has at
    that step in a run without failures."""
    run_dir = live_job["run"]
    recs = _before(group_records(run_dir), live_job["majority_kill"])
    heal_times = []
    for kill in read(run_dir / "kills.jsonl"):
        g = kill["group"]
        later = [r for r in recs[g] if r["pid"] != kill["pid"] and r["time"] > kill["time"]]
        start = next(r for r in later if r["event"] == "start")
        heal = next(r for r in later if r["event"] == "heal")
        first = next(r for r in later if r["event"] == "commit")
        survivor = next(r for h in ({0, 1, 2} - {g}) for r in _commits(recs[h])
                        if r["step"] == heal["step"])
        assert (heal["model"], heal["optim"]) == (survivor["model"], survivor["optim"])
        assert heal["data_next"] == survivor["data_next"]
        assert first["step"] == heal["step"] + 1
        assert (first["rng"], first["data"]) == _uninterrupted(g, first["step"])
        heal_times.append(first["time"] - start["time"])
    _report("replacement: start -> first committed step", heal_times)


@needs_netns
def test_listeners_bound_to_job_address(live_job: dict) -> None:
    """Seen from the job's network: the heal servers listen on the job's address, not on
    a wildcard (torchft's manager server and the group's store do listen on every
    interface; docs/elastic.md, "Live recovery", threat model)."""
    sockets = live_job["sockets"]
    for port in live_job["heal_ports"].values():
        bound = {addr for addr, p in sockets if p == port}
        assert bound == {"127.0.0.1"}, (port, bound)
    assert all(addr in ("127.0.0.1", "0.0.0.0", "::") for addr, _ in sockets)


# -- the lighthouse and a majority ----------------------------------------------------------
@needs_netns
def test_lighthouse_restarted_within_retry_window_training_goes_on(live_job: dict) -> None:
    """A lighthouse killed and restarted at its address: the same group processes go on
    committing, no step lost or repeated."""
    run_dir, killed = live_job["run"], live_job["lighthouse_kill"]
    supervisor = read(run_dir / "supervisor.jsonl")
    assert [e["event"] for e in supervisor if e["time"] > killed][:2] == [
        "lighthouse_lost", "lighthouse"]
    recs = group_records(run_dir)
    gaps = []
    for g in range(3):
        window = [r for r in recs[g] if killed < r["time"]]
        commits = _commits(window)
        assert len(commits) >= 2 and len({r["pid"] for r in window}) == 1
        assert all(r["event"] != "start" for r in window)
        steps = [r["step"] for r in window if r["event"] in ("commit", "heal")]
        assert steps == sorted(set(steps)), f"group {g} went back or repeated a step"
        gaps.append(commits[0]["time"] - killed)
    window_steps = {r["step"] for g in recs for r in _commits(recs[g]) if killed < r["time"]}
    assert sorted(window_steps) == list(range(min(window_steps), max(window_steps) + 1))
    _report("lighthouse kill -> next committed step", gaps)


@needs_netns
def test_majority_lost_job_resumes_from_newest_good_checkpoint(live_job: dict) -> None:
    """Two of three groups lost (frozen, so not replaced): the survivor leaves for lack of
    a quorum, the job starts again and every group resumes from the newest checkpoint."""
    run_dir = live_job["run"]
    supervisor = read(run_dir / "supervisor.jsonl")
    events = [e["event"] for e in supervisor]
    assert "quorum_lost" in events
    restarted = {e["pid"] for e in supervisor if e["event"] == "group"
                 and e["why"] == "restart" and e["time"] > live_job["majority_kill"]}
    assert len(restarted) == 3
    recs = group_records(run_dir)
    last_before = max(r["step"] for g in range(3) for r in _commits(recs[g])
                      if r["pid"] not in restarted)
    # synchronous saves: a "saved" record follows the checkpoint's commit
    newest_saved = max(r["step"] for g in range(3) for r in recs[g]
                       if r["event"] == "saved" and r["pid"] not in restarted)
    restored, firsts = [], []
    for g in range(3):
        start = next(r for r in recs[g] if r["event"] == "start" and r["pid"] in restarted)
        assert start["restored"] <= newest_saved
        restored.append(start["restored"])
        firsts.append(next(r["step"] for r in _commits(recs[g]) if r["pid"] in restarted))
    assert max(restored) == newest_saved  # from ckpt, not from a peer that kept it
    # the job's next step is the one after it (a group that restored less heals first)
    assert min(firsts) == newest_saved + 1, (firsts, newest_saved)
    after = sorted({r["step"] for g in range(3) for r in _commits(recs[g])
                    if r["pid"] in restarted})
    assert after == list(range(newest_saved + 1, after[-1] + 1))
    lost = [r for r in recs[2] if r["event"] == "quorum_lost"]
    assert lost, "the survivor did not leave for lack of a quorum"
    print(f"\nmajority lost: resumed from step {newest_saved}, "
          f"{last_before - newest_saved} steps trained again")


@needs_netns
def test_lighthouse_bound_to_job_address(live_job: dict) -> None:
    """The lighthouse listens on the job's address only."""
    port = live_job["lighthouse_port"]
    assert {a for a, p in live_job["lighthouse_sockets"] if p == port} == {"127.0.0.1"}
