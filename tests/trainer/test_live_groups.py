"""Live recovery with replica groups of several ranks: a group that loses one rank is lost
and replaced as a whole, the other groups go on in the same processes, and each rank of the
replacement heals from the rank of the same index in a peer group.

Real processes: the supervisor, the lighthouse and two groups of two ranks (gloo, CPU), the
model sharded inside each group with FSDP2 and replicated across groups (HSDP), in a
network namespace of their own; rank 1 of group 1 SIGKILLed in the middle of a step
(tests/support/live_job.py). Two groups with ``min_replicas=1``: the lighthouse alone
forms quorums, so a lone group committing cannot split the job's history, and two groups
of two exercise every path a third group would (a lost group, the survivors' quorum, a
heal per rank) for two processes fewer; with the default majority of two, the survivor
would wait for the replacement instead of going on. Checkpoints every step, so that every
heal lands on a step the schedule names: a group saves the step it healed to, as its peers
did at their commit.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.live_job import (finish, netns_ok, rank_records, read, start_job, stop,
                                    stop_after, uninterrupted, wait_for)

pytest.importorskip("torchft")

pytestmark = pytest.mark.multiproc

GROUPS, SIZE = 2, 2


def _commits(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r["event"] == "commit"]


@pytest.fixture(scope="module")
def group_job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The job: rank 1 of group 1 killed mid-step once two warm spares wait (so the
    replacement group starts without importing torch); it ends a few steps after the
    replacement committed with both groups."""
    if not netns_ok():
        pytest.skip("needs unshare -n (root)")
    tmp = tmp_path_factory.mktemp("live-groups")
    run_dir = tmp / "run"
    started = time.monotonic()
    # The replacement starts 3 s after the loss: the survivors commit steps alone first, so
    # it must heal from them. Started at once (a warm spare, half a second) it may join the
    # survivors' first quorum after the loss at the step its own folder holds, with nothing
    # to heal.
    proc = start_job(tmp, steps=100000, kill="1:3:forward:1", groups=GROUPS, group_size=SIZE,
                     layout="hsdp", min_replicas=1, checkpoint_every=1, wait_spare=SIZE,
                     respawn_delay=3.0,
                     keep_last=1000, step_pause=0.1, timeout=8.0, quorum_timeout=10.0,
                     extra=["--spares", str(SIZE)])
    try:
        def replacement_whole() -> bool:
            kills = read(run_dir / "kills.jsonl")
            if not kills:
                return False
            new = [r for rank in range(SIZE)
                   for r in rank_records(run_dir, GROUPS, SIZE)[1, rank]
                   if r["event"] == "commit" and r["time"] > kills[0]["time"]
                   and r["participants"] == GROUPS]
            return len(new) >= 2 * SIZE

        wait_for(replacement_whole, 900, "the replacement group's commits with both groups")
        stop_after(run_dir, rank_records(run_dir, GROUPS, SIZE))
        finish(proc)
    finally:
        stop(proc)
    print(f"\nthe job took {time.monotonic() - started:.1f}s")
    return {"run": run_dir, "root": tmp / "ckpt", "records": rank_records(run_dir, GROUPS, SIZE),
            "kill": read(run_dir / "kills.jsonl")[0],
            "supervisor": read(run_dir / "supervisor.jsonl")}


def _replacement(job: dict, rank: int) -> list[dict]:
    kill = job["kill"]
    first = {r["pid"] for r in job["records"][1, rank] if r["time"] < kill["time"]}
    return [r for r in job["records"][1, rank] if r["pid"] not in first]


def test_lost_rank_takes_its_group_survivors_go_on(group_job: dict) -> None:
    """The kill of one rank loses its whole group (the supervisor stops the other rank and
    starts a new group); the other group's ranks commit again in the processes they
    started in, no job restart (the delay from the kill is reported)."""
    kill, events = group_job["kill"], group_job["supervisor"]
    assert (kill["group"], kill["rank"], kill["where"]) == (1, 1, "forward")
    assert not [e for e in events if e["event"] in ("quorum_lost", "restart")]
    lost = [e for e in events if e["event"] == "group_lost"]
    assert len(lost) == 1 and lost[0]["group"] == 1 and kill["pid"] in lost[0]["pids"]
    assert len(lost[0]["pids"]) == SIZE  # the live rank 0 was stopped with it
    replaced = [e for e in events if e["event"] == "group" and e["why"] == "replacement"]
    assert sorted(e["rank"] for e in replaced) == list(range(SIZE))
    assert not set(e["pid"] for e in replaced) & set(lost[0]["pids"])
    delays = []
    for rank in range(SIZE):
        recs = group_job["records"][0, rank]
        assert len({r["pid"] for r in recs}) == 1, "a survivor was restarted"
        after = [r for r in _commits(recs) if r["time"] > kill["time"]]
        assert after and after[0]["step"] <= kill["step"] + 1
        delays.append(after[0]["time"] - kill["time"])
    print("\nkill -> survivors' next committed step: " + ", ".join(f"{d:.2f}s" for d in delays))


def test_each_rank_heals_from_the_same_rank_of_a_peer(group_job: dict) -> None:
    """Each rank of the replacement heals to the shard the peer group's rank of the same
    index holds at that step (model and optimizer digests equal; the two ranks' shards
    differ), then starts its first step with the RNG streams and data position that rank
    has in a run without failures."""
    digests = {}
    for rank in range(SIZE):
        later = _replacement(group_job, rank)
        heal = next(r for r in later if r["event"] == "heal")
        first = next(r for r in later if r["event"] == "commit")
        peer = next(r for r in _commits(group_job["records"][0, rank])
                    if r["step"] == heal["step"])
        assert (heal["model"], heal["optim"]) == (peer["model"], peer["optim"])
        assert heal["data_next"] == peer["data_next"]
        assert first["step"] == heal["step"] + 1
        assert (first["rng"], first["data"]) == uninterrupted(1, first["step"], rank)
        digests[rank] = heal["model"]
    assert digests[0] != digests[1]  # shards: each rank healed its own


def test_groups_no_step_lost_or_repeated(group_job: dict) -> None:
    """Each process commits consecutive steps (after a heal: the step after it); every
    step is committed, with one global batch, and the ranks of the same index hold the
    same shard after it in every group that committed it."""
    by_step: dict[int, list[dict]] = {}
    for (g, rank), recs in group_job["records"].items():
        for pid in {r["pid"] for r in recs}:
            mine = [r for r in recs if r["pid"] == pid and r["event"] in ("commit", "heal")]
            for prev, cur in zip(mine, mine[1:]):
                if cur["event"] == "commit":
                    assert cur["step"] == prev["step"] + 1, (g, rank, prev, cur)
        for r in _commits(recs):
            by_step.setdefault(r["step"], []).append(r)
    assert sorted(by_step) == list(range(1, max(by_step) + 1))
    for step, rows in by_step.items():
        assert len({tuple(r["batch"]) for r in rows}) == 1, step
        for rank in range(SIZE):
            mine = [r for r in rows if r["group_rank"] == rank]
            assert len({(r["model"], r["optim"]) for r in mine}) == 1, (step, rank)


def test_groups_every_sample_trained_once_per_epoch(group_job: dict) -> None:
    """The audit: a committed step's global batch is split into disjoint shares of the
    ranks of its quorum's groups, and the committed batches cover each epoch's samples
    exactly once."""
    rows: dict[int, list[dict]] = {}
    for recs in group_job["records"].values():
        for r in _commits(recs):
            rows.setdefault(r["step"], []).append(r)
    trained: list[int] = []
    for step in sorted(rows):
        group = rows[step]
        batch = group[0]["batch"]
        shares = [i for r in group for i in r["indices"]]
        assert len(shares) == len(set(shares)) and set(shares) <= set(batch), step
        assert all(len(r["indices"]) == len(batch) // (r["participants"] * SIZE)
                   for r in group), step
        if len(group) == group[0]["participants"] * SIZE:
            assert sorted(shares) == sorted(batch), step
        trained.extend(batch)
    samples = 96
    for start in range(0, len(trained), samples):
        epoch = trained[start:start + samples]
        assert len(set(epoch)) == len(epoch), f"a sample twice in epoch {start // samples}"
        if len(epoch) == samples:
            assert sorted(epoch) == list(range(samples))


def test_group_saves_the_step_it_healed_to(group_job: dict) -> None:
    """A group that heals to a step the schedule names (here every step) saves it, as its
    peers did at their commit: its folder holds that step, with the peers' tensors."""
    from ckpt.inspect import open as open_root

    root: Path = group_job["root"]
    heals = [r for recs in group_job["records"].values() for r in recs if r["event"] == "heal"]
    assert any(h["group"] == 1 and h["time"] > group_job["kill"]["time"] for h in heals)
    for heal in heals:
        saved = [r for r in group_job["records"][heal["group"], heal["group_rank"]]
                 if r["event"] == "saved" and r["pid"] == heal["pid"]]
        assert heal["step"] in [r["step"] for r in saved], heal
    replacement = next(h for h in heals if h["group"] == 1
                       and h["time"] > group_job["kill"]["time"])
    step = replacement["step"]
    mine, peer = open_root(root / "group-1"), open_root(root / "group-0")
    keys = [k for k in mine.manifest(step).tensors if k.startswith("train/")]
    assert keys and keys == [k for k in peer.manifest(step).tensors if k.startswith("train/")]
    import torch

    for key in keys:
        assert torch.equal(mine.read_tensor(step, key), peer.read_tensor(step, key)), key


# -- the gradient average of a replicated group, on two real gloo ranks ----------------------
class _Done:
    def wait(self) -> None:
        pass


class _Failed:
    def wait(self) -> None:
        raise RuntimeError("peer lost inside the all-reduce")


def _sync_body(rank: int, world: int, fail_rank: int) -> tuple:
    import torch

    from trainer.live.group import LocalGroup

    group = LocalGroup.__new__(LocalGroup)  # the default group run_ranks made
    group.rank, group.size, group.replicated = rank, world, True
    grads = [torch.arange(5, dtype=torch.float32) * (rank + 1),
             torch.full((2, 2), float(rank * 10))]
    sent: list[int] = []

    def cross(flat: torch.Tensor) -> object:
        sent.append(flat.numel())
        flat.mul_(1.0)  # the other groups hold the same average: averaging changes nothing
        return _Failed() if rank == fail_rank else _Done()

    error = group.sync(grads, cross)
    return [g.tolist() for g in grads], sent, None if error is None else str(error)


def test_replicated_group_averages_over_its_ranks_sending_a_slice_each() -> None:
    """Inside a replicated group the gradients are averaged over its ranks, each rank
    sends only its slice across groups, and every rank ends with the same values."""
    from tests.support.ranks import run_ranks

    results = run_ranks(2, _sync_body, -1)
    (g0, sent0, e0), (g1, sent1, e1) = results
    assert g0 == g1 and e0 is e1 is None
    assert g0[0] == [1.5 * i for i in range(5)] and g0[1] == [[5.0, 5.0], [5.0, 5.0]]
    assert sent0 == sent1 == [5]  # 9 values, padded to 10, half each


def test_cross_group_failure_on_one_rank_leaves_no_rank_waiting() -> None:
    """A rank whose cross-group all-reduce fails still takes part in its group's gather:
    both ranks return, the failed one with the error (its vote then fails the group's
    commit)."""
    from tests.support.ranks import run_ranks

    (_, _, e0), (_, _, e1) = run_ranks(2, _sync_body, 1, timeout=60)
    assert e0 is None and "peer lost" in e1
