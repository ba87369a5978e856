"""The manager's metrics HTTP server: it listens on the address given (all interfaces by
default, as Prometheus exporters do), stops at the manager's ``close()``, and a port that is
in use fails the opening with an error naming the port, leaving the root unlocked.

The attacker of this surface is whoever can reach a listening address: a server bound to
the loopback address is refused to a peer that comes through another interface; someone
who can reach it makes it spend at most ``MAX_CONNECTIONS`` threads, each for at most
``REQUEST_S`` seconds to receive the request and as long again to answer it (the answer's
time is its own, whatever the request's reads left). The textfile's attacker is another user who can write in its
directory: a link planted where the temporary file would go is never written through."""

from __future__ import annotations

import os
import socket
import stat
import time
import urllib.error

import pytest
import torch

import ckpt
from ckpt.errors import MetricsServerError
from tests.support.prom import (ask_at_the_deadline, free_port, listening, parse_metrics,
                                plant_link, scrape,
                                threads_for_idle_connections, trickle_until_cut)

pytest.importorskip("prometheus_client")


def other_address() -> str | None:
    """An IPv4 address of this host that is not loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))  # no packet is sent: this only picks a route
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_the_server_listens_on_the_address_given_and_only_there(tmp_path):
    port = free_port()
    with ckpt.CheckpointManager(tmp_path / "root", metrics=ckpt.MetricsOptions(
            port=port, addr="127.0.0.1")) as mgr:
        mgr.save(1, {"w": torch.ones(2)}).wait()
        assert listening(port) == {"127.0.0.1"}
        assert scrape(port)["ckpt_saves_total"] == 1
        outside = other_address()
        if outside is not None:  # a peer on the job's network finds nothing to talk to
            with pytest.raises(OSError):
                socket.create_connection((outside, port), timeout=5).close()


def test_by_default_the_server_listens_on_all_interfaces(tmp_path):
    port = free_port()
    with ckpt.CheckpointManager(tmp_path / "root", metrics=ckpt.MetricsOptions(port=port)):
        assert listening(port) == {"0.0.0.0"}


def test_close_stops_the_server(tmp_path):
    port = free_port()
    mgr = ckpt.CheckpointManager(tmp_path / "root", metrics=ckpt.MetricsOptions(
        port=port, addr="127.0.0.1"))
    assert "ckpt_saves_total" in scrape(port)
    mgr.close()
    assert listening(port) == set()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        scrape(port)
    # and the port is free for the next manager
    with ckpt.CheckpointManager(tmp_path / "root", metrics=ckpt.MetricsOptions(
            port=port, addr="127.0.0.1")):
        assert "ckpt_saves_total" in scrape(port)


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
    try:
        started, all_cut = threads_for_idle_connections(port)
        assert started <= 2
        assert all_cut  # each closed unread, or at its request's deadline
        assert scrape(port)["ckpt_saves_total"] == 0
    finally:
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
        assert trickle_until_cut(port, line) < len(line)
        assert "ckpt_saves_total" in scrape(port)
    finally:
        metrics.close()


class _Padded:
    """A collector whose page is ``size`` bytes: more than the sockets between the server
    and a client that is not reading yet can hold."""

    def __init__(self, size: int) -> None:
        self.size = size

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily("ckpt_pad", "x" * self.size, value=1)


def test_a_request_that_arrives_near_its_deadline_is_answered_whole(monkeypatch):
    """A request whose last byte arrives just before ``REQUEST_S`` (its last read left the
    socket a fraction of a second) is answered whole to a client that starts reading a
    second later: the answer has ``REQUEST_S`` of its own, not what the request left."""
    import prometheus_client as pc

    from ckpt._manager import metrics as m

    monkeypatch.setattr(m, "REQUEST_S", 3.0, raising=False)
    registry = pc.CollectorRegistry()
    registry.register(_Padded(16 << 20))
    server = m.serve_metrics(registry, 0, "127.0.0.1")
    try:
        head, body, length = ask_at_the_deadline(server.server_address[1],
                                                 b"GET /metrics HTTP/1.0\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 200")
        assert len(body) == length > 16 << 20
        assert parse_metrics(body.decode())["ckpt_pad"] == 1
    finally:
        server.shutdown()
        server.server_close()


def test_a_client_that_stops_reading_is_cut_at_the_answers_deadline(monkeypatch, capfd):
    """A client that asks, then reads nothing, holds its slot until ``REQUEST_S`` after the
    answer's first byte: then the answer is cut short, and the cut is a debug line, not a
    traceback on the job's stderr (anyone who reaches the port could fill it)."""
    import prometheus_client as pc

    from ckpt._manager import metrics as m

    monkeypatch.setattr(m, "REQUEST_S", 1.0, raising=False)
    registry = pc.CollectorRegistry()
    registry.register(_Padded(16 << 20))
    server = m.serve_metrics(registry, 0, "127.0.0.1")
    try:
        with socket.create_connection(("127.0.0.1", server.server_address[1]),
                                      timeout=10) as s:
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            time.sleep(2.5)
            received = 0
            while piece := s.recv(1 << 20):
                received += len(piece)
        assert received < 16 << 20  # cut short
        assert "Traceback" not in capfd.readouterr().err
    finally:
        server.shutdown()
        server.server_close()


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
    planted = plant_link(str(path), str(victim))
    metrics = CheckpointMetrics(textfile=str(path))
    metrics.saved(step=3, blocking=0.1, write=0.2, written=10, reused=0)
    assert victim.read_text() == "precious\n"
    assert parse_metrics(path.read_text())["ckpt_saves_total"] == 1
    assert not path.is_symlink() and path.stat().st_mode & stat.S_IROTH
    assert sorted(p.name for p in directory.iterdir()) == sorted(["ckpt.prom",
                                                                 os.path.basename(planted)])


def test_the_bounded_server_refuses_a_handler_without_the_deadlines():
    """The server's deadlines are kept by its handler's reads and writes: a plain
    BaseHTTPRequestHandler (no deadline: a trickled request would hold its thread for
    ever) is refused when the server is made, before it listens."""
    import logging
    from http.server import BaseHTTPRequestHandler

    from ckpt._shared.bounded_server import BoundedServer

    with pytest.raises(TypeError, match="DeadlineHandler"):
        BoundedServer(("127.0.0.1", 0), BaseHTTPRequestHandler, family=socket.AF_INET,
                      max_connections=1, request_s=1.0, name="test",
                      log=logging.getLogger("test"))
