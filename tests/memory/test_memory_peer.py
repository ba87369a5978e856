"""The memory tier under a process group: per-rank segments, peer replication in
the background, and restore from own memory or peers onto a reshaped world, with fall-through
to the persistent root. Real processes on gloo; each rank plays one node (its name in the
segment names, as torchrun's GROUP_RANK or CKPT_NODE would set it); every test has its own
segment directory. Bodies in tests/support/memory_workers.py."""

from __future__ import annotations

import os
import shutil

import pytest

from ckpt._memory.tier import gc_segments, private_path

from tests.support.ranks import run_ranks
from tests.support.memory_workers import (restore, restore_after_node_loss, restore_from_peers,
                             save_small_chunks_in_memory, save_steps)
from pathlib import Path

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

STEPS = [1, 2, 3]  # persist_every=2: the root holds step 2; memory holds steps 2 and 3


def segment_dirs(shm) -> list[str]:
    return sorted(os.listdir(private_path(shm)))


def remove_node(shm, job: str, node: str) -> list[str]:
    """A node's loss: its own segments and the replicas it holds."""
    shm = private_path(shm)
    gone = [n for n in os.listdir(shm) if n.startswith(f"ckpt-{job}-{node}-")]
    for n in gone:
        shutil.rmtree(os.path.join(shm, n))
    return gone


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two nodes of one rank save steps 1-3 (rank 1's replica receiver held through the
    first save); then the root's data files are removed and a restarted pair restores."""
    tmp = tmp_path_factory.mktemp("pair")
    root, shm, flag = str(tmp / "root"), tmp / "shm", str(tmp / "released")
    shm.mkdir()
    nodes = ["hostA_n0", "hostA_n1"]
    saved = run_ranks(2, save_steps, root, str(shm), "pair", nodes, STEPS, 2, flag,
                      timeout=100)
    segments = segment_dirs(shm)
    step2 = os.path.join(root, "step-00000002")
    for name in os.listdir(step2):
        if name != "manifest.json":
            os.remove(os.path.join(step2, name))
    restored = run_ranks(2, restore, root, str(shm), "pair", nodes, timeout=100)
    return saved, segments, restored, shm


def test_save_returns_while_the_peers_receiver_is_held(pair):
    saved, segments, _, _ = pair
    # Rank 0's first save returned although rank 1 had stored none of its replica yet...
    assert saved[0]["replica_before_release"] == []
    # ...and once released, every step's replica arrived (acknowledged by the peer).
    assert [s["replicated"] for s in saved] == [True, True]
    assert all(s["replications"] >= 1 and s["failures"] == 0 for s in saved)
    assert segments == ["ckpt-pair-hostA_n0-r0", "ckpt-pair-hostA_n0-replica-r1",
                        "ckpt-pair-hostA_n1-r1", "ckpt-pair-hostA_n1-replica-r0"]


def test_restarted_pair_restores_from_own_memory_without_the_root(pair):
    _, _, restored, _ = pair
    for r in restored:
        assert r == {"step": 3, "tier": "memory", "bytes": 0, "mismatches": [],
                     "ranks": (("memory", 0), ("memory", 0))}


@pytest.fixture(scope="module")
def node_loss(tmp_path_factory):
    """Three nodes save steps 1-3; node 3 is lost (its segments and the replicas it held);
    world 2 restores three times (restore_after_node_loss says what changes in between)."""
    tmp = tmp_path_factory.mktemp("loss")
    root, shm, aside = str(tmp / "root"), tmp / "shm", tmp / "aside"
    shm.mkdir()
    aside.mkdir()
    nodes = ["hostA_n0", "hostA_n1", "hostA_n2"]
    saved = run_ranks(3, save_steps, root, str(shm), "loss", nodes, STEPS, 2, timeout=100)
    assert all(s["replicated"] for s in saved)
    gone = remove_node(shm, "loss", "hostA_n2")
    assert gone and all("hostA_n2" in g for g in gone) and len(gone) == 2
    step2 = os.path.join(root, "step-00000002")
    for name in os.listdir(step2):  # no byte of the root can be read until put back
        if name != "manifest.json":
            os.rename(os.path.join(step2, name), aside / name)
    return run_ranks(2, restore_after_node_loss, root, str(shm), "loss", nodes[:2],
                     str(aside), timeout=150)


def test_survivors_restore_the_lost_ranks_shards_from_peer_replicas(node_loss):
    for r in node_loss:
        assert r["peer"] == {"step": 3, "tier": "peer", "bytes": 0, "mismatches": [],
                             "ranks": (("peer", 0), ("peer", 0))}


def test_a_flipped_bit_in_own_memory_is_read_from_the_replica_instead(node_loss):
    # Rank 0's own copy of step 3 is corrupt; node 2 holds a good replica of it.
    for r in node_loss:
        assert r["own_flipped"] == {"step": 3, "tier": "peer", "bytes": 0, "mismatches": [],
                                    "ranks": (("peer", 0), ("peer", 0))}


def test_a_flipped_bit_in_a_replica_is_detected_and_the_next_step_used(node_loss):
    # Step 3's only copy of the lost rank's shard is corrupt: step 2, still in peers' memory.
    for r in node_loss:
        assert r["flipped"] == {"step": 2, "tier": "peer", "bytes": 0, "mismatches": [],
                                "ranks": (("peer", 0), ("peer", 0))}


def test_both_copies_of_a_shard_gone_falls_back_to_the_root(node_loss):
    for rank, r in enumerate(node_loss):
        out = r["both_gone"]
        assert (out["step"], out["tier"], out["mismatches"]) == (2, "storage", [])
        assert out["bytes"] > 0
        assert out["ranks"][rank] == ("storage", out["bytes"])  # every rank's, by rank
        assert out["ranks"] == node_loss[0]["both_gone"]["ranks"]


def test_gc_finds_the_dead_jobs_segments_and_replicas(pair):
    *_, shm = pair  # every process of the job has exited: no segment has a live owner
    found = gc_segments(str(shm), job="pair", dry_run=True)
    assert sorted(os.path.basename(p) for p in found) == segment_dirs(shm)
    assert any("-replica-" in p for p in found)
    assert gc_segments(str(shm), job="pair") == found and segment_dirs(shm) == []


def test_a_newer_step_in_the_root_wins_over_memory(node_loss):
    for r in node_loss:
        out = r["root_newer"]
        assert (out["step"], out["tier"], out["mismatches"]) == (4, "storage", [])


def test_each_rank_restores_its_own_rng_state_from_memory(tmp_path):
    """Per-rank values (RNGState) of a step held in memory only: the memory tier builds the
    step's manifest from the rank steps, and each rank gets its own generators back, from
    its own segment (one pass) and, after its node's memory is lost, from the replica
    (strict: verify, then apply; the RNG tensor crosses in several pieces each time)."""
    from tests.support.memory_workers import rng_save_and_restore

    root, shm = str(tmp_path / "root"), tmp_path / "shm"
    shm.mkdir()
    out = run_ranks(2, rng_save_and_restore, root, str(shm), "rng", ["hostR_n0", "hostR_n1"],
                    timeout=100)
    assert out[0]["differs_from_rank0"] != out[1]["differs_from_rank0"]  # a real per-rank test
    for rank, r in enumerate(out):
        assert r["own"] == {"step": 1, "tier": "memory", "same": True}
        assert r["peer"] == {"step": 1, "tier": "peer" if rank == 1 else "memory",
                             "same": True}


# --------------------------------------------------------- what a peer sends, and when


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_peer_serving_several_chunks_of_a_lost_rank_sends_each_one_right(tmp_path):
    """A peer serving several chunks of a lost rank's shard in one round sends each byte range its
    own bytes: the survivors restore the step from the peer, exact (with every chunk given the first
    one's bytes the digests fail and the restore falls to the root)."""
    root, shm = str(tmp_path / "root"), tmp_path / "shm"
    shm.mkdir()
    nodes = ["hostG_n0", "hostG_n1", "hostG_n2"]
    assert all(run_ranks(3, save_small_chunks_in_memory, root, str(shm), nodes, timeout=100))
    for name in os.listdir(private_path(shm)):  # node 2 lost: its segment and its replicas
        if name.startswith("ckpt-chunks-hostG_n2-"):
            shutil.rmtree(os.path.join(private_path(shm), name))
    assert not (Path(root) / "step-00000001").exists()  # the root cannot serve it
    for r in run_ranks(2, restore_from_peers, root, str(shm), nodes[:2], timeout=100):
        assert r == {"step": 1, "tier": "peer", "same": True}


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_peer_fetched_chunk_is_read_only_once_its_message_arrived(tmp_path):
    """A chunk fetched from a peer is read (into the live tensor, or into the verify pass's buffer)
    only once the message that brings it has arrived. The holder here sends only once the reader
    waits, so a read that does not wait finds no byte of the step: the restore must still come from
    the peer, exact, in one pass and with the verify pass."""
    from tests.support.late_peer_workers import (restore_with_late_peer_messages,
                                                 save_in_memory_then_lose_node0)

    root, shm, flags = tmp_path / "root", tmp_path / "shm", tmp_path / "flags"
    shm.mkdir()
    flags.mkdir()
    nodes = ["hostG_n0", "hostG_n1"]
    run_ranks(2, save_in_memory_then_lose_node0, str(root), str(shm), "late", nodes,
              timeout=100)
    out = run_ranks(2, restore_with_late_peer_messages, str(root), str(shm), "late", nodes,
                    str(flags), timeout=150)
    # rank 0's bytes come from rank 1's node; rank 1 reads its own
    assert out == [{case: {"step": step, "tier": tier, "exact": True}
                    for case, step in (("newest", 2), ("step 1", 1))}
                   for tier in ("peer", "memory")]
    assert sorted(os.listdir(flags)) == ["newest", "step 1"]  # rank 0 waited each time
