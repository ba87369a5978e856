"""Three torchrun nodes, each with shared memory of its own, as separate hosts have: a node
killed takes its memory with it, and the survivors resume from what their own memory and the
peer replica hold.

Each agent runs in a mount namespace of its own with a fresh tmpfs on /dev/shm (``unshare
-m``), and nothing names the nodes (no ``CKPT_NODE``): the memory tier names each node by the
identity it keeps in that node's /dev/shm. The job is tests/support/memory_job.py with the
ElasticTrainer's defaults (a probe recorded with every checkpoint, restores through the
forward gate, the memory tier on under torchrun), checkpointing every 2 steps, persisting to
the root only every 1000 (so only the trainer's first checkpoint, step 0, and its final one
reach the root). Every worker holds before step 7 with step 6 committed and replicated; then
the node running rank 0 is SIGKILLed, so torchrun renumbers both survivors' nodes and ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import uuid
from pathlib import Path

import pytest

from ckpt._memory.tier import PREFIX, SHM_DIR, private_path
from tests.support import elastic_job as cluster_harness
from tests.support import memory_job
from tests.e2e.test_memory_torchrun import (restored_digests, restored_records, root_steps,
                                            saved_digest, wait_all)

EVERY, PERSIST, STEPS, HOLD = 2, 1000, 8, 7
TIMEOUT = 120.0

pytestmark = [
    pytest.mark.slow, pytest.mark.multiproc,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                       reason="a mount namespace per node needs root and unshare(1)"),
]

# Runs the rest of the command line with a tmpfs of its own on /dev/shm, in a new mount
# namespace: the node's shared memory, gone when the node's last process is.
PRIVATE_SHM = ["unshare", "-m", "sh", "-c",
               'mount -t tmpfs -o size=512m tmpfs /dev/shm && exec "$@"', "sh"]


class PrivateShmCluster(memory_job.Cluster):
    """memory_job.Cluster with each agent in its own mount namespace and no node names."""

    wrapper = PRIVATE_SHM
    rdzv_id = "private-shm"

    def node_env(self, i: int) -> dict[str, str]:
        return {k: v for k, v in self.env.items() if k != "CKPT_NODE"}


def mount_namespace(pid: int | str) -> str:
    return os.readlink(f"/proc/{pid}/ns/mnt")


def our_segments(memjob: str) -> list[str]:
    """This job's segments in the test's own /dev/shm (the host's)."""
    here = private_path(SHM_DIR)
    return [e for e in (os.listdir(here) if os.path.isdir(here) else [])
            if e.startswith(f"{PREFIX}{memjob}")]


@pytest.fixture(scope="module")
def killed_node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("private_shm")
    memjob = f"ps{uuid.uuid4().hex[:10]}"
    args = ["--root", str(tmp / "ckpt"), "--run-dir", str(tmp / "run"), "--digests",
            str(tmp / "digests"), "--steps", str(STEPS), "--every", str(EVERY),
            "--persist-every", str(PERSIST), "--memory-job", memjob,
            "--collective-timeout", "30", "--hold-at", str(HOLD), "--hold-until-world", "3",
            "--trainer-defaults"]
    c = PrivateShmCluster(tmp, args, memjob, nnodes="2:3")
    facts: dict = {"tmp": tmp, "memjob": memjob}
    try:
        nodes = [c.add_node() for _ in range(3)]

        def held() -> list[dict] | None:
            marks = [tmp / "digests" / f"holding-s{HOLD}-r{r}.json" for r in range(3)]
            return all(m.exists() for m in marks) and [json.loads(m.read_text())
                                                         for m in marks]

        holding = cluster_harness.wait_for(held, TIMEOUT, f"every worker to hold before step "
                                           f"{HOLD}", cluster=c)
        facts["namespaces"] = [mount_namespace(h["pid"]) for h in holding]
        facts["root_before_kill"] = root_steps(tmp)
        facts["killed_attempt"] = holding[0]["attempt"]
        dead = c.node_of(holding[0]["pid"])  # rank 0's node: the survivors are renumbered
        dead.kill(signal.SIGKILL)
        (tmp / "digests" / f"release-s{HOLD}").touch()
        wait_all(c, [n for n in nodes if n is not dead], tmp)
        facts["logs"] = {n.name: n.log() for n in nodes if n is not dead}
        facts["segments_here"] = our_segments(memjob)
    finally:
        c.close()
    return facts


def test_each_node_has_shared_memory_of_its_own(killed_node):
    spaces = killed_node["namespaces"]
    assert len(set(spaces)) == 3 and mount_namespace("self") not in spaces
    assert killed_node["segments_here"] == []  # nothing of the job in the host's /dev/shm


def test_survivors_resume_from_their_memory_and_the_peer_replica(killed_node):
    """The resume comes from step 6, which exists only in the survivors' memory (their own
    segments and the replica of the dead node's shards), through the forward gate, with zero
    bytes from the root and the model and optimizer as saved."""
    tmp = killed_node["tmp"]
    assert HOLD - 1 not in killed_node["root_before_kill"]  # in memory only
    killed = killed_node["killed_attempt"]
    recs = restored_records(tmp / "run", killed + 1)
    assert len(recs) == 2, recs
    assert {r["step"] for r in recs} == {HOLD - 1}, recs  # not a fresh start, not the root's
    assert {r["bytes_from_storage"] for r in recs} == {0}, recs
    assert all(r["skipped_steps"] == [] for r in recs), recs  # the newest step, first try
    assert {r["tier"] for r in recs} <= {"memory", "peer"} and "peer" in {
        r["tier"] for r in recs}, recs
    want = saved_digest(tmp / "digests", killed, 0, HOLD - 1)
    got = restored_digests(tmp, killed + 1)
    assert len(got) == 2 and all((g["step"], g["world"], g["digest"]) == (HOLD - 1, 2, want)
                                 for g in got), got


def test_the_new_attempt_replicates_its_checkpoints(killed_node):
    logs = killed_node["logs"]
    assert not any("No such file or directory" in log for log in logs.values()), logs
    summary = json.loads((killed_node["tmp"] / "run" / "summary.json").read_text())
    assert summary["final_step"] == STEPS and summary["world_sizes"][-1] == 2
