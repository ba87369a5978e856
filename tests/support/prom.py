"""Helpers for tests that scrape Prometheus metrics: a free port and the text format."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
    """``ckpt_*`` samples of the Prometheus text format: series (with labels) -> value."""
    out = {}
    for line in text.splitlines():
        if line.startswith("ckpt_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
