"""ElasticTrainer's memory tier (issue #14) under real torchrun agents.

Each "node" is one torchrun agent on this machine (tests/_elastic_job.py's LocalCluster),
named through ``CKPT_NODE`` so that its shared-memory segments are ``ckpt-<job>-<node>-*``;
the job is tests/_memory_job.py, which writes a digest of the model and optimizer at every
checkpointed step and of the state each attempt starts from.

- a worker SIGKILLed while its agent lives: torchrun restarts it and it resumes from its
  memory segment, a step that was never persisted, with zero bytes read from the root, the
  model and optimizer bit-exact;
- the trainer's default (on under torchrun, off in a plain process), and the keyword that
  turns it off.

(A plain process restoring what another plain process left in memory is
tests/test_memory_tier.py::test_second_process_restores_from_memory_without_reading_the_root.)
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

import _elastic_job as cluster_harness
import _memory_job
import ckpt
from ckpt.memory_tier import PREFIX, SHM_DIR
from trainer.checkpointing import memory_job_id, memory_tier_options, multi_rank_memory_tier
from trainer.elastic import read_jsonl

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")

EVERY, PERSIST, HOLD_AT, STEPS = 5, 2, 17, 20  # saves 5 10 15 20; the root gets 10 and 20
JOB_TIMEOUT = 120.0


@pytest.fixture
def memjob():
    name = f"mt{uuid.uuid4().hex[:10]}"
    yield name
    for entry in os.listdir(SHM_DIR):
        if entry.startswith(f"{PREFIX}{name}"):
            shutil.rmtree(os.path.join(SHM_DIR, entry), ignore_errors=True)


def job_args(tmp: Path, memjob: str, *extra: str) -> list[str]:
    return ["--root", str(tmp / "ckpt"), "--run-dir", str(tmp / "run"), "--digests",
            str(tmp / "digests"), "--steps", str(STEPS), "--every", str(EVERY),
            "--persist-every", str(PERSIST), "--memory-job", memjob, *extra]


def restored_records(run_dir: Path, attempt: int) -> list[dict]:
    return [r for p in sorted((run_dir / f"attempt-{attempt:04d}").glob("rank-*.jsonl"))
            for r in read_jsonl(p) if r["event"] == "restored"]


def saved_digest(digests: Path, attempt: int, rank: int, step: int) -> str:
    [rec] = [r for r in read_jsonl(digests / f"saved-a{attempt}-r{rank}.jsonl")
             if r["step"] == step]
    return rec["digest"]


def wait_all(c: _memory_job.Cluster, nodes: list, tmp: Path) -> None:
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
    on = memory_tier_options(None, {}, root=tmp_path, elastic=True, collective=False)
    assert on["memory_tier"] is True
    assert on["memory_job"] == memory_job_id(tmp_path, "run7")
    assert memory_tier_options(None, {}, root=tmp_path, elastic=False, collective=False) == {}
    assert memory_tier_options(False, {}, root=tmp_path, elastic=True, collective=False) == {}
    assert memory_tier_options(True, {}, root=tmp_path, elastic=False,
                               collective=False)["memory_tier"] is True
    # Several ranks: on by default once ckpt has the multi-rank tier (with a peer copy).
    many = memory_tier_options(None, {}, root=tmp_path, elastic=True, collective=True)
    assert bool(many) == multi_rank_memory_tier()
    if many:
        assert many["replicas"] == 1


def test_job_ids_differ_by_root_and_run_and_are_safe_in_segment_names(tmp_path):
    a, b = memory_job_id(tmp_path / "a", "run"), memory_job_id(tmp_path / "b", "run")
    assert a != b and a == memory_job_id(tmp_path / "a", "run")
    assert memory_job_id(tmp_path / "a", "other") != a
    assert "/" not in memory_job_id("s3://bucket/x", "id with spaces/and-slashes")


def test_memory_tier_is_the_trainers_keyword_not_a_checkpoint_option(tmp_path):
    from trainer.elastic import ElasticTrainer

    common = dict(checkpoint_root=tmp_path, checkpoint_every=1, global_batch_size=2,
                  micro_batch_size=2)
    with pytest.raises(TypeError, match="memory_tier="):
        ElasticTrainer(lambda: None, lambda p: None, [0] * 4, lambda m, b: None,
                       checkpoint_options={"memory_tier": True}, **common)
    with pytest.raises(TypeError, match="True, False or None"):
        ElasticTrainer(lambda: None, lambda p: None, [0] * 4, lambda m, b: None,
                       memory_tier="yes", **common)


def run_plain(tmp: Path, memjob: str, *extra: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=cluster_harness.REPO)
    for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
              "GROUP_RANK"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, _memory_job.SCRIPT, *job_args(tmp, memjob),
                           *extra], env=env, capture_output=True, text=True,
                          timeout=JOB_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-5000:]


@pytest.mark.multiproc
def test_plain_process_trainer_resumes_from_memory_with_memory_tier_true(tmp_path, memjob):
    """memory_tier=True in a plain process: the final step (not persisted: persist_every)
    stays in memory at exit, and the next run resumes from it without reading the root."""
    steps = ["--steps", str(3 * EVERY)]  # saves 5 10 15: the root gets 10, memory 10 and 15
    run_plain(tmp_path, memjob, "--memory", "on", *steps)
    assert ckpt.CheckpointManager(tmp_path / "ckpt", read_only=True).steps() == [2 * EVERY]
    run_plain(tmp_path, memjob, "--memory", "on", "--steps", str(4 * EVERY))
    [rec] = restored_records(tmp_path / "run", 1)
    assert (rec["step"], rec["tier"], rec["bytes_from_storage"]) == (3 * EVERY, "memory", 0)
    restored = json.loads((tmp_path / "digests" / "restored-a1-r0.json").read_text())
    assert restored["digest"] == saved_digest(tmp_path / "digests", 0, 0, 3 * EVERY)


# ------------------------------------------------------------------------- torchrun scenarios


@pytest.mark.slow
@pytest.mark.multiproc
def test_worker_sigkilled_agent_alive_restores_from_memory(tmp_path, memjob):
    """One node, one worker, the trainer's default (memory tier on under torchrun). The
    worker is SIGKILLed after step 16, its newest checkpoint (15) in memory only; torchrun
    restarts it and it resumes from step 15 out of its segment, bit-exact, reading nothing
    from the root (which holds step 10)."""
    c = _memory_job.Cluster(tmp_path, job_args(tmp_path, memjob, "--hold-at", str(HOLD_AT)),
                            memjob, nnodes="1:1")
    try:
        [node] = [c.add_node()]
        holding = tmp_path / "digests" / "holding-r0.json"
        cluster_harness.wait_for(holding.exists, JOB_TIMEOUT, "the worker to hold", cluster=c)
        held = json.loads(holding.read_text())
        assert held["step"] == HOLD_AT - 1
        root_steps = ckpt.CheckpointManager(tmp_path / "ckpt", read_only=True).steps()
        assert root_steps == [2 * EVERY], root_steps  # step 15 exists in memory only
        os.kill(held["pid"], signal.SIGKILL)  # the agent lives and restarts it
        wait_all(c, [node], tmp_path)
    finally:
        c.close()
    [rec] = restored_records(tmp_path / "run", 1)
    assert (rec["step"], rec["tier"], rec["bytes_from_storage"]) == (3 * EVERY, "memory", 0)
    restored = json.loads((tmp_path / "digests" / "restored-a1-r0.json").read_text())
    assert restored["step"] == 3 * EVERY
    assert restored["digest"] == saved_digest(tmp_path / "digests", 0, 0, 3 * EVERY)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_step"] == STEPS
    assert summary["recoveries"][-1]["restored_from"] == "memory"


@pytest.mark.slow
@pytest.mark.multiproc
def test_node_killed_survivors_restore_from_peer_replica_at_world_2(tmp_path, memjob):
    """Three nodes hold after step 16, step 15 (in memory only) committed and replicated.
    Rank 1's node dies: its agent and worker SIGKILLed, its shared memory (own segment and
    the replica it held) removed. The two survivors re-form at world 2 and restore step 15:
    the lost rank's shards from the replica on the next node, zero bytes from the root
    (which holds step 10), model and optimizer equal to the saved step."""
    c = _memory_job.Cluster(tmp_path, job_args(tmp_path, memjob, "--hold-at", str(HOLD_AT),
                                               "--hold-until-world", "3"), memjob,
                            nnodes="2:3")
    try:
        nodes = [c.add_node() for _ in range(3)]
        holding = [tmp_path / "digests" / f"holding-r{r}.json" for r in range(3)]
        cluster_harness.wait_for(lambda: all(h.exists() for h in holding), JOB_TIMEOUT,
                                 "every worker to hold", cluster=c)
        assert ckpt.CheckpointManager(tmp_path / "ckpt", read_only=True).steps() == [
            2 * EVERY]
        dead = c.node_of(json.loads(holding[1].read_text())["pid"])
        dead.kill(signal.SIGKILL)
        gone = [e for e in os.listdir(SHM_DIR)
                if e.startswith(f"{PREFIX}{memjob}-{c.node_name(c.nodes.index(dead))}-")]
        assert any("replica" in g for g in gone) and len(gone) >= 2, gone
        for entry in gone:
            shutil.rmtree(os.path.join(SHM_DIR, entry))
        wait_all(c, [n for n in nodes if n is not dead], tmp_path)
    finally:
        c.close()
    p = cluster_harness.progress(tmp_path / "run")
    attempt = max(a for a in p if p[a]["world"] == 2)
    recs = restored_records(tmp_path / "run", attempt)
    assert len(recs) == 2 and {r["step"] for r in recs} == {3 * EVERY}, recs
    tiers = {r["tier"] for r in recs}
    assert "peer" in tiers and tiers <= {"memory", "peer"}, recs
    assert all(r["bytes_from_storage"] == 0 for r in recs), recs
    want = saved_digest(tmp_path / "digests", 0, 0, 3 * EVERY)
    for rank in range(2):
        got = json.loads((tmp_path / "digests" / f"restored-a{attempt}-r{rank}.json")
                         .read_text())
        assert (got["step"], got["world"], got["digest"]) == (3 * EVERY, 2, want)
