"""The trainer's metrics exporter (``TrainerMetrics.export``) as its attackers see it: whoever
can reach its port, and another user who can write in its textfile's directory.

The server listens on the address given (all interfaces by default, as Prometheus
exporters do) and spends at most ``MAX_CONNECTIONS`` threads of the training process, each
for at most ``REQUEST_S`` seconds, however many connections arrive or however slowly they
send; the textfile is never written through a link planted beside it.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
import urllib.request

import pytest

from tests.support.prom import free_port, parse_metrics

pytest.importorskip("prometheus_client")


def _listening(port: int) -> set[str]:
    found = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return parse_metrics(answer.read().decode())


@pytest.fixture
def exporter(monkeypatch):
    """A trainer exporter on 127.0.0.1, with two handler slots and a 1 s request deadline."""
    from ckpt._manager import metrics as bounds
    from trainer.metrics import TrainerMetrics

    monkeypatch.setattr(bounds, "MAX_CONNECTIONS", 2, raising=False)
    monkeypatch.setattr(bounds, "REQUEST_S", 1.0, raising=False)
    port = free_port()
    metrics = TrainerMetrics(labels={"rank": "0"})
    metrics.export(port=port, addr="127.0.0.1")
    yield metrics, port
    metrics.close()


def test_the_exporter_listens_on_the_address_given(exporter):
    _, port = exporter
    assert _listening(port) == {"127.0.0.1"}
    assert "ckpt_train_steps_total{rank=\"0\"}" in _scrape(port)


def test_connections_past_the_bound_take_no_thread(exporter):
    """Twenty idle connections start at most two handler threads; every one is cut (closed
    unread, or at its deadline) and a scrape is answered again."""
    _, port = exporter
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
    try:
        time.sleep(0.5)  # the server accepts them all
        assert threading.active_count() - before <= 2
        for s in idle:
            assert s.recv(64) == b""
        assert _scrape(port)
    finally:
        for s in idle:
            s.close()


def test_a_trickled_request_is_cut_at_its_deadline(exporter):
    """A request line trickled a byte every 0.2 s is cut before it is whole."""
    _, port = exporter
    line = b"GET /metrics?" + b"x" * 100 + b" HTTP/1.0\r\n\r\n"
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            for i in range(len(line)):
                s.sendall(line[i:i + 1])
                sent += 1
                time.sleep(0.2)
                s.setblocking(False)
                try:
                    if s.recv(64) == b"":
                        break
                except BlockingIOError:
                    pass
                finally:
                    s.setblocking(True)
        except OSError:
            pass
    assert sent < len(line)
    assert _scrape(port)


def test_textfile_never_written_through_a_planted_link(tmp_path):
    """A link planted at prometheus_client's temporary name (``<path>.<pid>.<thread id>``)
    is not followed: its target is left alone, the textfile is whole and readable by
    node_exporter, no temporary file is left."""
    from trainer.metrics import TrainerMetrics

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    directory = tmp_path / "textfiles"
    directory.mkdir()
    path = directory / "train.prom"
    planted = f"{path}.{os.getpid()}.{threading.current_thread().ident}"
    os.symlink(victim, planted)
    metrics = TrainerMetrics(labels={"rank": "0"})
    metrics.export(textfile=str(path))
    metrics.write_textfile()
    assert victim.read_text() == "precious\n"
    assert 'ckpt_train_steps_total{rank="0"}' in parse_metrics(path.read_text())
    assert path.stat().st_mode & stat.S_IROTH
    assert sorted(p.name for p in directory.iterdir()) == sorted(["train.prom",
                                                                 os.path.basename(planted)])
