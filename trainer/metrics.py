"""Trainer metrics and structured log lines.

:class:`TrainerMetrics` keeps the training loop's numbers in memory, always
(``trainer.metrics.snapshot()``): step time, loss, gradient norm, learning rate, world size,
restarts, the heartbeat age of the slowest peer, the age of this rank's current section,
rollbacks, skipped batches, the ranks named as hung and the straggler scores. With
prometheus_client installed (the ``ckpt[metrics]`` extra) it also exports them, on an HTTP
port or to a node_exporter textfile, together with the checkpoint manager's ``ckpt_*``
metrics (one registry, one port, one file). Names carry the ``ckpt_train_`` prefix.

:func:`format_event` makes the one-line ``event key=value ...`` messages the trainer logs to
the ``ckpt.trainer`` logger. The metrics and events are listed in docs/observability.md.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from typing import Any

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

#: Counters: in-memory key -> help text (exported as ``ckpt_train_<key>``).
COUNTERS = {
    "steps_total": "Optimizer steps taken by this process (steps trained again after a "
                   "rollback count again)",
    "restarts_total": "Restarts of the worker group after failures (torchrun's "
                      "TORCHELASTIC_RESTART_COUNT: the job's count, not this process's)",
    "rollbacks_total": "Rollbacks to the newest good checkpoint after an unhealthy step",
    "skipped_batches_total": "Global batches passed over because they produced an unhealthy "
                             "step (each once, even when passed over again after a rollback)",
    "hangs_total": "Hung ranks this process named: a training thread that stopped making "
                   "progress while the others waited for it (see ckpt_train_hung_rank)",
    "straggler_flags_total": "Windows in which a rank was flagged as a straggler (overall "
                             "score at or above the threshold), one per rank and window",
    "stragglers_dropped_total": "Ranks dropped by the straggler policy",
}
#: Gauges: in-memory key -> help text.
GAUGES = {
    "step": "The last step finished",
    "loss": "Global mean loss of the last step",
    "grad_norm": "Total gradient norm of the last step (before clipping, after unscaling)",
    "learning_rate": "Learning rate of the last step (first parameter group)",
    "world_size": "Ranks in the process group",
    "attempt": "Run of the worker group (0 first; every restart or membership change adds 1)",
    "last_step_seconds": "Wall time of the last step",
    "heartbeat_age_seconds": "Seconds since the slowest watched peer's heartbeat last changed "
                             "(0 without peers)",
    "section_age_seconds": "Seconds this rank's training thread has been in its current "
                           "section (data, forward, backward, collective, ...; 0 without "
                           "progress markers)",
    "straggler_score_max": "The highest overall straggler score of the last window (see "
                           "ckpt_train_straggler_score; NaN before the first window)",
}
#: Straggler scores of the last window, one sample per rank of the attempt (and section):
#: name -> (help text, label names after the constant ones). Empty before the first window.
STRAGGLER_SERIES = {
    "straggler_score": ("Overall straggler score of each rank in the last window: its time "
                        "per step in its own work (data, forward, optimizer) over the "
                        "median of the ranks; 1 is typical, 2 twice as slow",
                        ("scored_rank",)),
    "straggler_section_score": ("Each rank's time per step in each section over the median "
                                "of the ranks, last window", ("scored_rank", "section")),
    "straggler_vs_best": ("Each rank's own-work time per step in the last window over its own "
                          "best window of this attempt", ("scored_rank",)),
}
#: Labelled series: name -> (help text, label names).
HANG_SERIES = ("hung_rank", "Ranks named as hung (the rank the others waited for) by this "
               "process, with the section it was stuck in; 1 once named")


# ------------------------------------------------------------------------------- log lines


def _format_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple, set, frozenset)):
        return ",".join(_format_value(v) for v in value) or "-"
    text = str(value)
    if not text or any(c.isspace() or c in '="' for c in text):
        return json.dumps(text)
    return text


def format_event(event: str, **fields: Any) -> str:
    """``event key=value ...`` on one line: floats with 6 significant digits, lists as
    comma-separated values (``-`` when empty), None as ``-``, strings with spaces quoted."""
    return " ".join([event, *(f"{k}={_format_value(v)}" for k, v in fields.items())])


def parse_event(message: str) -> tuple[str, dict[str, str]]:
    """The inverse of :func:`format_event`, values left as strings (for tests and tools)."""
    import shlex

    event, _, rest = message.partition(" ")
    fields = {}
    for token in shlex.split(rest):
        key, _, value = token.partition("=")
        fields[key] = value
    return event, fields


# ------------------------------------------------------------------------------- heartbeat age


def slowest_peer_age(heartbeat: Any) -> float:
    """Seconds since the slowest live peer's beat last changed, as ``heartbeat`` saw it.

    0.0 without a heartbeat or without peers. Uses ``heartbeat.peer_ages()`` when the
    Heartbeat has it, else reads the same bookkeeping directly.
    """
    if heartbeat is None:
        return 0.0
    ages = heartbeat.peer_ages()
    return max(ages.values(), default=0.0)


# ------------------------------------------------------------------------------- metrics


class TrainerMetrics:
    """The training loop's numbers, in memory, optionally exported through prometheus_client.

    Args:
        labels: constant labels on every exported series (e.g. ``{"rank": "0"}``).
    """

    def __init__(self, *, labels: dict[str, str] | None = None) -> None:
        self.labels = dict(labels or {})
        self._lock = threading.Lock()
        nan = float("nan")
        self.values: dict[str, float] = {
            "steps_total": 0, "restarts_total": 0, "rollbacks_total": 0,
            "skipped_batches_total": 0, "step": 0, "loss": nan, "grad_norm": nan,
            "learning_rate": nan, "world_size": 0, "attempt": 0, "last_step_seconds": nan,
            "hangs_total": 0, "straggler_flags_total": 0, "stragglers_dropped_total": 0,
            "straggler_score_max": nan,
        }
        self.hung: dict[tuple[int, str], int] = {}   # (culprit rank, section) -> named
        #: The last window's straggler scores: series name -> {label values: value}.
        self.stragglers: dict[str, dict[tuple[str, ...], float]] = {}
        self.heartbeat: Any = None   # a trainer.heartbeat.Heartbeat, read at snapshot time
        self._export: _Export | None = None

    # -- updates from the training loop --------------------------------------------------------
    def started(self, *, world_size: int, attempt: int, restarts: int) -> None:
        with self._lock:
            self.values.update(world_size=world_size, attempt=attempt, restarts_total=restarts)

    def step_done(self, *, step: int, seconds: float, loss: float, grad_norm: float,
                  learning_rate: float) -> None:
        with self._lock:
            self.values["steps_total"] += 1
            self.values.update(step=step, last_step_seconds=seconds, loss=loss,
                               grad_norm=grad_norm, learning_rate=learning_rate)
        if self._export is not None:
            self._export.step_seconds.observe(seconds)

    def rolled_back(self, to_step: int) -> None:
        with self._lock:
            self.values["rollbacks_total"] += 1
            self.values["step"] = to_step

    def hang_detected(self, *, culprit: int, section: str) -> None:
        """This process named rank ``culprit`` as hung in ``section``."""
        with self._lock:
            self.values["hangs_total"] += 1
            self.hung[(culprit, section)] = 1

    def stragglers_scored(self, overall: dict[int, float],
                          sections: dict[int, dict[str, float]], vs_best: dict[int, float], *,
                          flagged: int, dropped: bool) -> None:
        """A window was scored (:mod:`trainer.stragglers`): ``flagged`` ranks at or above
        the threshold, ``dropped`` whether one of them is being dropped."""
        series = {
            "straggler_score": {(str(r),): v for r, v in overall.items()},
            "straggler_section_score": {(str(r), s): v for r, row in sections.items()
                                        for s, v in row.items()},
            "straggler_vs_best": {(str(r),): v for r, v in vs_best.items()},
        }
        with self._lock:
            self.stragglers = series
            self.values["straggler_score_max"] = max(overall.values(), default=float("nan"))
            self.values["straggler_flags_total"] += flagged
            self.values["stragglers_dropped_total"] += int(dropped)

    def skipped(self, batches: int = 1) -> None:
        with self._lock:
            self.values["skipped_batches_total"] += batches

    # -- reading -------------------------------------------------------------------------------
    def heartbeat_age_seconds(self) -> float:
        return slowest_peer_age(self.heartbeat)

    def snapshot(self) -> dict[str, float]:
        """Every value now (the heartbeat age is computed at this moment)."""
        with self._lock:
            out = dict(self.values)
        out["heartbeat_age_seconds"] = self.heartbeat_age_seconds()
        sections = getattr(self.heartbeat, "sections", None)
        out["section_age_seconds"] = sections.age() if sections is not None else 0.0
        return out

    # -- export --------------------------------------------------------------------------------
    @property
    def exporting(self) -> bool:
        return self._export is not None

    def export(self, *, port: int | None = None, textfile: str | None = None,
               addr: str = "0.0.0.0") -> None:
        """Export through prometheus_client: serve ``/metrics`` on ``addr:port`` (all
        interfaces by default, as Prometheus exporters do) and/or write ``textfile``
        whenever :meth:`write_textfile` is called. Once per object. The server and the
        textfile are the checkpoint manager's (``ckpt.tools.serve_metrics``,
        ``write_textfile``): a bounded number of handler threads, each for a bounded time,
        and a textfile never written through a link planted beside it."""
        if self._export is not None or (port is None and not textfile):
            return
        self._export = _Export(self, textfile)
        if port is not None:
            self._export.serve(port, addr)

    def attach_checkpoint(self, checkpoint_metrics: Any) -> None:
        """Export a checkpoint manager's ``metrics`` with these: the ``ckpt_*`` series then
        come from the same port and textfile."""
        if self._export is not None and checkpoint_metrics is not None:
            self._export.attach_checkpoint(checkpoint_metrics)

    def write_textfile(self) -> None:
        """Write the textfile now (atomically: a temporary file, then a rename)."""
        if self._export is not None and self._export.textfile:
            self._export.write_textfile()

    def close(self) -> None:
        """Stop the HTTP server, if any (the in-memory values stay)."""
        if self._export is not None:
            self._export.close()


class _Export:
    """The prometheus_client side: one private registry for the trainer's and the
    checkpoint manager's series."""

    def __init__(self, metrics: TrainerMetrics, textfile: str | None) -> None:
        try:
            import prometheus_client as pc
        except ImportError as e:
            raise ImportError("metrics_port/metrics_textfile need prometheus_client: "
                              "pip install 'ckpt[metrics]'") from e
        self.pc = pc
        self.textfile = textfile
        self.registry = pc.CollectorRegistry()
        labels = metrics.labels
        hist = pc.Histogram("ckpt_train_step_seconds", "Wall time of one training step",
                            list(labels), registry=self.registry, buckets=STEP_BUCKETS)
        self.step_seconds = hist.labels(**labels) if labels else hist
        self.registry.register(_TrainCollector(metrics))
        self.checkpoint = _Forward()
        self.registry.register(self.checkpoint)
        self._server: Any = None

    def serve(self, port: int, addr: str) -> None:
        from ckpt.tools import serve_metrics

        self._server = serve_metrics(self.registry, port, addr)

    def attach_checkpoint(self, cm: Any) -> None:
        """Forward the checkpoint manager's series (ckpt_save_*, ckpt_saves_total, ...)."""
        self.checkpoint.source = cm.prometheus_registry()

    def write_textfile(self) -> None:
        from ckpt.tools import write_textfile

        assert self.textfile
        write_textfile(self.textfile, self.registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Forward:
    """Yields another registry's series at collect time (the current checkpoint manager's)."""

    def __init__(self) -> None:
        self.source: Any = None

    def collect(self) -> Iterable[Any]:
        if self.source is not None:
            yield from self.source.collect()


class _TrainCollector:
    """Reads the in-memory values at scrape time (so the heartbeat age is current even when
    the training loop is stuck)."""

    def __init__(self, metrics: TrainerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self.metrics.snapshot()
        names = list(self.metrics.labels)
        values = [self.metrics.labels[n] for n in names]
        for key, doc in COUNTERS.items():
            family = CounterMetricFamily(f"ckpt_train_{key.removesuffix('_total')}", doc,
                                         labels=names)
            family.add_metric(values, snap[key])
            yield family
        for key, doc in GAUGES.items():
            family = GaugeMetricFamily(f"ckpt_train_{key}", doc, labels=names)
            family.add_metric(values, snap[key])
            yield family
        with self.metrics._lock:
            hung = dict(self.metrics.hung)
        name, doc = HANG_SERIES
        family = GaugeMetricFamily(f"ckpt_train_{name}", doc,
                                   labels=[*names, "culprit_rank", "section"])
        for (culprit, section), value in sorted(hung.items()):
            family.add_metric([*values, str(culprit), section], value)
        yield family
        with self.metrics._lock:
            stragglers = dict(self.metrics.stragglers)
        for name, (doc, extra) in STRAGGLER_SERIES.items():
            family = GaugeMetricFamily(f"ckpt_train_{name}", doc, labels=[*names, *extra])
            for labels, value in sorted(stragglers.get(name, {}).items()):
                family.add_metric([*values, *labels], value)
            yield family


def metric_names() -> list[str]:
    """Every series name the trainer exports itself (histogram parts included; not the
    labelled ``ckpt_train_hung_rank`` and :data:`STRAGGLER_SERIES`, which have samples only
    once a hang was named or a window scored)."""
    names = [f"ckpt_train_{k}" for k in COUNTERS] + [f"ckpt_train_{k}" for k in GAUGES]
    names += [f"ckpt_train_step_seconds_{s}" for s in ("bucket", "sum", "count")]
    return sorted(names)


__all__ = ["COUNTERS", "GAUGES", "HANG_SERIES", "STRAGGLER_SERIES", "TrainerMetrics",
           "format_event", "metric_names", "parse_event", "slowest_peer_age"]
