"""The trainer's metrics exporter (``TrainerMetrics.export``) as its attackers see it: whoever
can reach its port, and another user who can write in its textfile's directory.

The exporter serves through the manager's bounded server (tests/manager/test_metrics_server.py
holds the server's own contract): it listens on the address given, spends at most
``MAX_CONNECTIONS`` threads of the training process however many idle or trickling
connections arrive, and its textfile is never written through a link planted beside it.
"""

from __future__ import annotations

import os
import stat

import pytest

from tests.support.prom import (free_port, listening, parse_metrics, plant_link, scrape,
                                threads_for_idle_connections, trickle_until_cut)

pytest.importorskip("prometheus_client")


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
    assert listening(port) == {"127.0.0.1"}
    assert "ckpt_train_steps_total{rank=\"0\"}" in scrape(port)


def test_idle_and_trickling_connections_take_at_most_the_bound(exporter):
    """Twenty idle connections start at most two handler threads and every one is cut; a
    request line trickled a byte every 0.2 s is cut before it is whole; a scrape is
    answered again afterwards."""
    _, port = exporter
    started, all_cut = threads_for_idle_connections(port)
    assert started <= 2 and all_cut
    line = b"GET /metrics?" + b"x" * 100 + b" HTTP/1.0\r\n\r\n"
    assert trickle_until_cut(port, line) < len(line)
    assert scrape(port)


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
    planted = plant_link(str(path), str(victim))
    metrics = TrainerMetrics(labels={"rank": "0"})
    metrics.export(textfile=str(path))
    metrics.write_textfile()
    assert victim.read_text() == "precious\n"
    assert 'ckpt_train_steps_total{rank="0"}' in parse_metrics(path.read_text())
    assert path.stat().st_mode & stat.S_IROTH
    assert sorted(p.name for p in directory.iterdir()) == sorted(["train.prom",
                                                                 os.path.basename(planted)])
