"""A node's name in the memory tier's segments: the hostname and an identity kept in the
node's own shared memory, the same for every process that sees that /dev/shm, whatever node
rank torchrun gives it (a renumbered node finds its segments), different for another
/dev/shm. The torchrun scenario (three nodes with private /dev/shm, one killed) is
tests/e2e/test_private_shm_nodes.py."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch

import ckpt
from ckpt._memory.tier import NODE_FILE, MemoryTier, UnsafeSegmentError, node_id, node_name
from ckpt._memory.private import private_dir


@pytest.fixture(autouse=True)
def no_node_name(monkeypatch):
    monkeypatch.delenv("CKPT_NODE", raising=False)


def test_one_shared_memory_is_one_node_whatever_torchrun_numbers_it(tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("GROUP_RANK", "1")
    first = MemoryTier(str(tmp_path / "root"), 0, job="j", shm_dir=str(shm), ranked=True)
    first.close()
    monkeypatch.setenv("GROUP_RANK", "0")  # torchrun renumbered the node after a loss
    again = MemoryTier(str(tmp_path / "root"), 1, job="j", shm_dir=str(shm), ranked=True)
    again.close()
    assert first.node == again.node
    host = node_name(socket.gethostname())
    assert first.node.startswith(f"{host}_") and not first.node.endswith(("_n0", "_n1"))
    other = tmp_path / "other"  # another node's /dev/shm
    other.mkdir()
    assert node_name(None, private_dir(str(other))) != first.node


def test_a_name_given_wins(tmp_path, monkeypatch):
    private = private_dir(str(tmp_path))
    assert node_name("rack-7", private) == "rack_7"
    monkeypatch.setenv("CKPT_NODE", "rack-8")
    assert node_name(None, private) == "rack_8"
    assert not os.path.exists(os.path.join(private, NODE_FILE))


def test_ranks_starting_together_agree_on_the_identity(tmp_path):
    private = private_dir(str(tmp_path))
    start, seen = threading.Barrier(8), []

    def ask() -> None:
        start.wait()
        seen.append(node_id(private))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 8 and len(set(seen)) == 1
    assert sorted(os.listdir(private)) == [NODE_FILE]  # nothing staged left behind


def test_a_damaged_or_linked_identity_is_refused_not_followed(tmp_path):
    private = private_dir(str(tmp_path))
    path = os.path.join(private, NODE_FILE)
    with open(path, "w") as f:
        f.write("../../etc")
    with pytest.raises(UnsafeSegmentError, match="not a node identity"):
        node_id(private)
    os.remove(path)
    target = tmp_path / "elsewhere"
    target.write_text("0123abcd")
    os.symlink(target, path)
    with pytest.raises(OSError):
        node_id(private)


def test_the_manager_names_its_segment_by_the_node_identity(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    tier = ckpt.MemoryTierOptions(shm_dir=str(shm), job="j")
    with ckpt.CheckpointManager(tmp_path / "root", memory_tier=tier, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(3)}, force=True)
        ident = node_id(private_dir(str(shm)))
        assert os.path.basename(mgr._publisher.tier.path) == \
            f"ckpt-j-{node_name(socket.gethostname())}_{ident}-r0"
