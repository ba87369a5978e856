"""Replication of memory-tier steps: which ranks receive a rank's replica, and what a receiver
stores (only what a peer of this job may send, its newest steps only)."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest

from ckpt._memory.replication import Replicator, ring_targets
from ckpt._memory.tier import replica_name

from tests.support.replica_peer import send_replica


def _send(address: tuple, header: dict, payload: bytes, *, key: str = "s3cret",
          close_early: bool = False) -> bytes:
    return send_replica(address, key, "j", header, payload, close_early=close_early)


DOC = json.dumps({"step": 3, "rank": 1}).encode()


GOOD = {"origin": 1, "step": 3, "files": [["data-0", 4]], "doc": len(DOC)}


HOSTILE = {
    "wrong key": (GOOD, b"abcd" + DOC),
    "no key yet": (GOOD, b"abcd" + DOC),  # before connect()
    "path in a name": ({**GOOD, "files": [["../../evil", 4]]}, b"abcd" + DOC),
    "another step": ({**GOOD}, b"abcd" + json.dumps({"step": 4, "rank": 1}).encode()),
    "negative rank": ({**GOOD, "origin": -1, "doc": len(DOC) + 1},
                      b"abcd" + json.dumps({"step": 3, "rank": -1}).encode()),
    "over budget": ({**GOOD, "files": [["data-0", 64]]}, bytes(64) + DOC),
    "dropped": ({**GOOD, "files": [["data-0", 100]]}, bytes(10)),  # the sender dies
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_replica_receiver_stores_nothing_a_peer_may_not_send(tmp_path, case):
    """A replica receiver stores nothing a peer may not send and hangs up: a peer without the
    job's key, or any before the key is set (refused at the handshake, not counted: anyone who
    can connect could inflate the count); and, counted as failed, from a peer with the key: a
    file name with a path in it, a rank document of another step, a negative origin rank, a
    step over its budget, and a transfer dropped part-way (no staging directory left behind)."""
    counted: list[str] = []
    shm = tmp_path / "shm"
    shm.mkdir()
    rep = Replicator(shm_dir=str(shm), job="j", node="n", keep=2, timeout=10,
                     budget=32 if case == "over budget" else None, count=counted.append,
                     auth_timeout=1.0 if case == "no key yet" else 10.0)  # (waits for a key)
    unauthenticated = case in ("wrong key", "no key yet")
    try:
        if case != "no key yet":
            rep.connect([], "s3cret")
            assert _send(rep.address, GOOD, b"abcd" + DOC) == b"OK"  # the control
            assert counted == []
        header, payload = HOSTILE[case]
        reply = _send(rep.address, header, payload, close_early=case == "dropped",
                      key="guess" if case == "wrong key" else "s3cret")
        deadline = time.monotonic() + 30
        while not unauthenticated and "failed" not in counted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert reply == b"" and counted == ([] if unauthenticated else ["failed"])
        stored = sorted(str(p.relative_to(shm)) for p in shm.rglob("*")
                        if p.is_file() and p.name != "owner" and "owner" not in p.name)
        assert stored == ([] if case == "no key yet" else
                          [f"{replica_name('j', 'n', 1)}/step-00000003/data-0",
                           f"{replica_name('j', 'n', 1)}/step-00000003/rank.json"])
        assert not list(shm.rglob(".tmp-*")) and not (shm / "evil").exists()
    finally:
        rep.close()


def test_a_replica_receiver_keeps_only_its_newest_generations(tmp_path):
    """A replica receiver keeps only the ``keep`` newest steps a peer sent: memory (/dev/shm) holds
    no more."""
    rep = Replicator(shm_dir=str(tmp_path), job="j", node="n", keep=2, timeout=10)
    try:
        rep.connect([], "s3cret")
        for step in (3, 4, 5):
            doc = json.dumps({"step": step, "rank": 1}).encode()
            assert _send(rep.address, {**GOOD, "step": step, "doc": len(doc)},
                         b"abcd" + doc) == b"OK"
        segment = tmp_path / replica_name("j", "n", 1)
        assert sorted(p.name for p in segment.glob("step-*")) == ["step-00000004",
                                                                  "step-00000005"]
    finally:
        rep.close()


def test_replicas_go_to_other_nodes_and_spread_over_a_smaller_nodes_ranks():
    """A rank's replicas go to other nodes, never to itself, and the ranks whose local rank a
    smaller node lacks spread over that node's ranks."""
    assert ring_targets(0, ["a", "b"], [0, 0], replicas=3) == [1]
    nodes, local = ["a", "a", "a", "a", "b", "b"], [0, 1, 2, 3, 0, 1]
    assert [ring_targets(r, nodes, local, 1)[0] for r in range(4)] == [4, 5, 4, 5]


def test_a_step_sent_before_the_receiver_has_the_key_waits_for_it(tmp_path):
    """Opening the memory tier hands every rank the key at about the same time, and a rank may
    send its first step before a peer has set the key: that peer waits for the key (within
    the handshake's deadline) instead of refusing a rank of its own job."""
    import threading

    rep = Replicator(shm_dir=str(tmp_path), job="j", node="n", keep=2, timeout=10,
                     host="127.0.0.1", auth_timeout=20)
    reply: list[bytes] = []
    sender = threading.Thread(target=lambda: reply.append(_send(rep.address, GOOD,
                                                                b"abcd" + DOC)), daemon=True)
    try:
        sender.start()
        time.sleep(0.5)  # the sender has connected and is waiting for the receiver's answer
        rep.connect([], "s3cret")
        sender.join(30)
        assert reply == [b"OK"]
        assert (tmp_path / replica_name("j", "n", 1) / "step-00000003" / "data-0").exists()
    finally:
        rep.close()


def _rank_step(segment, step: int, origin: int) -> str:
    """A rank step directory of ``origin`` in ``segment``: one data file and its rank.json."""
    path = segment / f"step-{step:08d}"
    path.mkdir(parents=True)
    (path / "data-0").write_bytes(bytes([step]) * 4)
    (path / "rank.json").write_bytes(json.dumps({"step": step, "rank": origin}).encode())
    return str(path)


def _sender_and_receiver(tmp_path, keep: int = 2) -> tuple[Replicator, Replicator]:
    """A sender whose steps go to a receiver (the receiver not given the key yet)."""
    receiving = Replicator(shm_dir=str(tmp_path / "b"), job="j", node="b", keep=keep,
                           timeout=10, host="127.0.0.1", auth_timeout=30)
    sending = Replicator(shm_dir=str(tmp_path / "a"), job="j", node="a", keep=keep,
                         timeout=10, host="127.0.0.1")
    sending.connect([receiving.address], "s3cret")
    return sending, receiving


def _handling(rep: Replicator) -> threading.Event:
    """An event set once ``rep``'s receiver handles a connection (accepted, on its thread)."""
    entered, receive = threading.Event(), rep.receiver._receive

    def handle(conn, peer) -> None:
        entered.set()
        receive(conn, peer)

    rep.receiver._receive = handle
    return entered


def test_a_burst_of_saves_replicates_every_generation_the_segment_keeps(tmp_path):
    """Steps saved faster than they are replicated are all sent, oldest first, as long as
    the segment keeps them: the replicas hold the same generations as the segment (the
    newest and the one a restore falls back to), not whichever step was newest when the
    sender was free. A step the segment retires while it is being sent is sent whole."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    counted: list[str] = []
    sending, receiving = _sender_and_receiver(tmp_path)
    sending._count = counted.append
    handling = _handling(receiving)
    segment = tmp_path / "a" / "own"
    try:
        sending.submit(0, _rank_step(segment, 0, origin=1), origin=1)
        # Step 0 is on its way (connected; the receiver waits for its key) while steps 2
        # and 4 are saved, and the segment, which keeps 2 and 4, retires it.
        assert handling.wait(30)
        for step in (2, 4):
            sending.submit(step, _rank_step(segment, step, origin=1), origin=1)
        (segment / "step-00000000").rename(segment / ".aside")
        shutil.rmtree(segment / ".aside")
        receiving.connect([], "s3cret")
        assert sending.drain(30)
        held = tmp_path / "b" / replica_name("j", "b", 1)
        assert sorted(p.name for p in held.glob("step-*")) == ["step-00000002",
                                                               "step-00000004"]
        assert (held / "step-00000002" / "data-0").read_bytes() == bytes([2]) * 4
        assert counted == ["replicated"] * 3
    finally:
        sending.close()
        receiving.close()


def test_waiting_steps_beyond_keep_or_of_a_left_line_are_superseded(tmp_path):
    """At most ``keep`` steps wait to be sent (an older one would be retired on both sides);
    a step saved below waiting ones (the job went back to an older step) supersedes them, so
    a step of the line the job left is never sent after the new line's."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    counted: list[str] = []
    sending, receiving = _sender_and_receiver(tmp_path)
    sending._count = counted.append
    handling = _handling(receiving)
    segment = tmp_path / "a" / "own"
    try:
        sending.submit(1, _rank_step(segment, 1, origin=1), origin=1)
        assert handling.wait(30)
        for step in (4, 5, 9, 7):  # 9 pushes 4 out of the newest two; 7 supersedes 9
            sending.submit(step, _rank_step(segment, step, origin=1), origin=1)
        receiving.connect([], "s3cret")
        assert sending.drain(30)
        held = tmp_path / "b" / replica_name("j", "b", 1)
        assert sorted(p.name for p in held.glob("step-*")) == ["step-00000005",
                                                               "step-00000007"]
        assert sorted(counted) == ["replicated"] * 3 + ["superseded"] * 2
    finally:
        sending.close()
        receiving.close()
