"""The replica receiver gives nothing to a connection before it proves it holds the job's key:
what a hostile connection costs the receiving process (memory, threads, time), that a peer
without the key stores nothing and is sent nothing, and that an authenticated peer's steps
are bounded per origin. The receiver runs in a process of its own, forked from the suite's
fork server (tests/support/replica_receiver_proc.py), so that its memory and threads can be
read."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from ckpt._memory import replica_wire as wire
from ckpt._memory.replication import Replicator
from ckpt._memory.tier import replica_name

from tests.support.ranks import forkserver
from tests.support.replica_peer import send_replica
from tests.support.replica_receiver_proc import serve

AUTH_S = 2.0  # the receiver's deadline for a connection to authenticate
#: What eight unauthenticated connections at once, each announcing a 64 MiB header (one
#: also sending a 16 MiB one), may add to the receiving process's peak resident memory.
BOUND = 4 << 20


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "Threads"):
            out[key] = int(value.split()[0]) * (1024 if key.startswith("Vm") else 1)
    return out


@pytest.fixture(scope="module")
def receiver(tmp_path_factory):
    """A receiver process (key "s3cret", AUTH_S to authenticate): (pid, address, shm dir)."""
    shm = tmp_path_factory.mktemp("shm")
    ctx = forkserver()
    port, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=serve, args=(str(shm), "s3cret", AUTH_S, port, stop),
                       daemon=True)
    proc.start()
    try:
        yield proc.pid, ("127.0.0.1", port.get(timeout=120)), shm
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _closed_by_peer(sock: socket.socket, within: float) -> bool:
    """Whether the receiver closes ``sock`` (EOF or reset) within ``within`` seconds; the
    greeting it sends first is read and dropped."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_an_unauthenticated_connection_costs_the_receiver_under_a_fixed_bound(receiver):
    """Eight connections at once that announce a 64 MiB header, one of them sending 16 MiB of
    it, add less than BOUND (4 MiB) to the receiver's peak resident memory: it reads 64 bytes
    of proof before any length, and nothing the connection announces is allocated."""
    pid, address, _ = receiver
    with socket.create_connection(address, timeout=30) as warm:  # the refusal's code paths
        warm.sendall(bytes(64))
        assert _closed_by_peer(warm, within=30)
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # restart the peak (VmHWM) from now
    before = _status(pid)["VmHWM"]
    conns = [socket.create_connection(address, timeout=30) for _ in range(8)]
    try:
        for c in conns:
            c.sendall(struct.pack("!Q", 64 << 20))
        try:
            conns[0].sendall(b"{" + b" " * (16 << 20))
        except OSError:  # the receiver hung up part-way: it read what it needed
            pass
        time.sleep(1.0)
        during = _status(pid)["VmHWM"]
        assert all(_closed_by_peer(c, within=30) for c in conns)
    finally:
        for c in conns:
            c.close()
    grown = _status(pid)["VmHWM"] - before
    print(f"peak resident memory: {before >> 10} KiB before, +{(during - before) >> 10} KiB "
          f"with 8 hostile connections open, +{grown >> 10} KiB in all")
    assert grown < BOUND


def test_a_trickling_connection_is_dropped_at_its_deadline(receiver):
    """A connection that announces a 1 MiB header, then sends a byte of it every half second,
    so that no single read ever times out, is closed once its deadline to authenticate
    (AUTH_S) has passed."""
    _, address, _ = receiver
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(struct.pack("!Q", 1 << 20))
        stop = threading.Event()

        def trickle():
            while not stop.wait(0.5):
                try:
                    sock.send(b" ")
                except OSError:
                    return

        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        try:
            assert _closed_by_peer(sock, within=AUTH_S + 30)
        finally:
            stop.set()
            t.join()


def test_sixty_idle_connections_do_not_make_sixty_threads(receiver):
    """Sixty idle connections at once get at most the receiver's eight handler threads (the
    others are closed on arrival), and every one of them is closed by its deadline."""
    pid, address, _ = receiver
    base = _status(pid)["Threads"]
    conns = [socket.create_connection(address, timeout=30) for _ in range(60)]
    try:
        time.sleep(0.5)
        threads = _status(pid)["Threads"]
        print(f"receiver threads: {base} before, {threads} with 60 idle connections")
        assert threads <= base + 8
        assert all(_closed_by_peer(c, within=AUTH_S + 30) for c in conns)
    finally:
        for c in conns:
            c.close()


def test_a_peer_without_the_key_stores_nothing_and_is_sent_nothing(receiver, tmp_path):
    """A sender with another key stores nothing on the receiver (no segment, no staging
    directory) and counts a failure; and a sender facing an impostor that greets it but cannot
    prove the key sends it nothing of the step: only its own proof (64 bytes), never the key,
    the header or the data."""
    pid, address, shm = receiver
    step = tmp_path / "step-00000003"
    step.mkdir()
    (step / "data-0").write_bytes(b"WEIGHTS!" * 512)
    (step / "rank.json").write_bytes(json.dumps({"step": 3, "rank": 1}).encode())
    counted: list[str] = []
    sender = Replicator(shm_dir=str(tmp_path), job="j", node="m", keep=2, timeout=10,
                        host="127.0.0.1", count=counted.append)
    impostor = socket.create_server(("127.0.0.1", 0))
    got = bytearray()

    def pretend():
        conn, _ = impostor.accept()
        with conn:
            conn.sendall(b"ckptrep2" + os.urandom(32))
            conn.settimeout(5)
            try:
                while len(got) < 64:
                    got.extend(conn.recv(4096) or b"")
                conn.sendall(os.urandom(32))  # a proof it cannot make
                while chunk := conn.recv(4096):
                    got.extend(chunk)
            except OSError:
                pass

    t = threading.Thread(target=pretend, daemon=True)
    t.start()
    try:
        sender.connect([address, impostor.getsockname()], "0123abcd")  # not "s3cret"
        sender.submit(3, str(step), 1)
        assert sender.drain(60)
        t.join(30)
    finally:
        sender.close()
        impostor.close()
    assert counted == ["failed", "failed"]
    assert list(shm.iterdir()) == []
    assert len(got) == 64 and b"WEIGHTS!" not in got and b"0123abcd" not in got
    assert b"step" not in got


def test_one_step_of_an_origin_arrives_at_a_time(tmp_path):
    """An origin rank's second step, sent while its first is arriving (and still arriving
    once the second has waited its bound), is refused before a byte of it is stored (its
    budget is booked per origin, not per step); the first one arrives whole."""
    counted: list[str] = []
    rep = Replicator(shm_dir=str(tmp_path), job="j", node="n", keep=2, timeout=10,
                     host="127.0.0.1", count=counted.append)
    rep.connect([], "s3cret")
    rep.receiver.reserve_wait = 0.5  # how long the second waits for the first to end
    rep.hold.clear()  # authenticated steps wait before they are stored
    doc = json.dumps({"step": 3, "rank": 1}).encode()
    header = {"origin": 1, "step": 3, "files": [["data-0", 4]], "doc": len(doc)}
    first: list[bytes] = []
    t = threading.Thread(target=lambda: first.append(
        send_replica(rep.address, "s3cret", "j", header, b"abcd" + doc)), daemon=True)
    try:
        t.start()
        deadline = time.monotonic() + 30
        while not rep.receiver._reserved and time.monotonic() < deadline:
            time.sleep(0.02)
        doc4 = json.dumps({"step": 4, "rank": 1}).encode()
        second = send_replica(rep.address, "s3cret", "j",
                              {**header, "step": 4, "doc": len(doc4)}, b"abcd" + doc4)
        assert second == b"" and counted == ["failed"]
        rep.hold.set()
        t.join(30)
        assert first == [b"OK"]
        segment = tmp_path / replica_name("j", "n", 1)
        assert sorted(p.name for p in segment.glob("step-*")) == ["step-00000003"]
    finally:
        rep.hold.set()
        rep.close()


def test_a_step_that_arrives_while_a_failed_one_is_cleaned_up_is_stored(tmp_path):
    """The sender's transfer of step 3 fails mid-way (it hangs up) and its next step, 4,
    connects before the receiver has cleaned up after 3: step 4 waits for that cleanup
    instead of being refused, and is stored."""
    counted: list[str] = []
    rep = Replicator(shm_dir=str(tmp_path), job="j", node="n", keep=2, timeout=10,
                     host="127.0.0.1", count=counted.append)
    rep.connect([], "s3cret")
    rep.receiver.reserve_wait = 60.0  # a bound the test never reaches
    rep.hold.clear()  # step 3's end here (its failure, its cleanup) waits
    doc = json.dumps({"step": 3, "rank": 1}).encode()
    header = {"origin": 1, "step": 3, "files": [["data-0", 4]], "doc": len(doc)}
    doc4 = json.dumps({"step": 4, "rank": 1}).encode()
    second: list[bytes] = []
    try:
        # Step 3: the header, two of its four bytes, and the sender is gone.
        assert send_replica(rep.address, "s3cret", "j", header, b"ab", close_early=True) == b""
        deadline = time.monotonic() + 30
        while not rep.receiver._reserved and time.monotonic() < deadline:
            time.sleep(0.02)
        t = threading.Thread(target=lambda: second.append(send_replica(
            rep.address, "s3cret", "j", {**header, "step": 4, "doc": len(doc4)},
            b"wxyz" + doc4)), daemon=True)
        t.start()
        while rep.receiver.waiting == 0 and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)  # step 4 is waiting for step 3's end (or was refused)
        rep.hold.set()  # step 3 fails now and is cleaned up
        t.join(30)
        assert second == [b"OK"] and counted == ["failed"]
        segment = tmp_path / replica_name("j", "n", 1)
        assert sorted(p.name for p in segment.glob("step-*")) == ["step-00000004"]
        assert (segment / "step-00000004" / "data-0").read_bytes() == b"wxyz"
    finally:
        rep.hold.set()
        rep.close()


def test_a_header_over_the_cap_is_refused_before_it_is_read(tmp_path):
    """A peer with the key that announces a header over HEADER_MAX (1 MiB) is hung up on at
    once, counted as failed, without the receiver waiting for (or allocating) the header."""
    counted: list[str] = []
    rep = Replicator(shm_dir=str(tmp_path), job="j", node="n", keep=2, timeout=120,
                     host="127.0.0.1", count=counted.append)
    rep.connect([], "s3cret")
    try:
        with socket.create_connection(rep.address, timeout=30) as sock:
            wire.sender_handshake(sock, wire.key_of("s3cret"), "j", time.monotonic() + 30)
            sock.sendall(struct.pack("!I", wire.HEADER_MAX + 1))
            assert _closed_by_peer(sock, within=60)  # its read deadline is 120 s
        assert counted == ["failed"] and list(tmp_path.iterdir()) == []
    finally:
        rep.close()


def test_closing_lets_a_replica_arriving_finish_before_its_segment_goes(tmp_path, caplog):
    """A rank closing its replicator at the end of the job while a peer's step is still
    arriving: the step arrives whole (the peer is answered OK), nothing fails with a missing
    staging directory, and the replica segment is removed after it (its steps persisted)."""
    rep = Replicator(shm_dir=str(tmp_path), job="j", node="n", keep=2, timeout=30,
                     host="127.0.0.1")
    rep.connect([], "s3cret")
    doc = json.dumps({"step": 8, "rank": 1}).encode()
    header = {"origin": 1, "step": 8, "files": [["data-0", 4]], "doc": len(doc),
              "doc_sha256": hashlib.sha256(doc).hexdigest()}
    closer = threading.Thread(target=rep.close, kwargs={"drain": 10.0, "remove_upto": 8},
                              daemon=True)
    with caplog.at_level(logging.INFO, logger="ckpt"), \
            socket.create_connection(rep.address, timeout=30) as sock:
        nonces = wire.sender_handshake(sock, wire.key_of("s3cret"), "j", time.monotonic() + 30)
        sock.sendall(wire.header_frame(wire.key_of("s3cret"), nonces,
                                       json.dumps(header).encode()) + b"ab")
        deadline = time.monotonic() + 30
        while not list(tmp_path.glob("*/.tmp-step-00000008-*")) and time.monotonic() < deadline:
            time.sleep(0.02)  # the step is arriving: its staging directory exists
        closer.start()
        time.sleep(0.5)  # the close is under way
        sock.sendall(b"cd" + doc)
        sock.shutdown(socket.SHUT_WR)
        reply = wire.recv_exact(sock, 2, time.monotonic() + 30)
        closer.join(30)
    assert reply == b"OK"
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "stored step=8 of rank=1" in caplog.text
    assert list(tmp_path.glob("ckpt-*")) == []
