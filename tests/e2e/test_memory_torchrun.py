"""ElasticTrainer's memory tier under real torchrun agents.

Each "node" is one torchrun agent on this machine (tests/support/elastic_job.py's LocalCluster),
named through ``CKPT_NODE`` so that its shared-memory segments are ``ckpt-<job>-<node>-*``;
the job is tests/support/memory_job.py, which writes a digest of the model and optimizer at every
checkpointed step and of the state each attempt starts from.

- a worker SIGKILLed while its agent lives: torchrun restarts the group and every rank
  resumes from its node's memory, a step that was never persisted, with zero bytes read from
  the root, the model and optimizer bit-exact;
- a whole node killed (its agent's process tree SIGKILLed, its segments removed): the
  survivors restore the lost shards from the peer replica at world 2, zero bytes from the
  root, the model and optimizer equal to the saved step;
- the trainer's default (on under torchrun, off in a plain process), and the keyword that
  turns it off.

(A plain process restoring what another plain process left in memory is
tests/memory/test_memory_tier.py::test_second_process_restores_from_memory_without_reading_the_root.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.support import elastic_job as cluster_harness
from tests.support import memory_job
import ckpt
from ckpt._memory.tier import PREFIX, SHM_DIR, private_path
from trainer.checkpointing import memory_job_id, memory_tier_options
from trainer.elastic import read_jsonl

SEGMENTS = private_path(SHM_DIR)  # this user's segments

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")

EVERY, PERSIST, STEPS = 5, 6, 25  # the schedule's root steps: multiples of 30, none here
JOB_TIMEOUT = 120.0


def job_args(tmp: Path, memjob: str, *extra: str) -> list[str]:
    # A generous collective timeout: on a loaded machine restarted workers are slow to
    # start, and rank 0's store must be up before the others give up connecting.
    return ["--root", str(tmp / "ckpt"), "--run-dir", str(tmp / "run"), "--digests",
            str(tmp / "digests"), "--steps", str(STEPS), "--every", str(EVERY),
            "--persist-every", str(PERSIST), "--memory-job", memjob,
            "--collective-timeout", "30", *extra]


def restored_records(run_dir: Path, attempt: int) -> list[dict]:
    return [r for p in sorted((run_dir / f"attempt-{attempt:04d}").glob("rank-*.jsonl"))
            for r in read_jsonl(p) if r["event"] == "restored"]


def saved_digest(digests: Path, attempt: int, rank: int, step: int) -> str:
    [rec] = [r for r in read_jsonl(digests / f"saved-a{attempt}-r{rank}.jsonl")
             if r["step"] == step]
    return rec["digest"]


def wait_all(c: memory_job.Cluster, nodes: list, tmp: Path) -> None:
    """Every agent of ``nodes`` exits 0 within the timeout."""
    for n in nodes:
        try:
            n.proc.wait(timeout=JOB_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{n.name} still running after {JOB_TIMEOUT:.0f}s\n{c.logs()[-20000:]}")
    codes = {n.name: n.proc.returncode for n in nodes}
    assert set(codes.values()) == {0}, f"agent exit codes {codes}\n{c.logs()[-20000:]}"


# ------------------------------------------------------------------------- quick unit checks


def test_default_is_on_under_torchrun_only_and_the_keyword_turns_it_off(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run7")
    on = memory_tier_options(None, root=tmp_path, elastic=True)
    assert on == {"memory_tier": ckpt.MemoryTierOptions(job=memory_job_id(tmp_path, "run7"))}
    assert memory_tier_options(None, root=tmp_path, elastic=False) == {}
    assert memory_tier_options(False, root=tmp_path, elastic=True) == {}
    assert isinstance(memory_tier_options(True, root=tmp_path, elastic=False)["memory_tier"],
                      ckpt.MemoryTierOptions)


def test_job_ids_differ_by_root_and_run_and_are_safe_in_segment_names(tmp_path):
    a, b = memory_job_id(tmp_path / "a", "run"), memory_job_id(tmp_path / "b", "run")
    assert a != b and a == memory_job_id(tmp_path / "a", "run")
    assert memory_job_id(tmp_path / "a", "other") != a
    assert "/" not in memory_job_id("s3://bucket/x", "id with spaces/and-slashes")


def test_memory_tier_is_the_trainers_keyword_not_a_checkpoint_option(tmp_path):
    from trainer import CheckpointConfig

    with pytest.raises(TypeError, match="memory_tier="):
        CheckpointConfig(manager_options={"memory_tier": True})
    with pytest.raises(TypeError, match="True, False or None"):
        CheckpointConfig(memory_tier="yes")


# ------------------------------------------------------------------------- torchrun scenarios
#
# One job of three nodes (saves at 5 10 15 20 25; persist_every=6: the schedule sends steps
# that are multiples of 30 to the root, none here, so only the final step 25 reaches it, as the
# trainer's final checkpoint always does; the memory tier gets every save). Every worker
# holds, once per rank, before steps 17 and 22, its newest checkpoint committed and
# replicated:
#   1. before 17, one worker is SIGKILLed, its agent alive: all three restart;
#   2. before 22, rank 1's node dies: the two survivors go on at world 2.

HOLDS = (17, 22)


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("three_nodes")
    memjob = f"mt{uuid.uuid4().hex[:10]}"
    args = job_args(tmp, memjob, "--hold-at", ",".join(map(str, HOLDS)), "--hold-until-world",
                    "3")
    c = memory_job.Cluster(tmp, args, memjob, nnodes="2:3", forked=True)
    facts: dict = {"tmp": tmp, "memjob": memjob}
    try:
        nodes = [c.add_node() for _ in range(3)]

        def held_at(step: int) -> list[dict] | None:
            marks = [tmp / "digests" / f"holding-s{step}-r{r}.json" for r in range(3)]
            return all(m.exists() for m in marks) and [json.loads(m.read_text())
                                                         for m in marks]

        held = cluster_harness.wait_for(lambda: held_at(HOLDS[0]), JOB_TIMEOUT,
                                        f"every worker to hold before step {HOLDS[0]}",
                                        cluster=c)
        facts["root_before_worker_kill"] = root_steps(tmp)
        facts["worker_killed_attempt"] = held[2]["attempt"]
        os.kill(held[2]["pid"], signal.SIGKILL)  # its agent lives and restarts the group

        held = cluster_harness.wait_for(lambda: held_at(HOLDS[1]), JOB_TIMEOUT,
                                        f"every worker to hold before step {HOLDS[1]}",
                                        cluster=c)
        facts["root_before_node_kill"] = root_steps(tmp)
        facts["node_killed_attempt"] = held[1]["attempt"]
        dead = c.node_of(held[1]["pid"])
        dead.kill(signal.SIGKILL)
        facts["segments_removed"] = gone = [
            e for e in os.listdir(SEGMENTS)
            if e.startswith(f"{PREFIX}{memjob}-{c.node_name(c.nodes.index(dead))}-")]
        for entry in gone:  # the node's RAM went with it
            shutil.rmtree(os.path.join(SEGMENTS, entry))
        # The survivors train on and meet the loss in their next collective (a held worker
        # would notice it only by the heartbeat timeout).
        (tmp / "digests" / f"release-s{HOLDS[1]}").touch()
        wait_all(c, [n for n in nodes if n is not dead], tmp)
    finally:
        c.close()
        for entry in os.listdir(SEGMENTS) if os.path.isdir(SEGMENTS) else []:
            if entry.startswith(f"{PREFIX}{memjob}"):
                shutil.rmtree(os.path.join(SEGMENTS, entry), ignore_errors=True)
    return facts


def root_steps(tmp: Path) -> list[int]:
    return ckpt.CheckpointManager(tmp / "ckpt", read_only=True).steps()


def restored_digests(tmp: Path, attempt: int) -> list[dict]:
    return [json.loads(p.read_text())
            for p in sorted((tmp / "digests").glob(f"restored-a{attempt}-r*.json"))]


@pytest.mark.slow
@pytest.mark.multiproc
def test_worker_sigkilled_agent_alive_restores_from_memory(three_nodes):
    """The trainer's default under torchrun. A worker is SIGKILLed before step 17, the newest
    checkpoint (15) in memory only (not in the root); torchrun restarts the group and every
    rank resumes from step 15 out of the nodes' memory, reading nothing from the root, model
    and optimizer bit-exact."""
    tmp = three_nodes["tmp"]
    assert 3 * EVERY not in three_nodes["root_before_worker_kill"]
    killed = three_nodes["worker_killed_attempt"]
    recs = restored_records(tmp / "run", killed + 1)
    assert len(recs) == 3, recs  # the same three nodes
    # Every node's memory holds what it saved; a rank that torchrun renumbered (or that
    # needs shards other ranks wrote) reads them from another node's memory: "peer".
    assert {(r["step"], r["bytes_from_storage"]) for r in recs} == {(3 * EVERY, 0)}, recs
    assert {r["tier"] for r in recs} <= {"memory", "peer"}, recs
    want = saved_digest(tmp / "digests", killed, 0, 3 * EVERY)
    got = restored_digests(tmp, killed + 1)
    assert len(got) == 3 and all((g["step"], g["digest"]) == (3 * EVERY, want) for g in got)


@pytest.mark.slow
@pytest.mark.multiproc
def test_node_killed_survivors_restore_from_peer_replica_at_world_2(three_nodes):
    """Rank 1's node dies before step 22: its agent and worker SIGKILLed, its shared memory
    (own segment and the replica it held) removed. The two survivors re-form at world 2 and
    restore step 20 (in memory only): the lost rank's shards from the replica on the next
    node, zero bytes from the root, model and optimizer equal to the saved step. The final
    step, off the persist_every schedule, is in the root when the job ends."""
    tmp = three_nodes["tmp"]
    assert 4 * EVERY not in three_nodes["root_before_node_kill"]
    gone = three_nodes["segments_removed"]
    assert any("replica" in g for g in gone) and len(gone) >= 2, gone
    killed = three_nodes["node_killed_attempt"]
    recs = restored_records(tmp / "run", killed + 1)
    assert len(recs) == 2 and {r["step"] for r in recs} == {4 * EVERY}, recs
    tiers = {r["tier"] for r in recs}
    assert "peer" in tiers and tiers <= {"memory", "peer"}, recs
    assert all(r["bytes_from_storage"] == 0 for r in recs), recs
    want = saved_digest(tmp / "digests", killed, 0, 4 * EVERY)
    got = restored_digests(tmp, killed + 1)
    assert len(got) == 2 and all((g["step"], g["world"], g["digest"]) == (4 * EVERY, 2, want)
                                 for g in got), got
    summary = json.loads((tmp / "run" / "summary.json").read_text())
    assert summary["final_step"] == STEPS and summary["world_sizes"][-1] == 2
    assert root_steps(tmp)[-1:] == [STEPS]  # the trainer's final checkpoint: persist=True
    assert summary["recoveries"][-1]["restored_from"] in ("memory,peer", "peer")
