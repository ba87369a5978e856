"""Checkpoint metrics: always kept in memory (``mgr.metrics.snapshot()``), and exported
through prometheus_client when it is installed (the ``ckpt[metrics]`` extra) — on an HTTP port
or to a node_exporter textfile. Names follow Prometheus conventions with a ``ckpt_`` prefix.

The HTTP server is a surface of its own: whoever reaches its address and port can read the
counters (no weights, no paths) and make it render them, nothing else; it serves until
:meth:`CheckpointMetrics.close` (the manager's ``close()``). It is prometheus_client's WSGI
application on :class:`ckpt._shared.bounded_server.BoundedServer`, which bounds what a
client costs the training process: ``MAX_CONNECTIONS`` handler threads at most (more
connections are closed unread); a request whole within ``REQUEST_S`` seconds of the accept,
however slowly it trickles, and its answer taken within ``REQUEST_S`` of its first byte. The
textfile is written to a fresh temporary name that no one can plant a link at, then renamed.
docs/observability.md has the threat model. The trainer's exporter uses the same two
functions (:func:`serve_metrics`, :func:`write_textfile`).
"""

from __future__ import annotations

import errno
import io
import logging
import os
import socket
import threading
import time
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from storage_backends.files import atomic_write

from ckpt._shared.bounded_server import BoundedServer, DeadlineHandler
from ckpt.errors import MetricsServerError

log = logging.getLogger("ckpt")

#: Connections the metrics server handles at once: more are closed unread (a scraper needs
#: one; a flood of connections costs no thread).
MAX_CONNECTIONS = 8
#: Seconds a connection has, from its accept, to send its request; and again, from the
#: answer's first byte, to take the answer.
REQUEST_S = 10.0

_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class CheckpointMetrics:
    """Counters and timings of one manager's saves and restores.

    Args:
        port: serve ``/metrics`` on this port (prometheus_client required) from
            :meth:`serve` until :meth:`close`.
        addr: the address the server listens on (all interfaces by default, as
            prometheus_client's exporters).
        textfile: write the metrics to this file after every commit (atomically), for
            node_exporter's textfile collector (prometheus_client required).
        labels: constant labels on every series (e.g. ``{"job": "llm", "rank": "0"}``).
    """

    def __init__(self, *, port: int | None = None, addr: str = "0.0.0.0",
                 textfile: str | None = None, labels: dict[str, str] | None = None) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, float] = {
            "saves_total": 0, "save_failures_total": 0, "bytes_written_total": 0,
            "bytes_reused_total": 0, "backpressure_waits_total": 0, "restores_total": 0,
            "restore_skipped_steps_total": 0, "last_commit_timestamp_seconds": 0,
            "last_save_blocking_seconds": 0, "last_save_write_seconds": 0,
            "last_committed_step": -1, "replications_total": 0,
            "replication_failures_total": 0, "replications_superseded_total": 0,
            "memory_saves_total": 0, "last_memory_step": -1,
        }
        self.textfile = textfile
        self._labels = labels or {}
        self._prom = _Prometheus(self._labels, self) if (port or textfile) else None
        self.port, self.addr = port, addr
        self._server: Any = None

    def serve(self) -> None:
        """Start serving ``/metrics`` on ``addr:port`` (once; nothing without a port).

        Raises:
            MetricsServerError: the port is in use, or the address is not this host's.
        """
        if self.port is None or self._server is not None or self._prom is None:
            return
        try:
            self._server = self._prom.serve(self.port, self.addr)
        except OSError as e:
            why = (f"port {self.port} is in use (another manager, trainer or exporter on "
                   "this host?)" if e.errno == errno.EADDRINUSE else str(e))
            raise MetricsServerError(
                f"cannot serve metrics on {self.addr}:{self.port}: {why}; choose another "
                "MetricsOptions(port=...), or export to a textfile instead") from e

    def close(self) -> None:
        """Stop the HTTP server, if one runs; idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def prometheus_registry(self) -> Any:
        """The prometheus_client registry holding these series, created on first use without
        a server or textfile: for a caller that exports it beside its own series."""
        if self._prom is None:
            self._prom = _Prometheus(self._labels, self)
        return self._prom.registry

    def _add(self, **values: float) -> None:
        with self._lock:
            for k, v in values.items():
                self.values[k] += v

    def _set(self, **values: float) -> None:
        with self._lock:
            self.values.update(values)

    def saved(self, *, step: int, blocking: float, write: float, written: int,
              reused: int) -> None:
        self._add(saves_total=1, bytes_written_total=written, bytes_reused_total=reused)
        self._set(last_commit_timestamp_seconds=time.time(), last_save_blocking_seconds=blocking,
                  last_save_write_seconds=write, last_committed_step=step)
        if self._prom is not None:
            self._prom.observe(blocking, write)
            if self.textfile:
                self._prom.write_textfile(self.textfile)

    def saved_to_memory(self, *, step: int, blocking: float) -> None:
        """A save published into the memory tier alone (no commit to the root: the commit
        series stay as they are; the blocking time is a save's like any other)."""
        self._add(memory_saves_total=1)
        self._set(last_save_blocking_seconds=blocking, last_memory_step=step)
        if self._prom is not None:
            self._prom.blocking.observe(blocking)
            if self.textfile:
                self._prom.write_textfile(self.textfile)

    def failed(self) -> None:
        self._add(save_failures_total=1)

    def backpressure(self) -> None:
        self._add(backpressure_waits_total=1)

    def replication(self, what: str) -> None:
        """A memory-tier replica sent ("replicated"), failed either way ("failed"), or a
        queued step replaced by a newer one before it was sent ("superseded")."""
        self._add(**{{"replicated": "replications_total", "failed": "replication_failures_total",
                      "superseded": "replications_superseded_total"}[what]: 1})

    def restored(self, skipped: int) -> None:
        self._add(restores_total=1, restore_skipped_steps_total=skipped)

    def age_seconds(self) -> float:
        """Seconds since the newest commit (infinity before the first)."""
        last = self.values["last_commit_timestamp_seconds"]
        return time.time() - last if last else float("inf")

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out = dict(self.values)
        out["newest_commit_age_seconds"] = self.age_seconds()
        return out


class _Prometheus:
    """The prometheus_client side: a private registry, so two managers never collide."""

    def __init__(self, labels: dict[str, str], metrics: CheckpointMetrics) -> None:
        try:
            import prometheus_client as pc
        except ImportError as e:
            raise ImportError("metrics_port/metrics_textfile need prometheus_client: "
                              "pip install 'ckpt[metrics]'") from e
        self.pc = pc
        self.registry = pc.CollectorRegistry()
        names = list(labels)
        values = [labels[n] for n in names]
        self.blocking = self._histogram("ckpt_save_blocking_seconds",
                                        "Time save() blocked the training loop", labels)
        self.write = self._histogram("ckpt_save_write_seconds",
                                     "Background write+commit time of a save", labels)
        self.registry.register(_Collector(metrics, names, values))
        # Saves to memory alone record on the training thread, commits on the writer's:
        # a file rendered earlier must not be renamed over one rendered later.
        self._textfile_lock = threading.Lock()

    def _histogram(self, name: str, doc: str, labels: dict[str, str]) -> Any:
        h = self.pc.Histogram(name, doc, list(labels), registry=self.registry, buckets=_BUCKETS)
        return h.labels(**labels) if labels else h

    def observe(self, blocking: float, write: float) -> None:
        self.blocking.observe(blocking)
        self.write.observe(write)

    def serve(self, port: int, addr: str) -> Any:
        """Start the server on a daemon thread; returns it (``shutdown()`` stops it)."""
        return serve_metrics(self.registry, port, addr)

    def write_textfile(self, path: str) -> None:
        with self._textfile_lock:
            write_textfile(path, self.registry)


class _Collector:
    """Reads the in-memory values at scrape time (so ages are current)."""

    COUNTERS = {
        "saves_total": "Committed saves",
        "save_failures_total": "Saves that failed (nothing committed)",
        "bytes_written_total": "Bytes written by saves (new data)",
        "bytes_reused_total": "Bytes referenced from earlier steps instead of written",
        "backpressure_waits_total": "Saves that waited for the previous one",
        "restores_total": "Successful restores",
        "restore_skipped_steps_total": "Steps skipped by restore as corrupt",
        "replications_total": "Memory-tier steps replicated to a peer node",
        "replication_failures_total": "Memory-tier replications that failed (sent or received)",
        "replications_superseded_total": "Queued replications replaced by a newer step",
        "memory_saves_total": "Saves published into the memory tier alone (not to the root)",
    }
    GAUGES = {
        "last_commit_timestamp_seconds": "Unix time of the newest commit",
        "newest_commit_age_seconds": "Seconds since the newest commit",
        "last_committed_step": "Step of the newest commit",
        "last_memory_step": "Step of the newest save into the memory tier alone",
    }

    def __init__(self, metrics: CheckpointMetrics, names: list[str], values: list[str]) -> None:
        self.metrics, self.names, self.values = metrics, names, values

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self.metrics.snapshot()
        for key, doc in self.COUNTERS.items():
            family = CounterMetricFamily(f"ckpt_{key.removesuffix('_total')}", doc,
                                         labels=self.names)
            family.add_metric(self.values, snap[key])
            yield family
        for key, doc in self.GAUGES.items():
            family = GaugeMetricFamily(f"ckpt_{key}", doc, labels=self.names)
            value = snap[key]
            family.add_metric(self.values, value if value != float("inf") else float("nan"))
            yield family


class _DebugLines(io.TextIOBase):
    """wsgiref's error stream (a traceback for each answer cut at its deadline) as debug
    lines: anyone who reaches the port could otherwise fill the job's stderr."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if text.strip():
            log.debug("metrics server: %s", text.rstrip())
        return len(text)


class _Handler(DeadlineHandler, WSGIRequestHandler):
    def log_message(self, fmt: str, *args: Any) -> None:  # no line per scrape
        pass

    def get_stderr(self) -> Any:
        return _DebugLines()


class _MetricsServer(BoundedServer, WSGIServer):
    """prometheus_client's WSGI application on the bounded server."""


def serve_metrics(registry: Any, port: int, addr: str) -> Any:
    """Serve ``registry`` on ``addr:port`` (prometheus_client's ``/metrics`` application) from
    a daemon thread, within the bounds above; returns the server (``shutdown()`` and
    ``server_close()`` stop it). OSError when the port cannot be had."""
    from prometheus_client import make_wsgi_app

    family, _, _, _, address = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]
    server = _MetricsServer(address[:2], _Handler, family=family,
                            max_connections=MAX_CONNECTIONS, request_s=REQUEST_S,
                            name="ckpt-metrics-server", log=log)
    server.set_app(make_wsgi_app(registry))
    threading.Thread(target=server.serve_forever, name="ckpt-metrics-server",
                     daemon=True).start()
    return server


def write_textfile(path: str, registry: Any) -> None:
    """Write ``registry`` to ``path`` atomically: a new file of a random name beside it
    (created exclusively, so a link planted in the directory is never followed), mode 0644
    for node_exporter, then renamed over ``path``."""
    from prometheus_client import generate_latest

    atomic_write(path, generate_latest(registry), 0o644)


def default_labels() -> dict[str, str]:
    """rank label from torchrun's environment, when present."""
    rank = os.environ.get("RANK")
    return {"rank": rank} if rank is not None else {}
