"""The manager's metrics HTTP server: it listens on the address given (all interfaces by
default, as Prometheus exporters do), stops at the manager's ``close()``, and a port that is
in use fails the opening with an error naming the port, leaving the root unlocked.

The attacker of this surface is whoever can reach a listening address: a server bound to
the loopback address is refused to a peer that comes through another interface; someone
who can reach it makes it spend at most ``MAX_CONNECTIONS`` threads, each for at most
``REQUEST_S`` seconds. The textfile's attacker is another user who can write in its
directory: a link planted where the temporary file would go is never written through."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

import ckpt
from ckpt.errors import MetricsServerError
from tests.support.prom import free_port, parse_metrics

pytest.importorskip("prometheus_client")


def listening_addresses(port: int) -> set[str]:
    """The IPv4 addresses a socket of this host listens on at ``port`` (from /proc)."""
    found = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def other_address() -> str | None:
    """An IPv4 address of this host that is not loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))  # no packet is sent: this only picks a route
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def scrape(address: str, port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}:{port}/metrics", timeout=10) as answer:
        return parse_metrics(answer.read().decode())


def test_the_server_listens_on_the_address_given_and_only_there(tmp_path):
    port = free_port()
    with ckpt.CheckpointManager(tmp_path / "root", metrics=ckpt.MetricsOptions(
            port=port, addr="127.0.0.1")) as mgr:
        mgr.save(1, {"w": torch.ones(2)}).wait()
        assert listening_addresses(port) == {"127.0.0.1"}
        assert scrape("127.0.0.1", port)["ckpt_saves_total"] == 1
        outside = other_address()
        if outside is not None:  # a peer on the job's network finds nothing to talk to
            with pytest.raises(OSError):
                socket.create_connection((outside, port), timeout=5).close()


def test_by_default_the_server_listens_on_all_interfaces(tmp_path):
    port = free_port()
    with ckpt.CheckpointManager(tmp_path / "root", metrics=ckpt.MetricsOptions(port=port)):
        assert listening_addresses(port) == {"0.0.0.0"}


def test_close_stops_the_server(tmp_path):
    port = free_port()
    mgr = ckpt.CheckpointManager(tmp_path / "root", metrics=ckpt.MetricsOptions(
        port=port, addr="127.0.0.1"))
    assert "ckpt_saves_total" in scrape("127.0.0.1", port)
    mgr.close()
    assert listening_addresses(port) == set()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        scrape("127.0.0.1", port)
    # and the port is free for the next manager
    with ckpt.CheckpointManager(tmp_path / "root", metrics=ckpt.MetricsOptions(
            port=port, addr="127.0.0.1")):
        assert "ckpt_saves_total" in scrape("127.0.0.1", port)


def test_a_port_in_use_fails_the_opening_naming_the_port_and_leaves_the_root_unlocked(
        tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsServerError, match=f"port {port} is in use") as info:
            ckpt.CheckpointManager(tmp_path / "root", metrics=ckpt.MetricsOptions(
                port=port, addr="127.0.0.1"))
        assert isinstance(info.value, OSError) and isinstance(info.value, ckpt.CheckpointError)
    with ckpt.CheckpointManager(tmp_path / "root") as mgr:  # the failed opening left no lock
        mgr.save(1, {"w": torch.ones(2)}).wait()


def test_an_empty_address_is_refused():
    with pytest.raises(ValueError, match="addr"):
        ckpt.MetricsOptions(port=9464, addr="")


def test_connections_past_the_bound_take_no_thread(monkeypatch):
    """Twenty idle connections (anyone who reaches the port can open them) make the server
    start at most ``MAX_CONNECTIONS`` handler threads; the rest are closed unread, and once
    the idle ones are cut the server answers a scrape again."""
    from ckpt._manager import metrics as m

    monkeypatch.setattr(m, "MAX_CONNECTIONS", 2, raising=False)
    monkeypatch.setattr(m, "REQUEST_S", 1.0, raising=False)
    port = free_port()
    metrics = m.CheckpointMetrics(port=port, addr="127.0.0.1")
    metrics.serve()
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
    try:
        time.sleep(0.5)  # the server accepts them all
        assert threading.active_count() - before <= 2
        for s in idle:  # each is cut: closed unread, or at the request's deadline
            assert s.recv(64) == b""
        assert scrape("127.0.0.1", port)["ckpt_saves_total"] == 0
    finally:
        for s in idle:
            s.close()
        metrics.close()


def test_a_trickled_request_is_cut_at_its_deadline(monkeypatch):
    """A connection that trickles its request line (a byte every 0.2 s) is cut once
    ``REQUEST_S`` has passed since its accept, before the request is whole: each byte in
    time does not keep it open."""
    from ckpt._manager import metrics as m

    monkeypatch.setattr(m, "REQUEST_S", 1.0, raising=False)
    port = free_port()
    metrics = m.CheckpointMetrics(port=port, addr="127.0.0.1")
    metrics.serve()
    line = b"GET /metrics?" + b"x" * 100 + b" HTTP/1.0\r\n\r\n"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            sent = 0
            try:
                for i in range(len(line)):
                    s.sendall(line[i:i + 1])
                    sent += 1
                    time.sleep(0.2)
                    s.setblocking(False)
                    try:
                        if s.recv(64) == b"":
                            break  # the server hung up
                    except BlockingIOError:
                        pass
                    finally:
                        s.setblocking(True)
            except OSError:
                pass
            assert sent < len(line)
        assert "ckpt_saves_total" in scrape("127.0.0.1", port)
    finally:
        metrics.close()


def test_textfile_never_written_through_a_planted_link(tmp_path):
    """Another user who can write in the textfile's directory plants a link where
    prometheus_client would put its temporary file (``<path>.<pid>.<thread id>``): the
    file it points to is left alone, the textfile is written whole, readable by
    node_exporter, and no temporary file is left behind."""
    from ckpt._manager.metrics import CheckpointMetrics

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    directory = tmp_path / "textfiles"
    directory.mkdir()
    path = directory / "ckpt.prom"
    planted = f"{path}.{os.getpid()}.{threading.current_thread().ident}"
    os.symlink(victim, planted)
    metrics = CheckpointMetrics(textfile=str(path))
    metrics.saved(step=3, blocking=0.1, write=0.2, written=10, reused=0)
    assert victim.read_text() == "precious\n"
    assert parse_metrics(path.read_text())["ckpt_saves_total"] == 1
    assert not path.is_symlink() and path.stat().st_mode & stat.S_IROTH
    assert sorted(p.name for p in directory.iterdir()) == sorted(["ckpt.prom",
                                                                 os.path.basename(planted)])
