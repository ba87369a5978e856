"""A progress line on a terminal for the saves and restores a user waits for.

Drawn on stderr only when stderr is a terminal (never into logs, files or pipes), only once
the wait has lasted ``delay`` seconds (a quick save prints nothing), and erased when the wait
ends. ``CKPT_PROGRESS=0`` turns it off; ``CKPT_PROGRESS_DELAY`` sets the delay (seconds,
default 1; 0 draws at once). A daemon thread redraws it a few times a second while the
caller blocks; the work's threads only add to a counter.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, TextIO

ENV = "CKPT_PROGRESS"
DELAY_ENV = "CKPT_PROGRESS_DELAY"
DELAY_S = 1.0     # nothing is drawn for a wait shorter than this, by default
INTERVAL_S = 0.25


class ByteCounter:
    """Bytes done by the threads of one save (thread safe)."""

    def __init__(self, total: int = 0) -> None:
        self.total, self.done = total, 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n


def enabled(stream: TextIO | None = None) -> bool:
    """Whether a progress line may be drawn on ``stream`` (default stderr)."""
    stream = sys.stderr if stream is None else stream
    if os.environ.get(ENV, "") in ("0", "false", "no", "off"):
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or replaced by an object without isatty
        return False


class TerminalProgress:
    """``with TerminalProgress("ckpt: saving step 40", counter):`` draws the counter's
    bytes (and percentage, when its total is known) and the seconds elapsed while the
    body blocks. Without a counter, only the seconds."""

    def __init__(self, label: str, counter: ByteCounter | None = None, *,
                 stream: TextIO | None = None, delay: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.counter, self.clock = label, counter, clock
        self.delay = _delay() if delay is None else delay
        self.stream = sys.stderr if stream is None else stream
        self.drawn = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = 0.0

    def __enter__(self) -> TerminalProgress:
        if enabled(self.stream):
            self._start = self.clock()
            if self.delay <= 0:
                self._draw()
            self._thread = threading.Thread(target=self._run, name="ckpt-progress",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        if self.drawn:
            self._write("\r\x1b[2K")  # erase the line: the log line that follows says the rest

    def _run(self) -> None:
        if self._stop.wait(max(self.delay, 0.0) or INTERVAL_S):
            return
        while not self._stop.is_set():
            self._draw()
            self._stop.wait(INTERVAL_S)

    def _draw(self) -> None:
        self._write("\r\x1b[2K" + self.line())
        self.drawn = True

    def line(self) -> str:
        """The text drawn now."""
        elapsed = self.clock() - self._start
        c = self.counter
        if c is None:
            return f"{self.label} ... {elapsed:.0f}s"
        if c.total > 0:
            frac = min(1.0, c.done / c.total)
            bar = "#" * int(frac * 24)
            return (f"{self.label} [{bar:<24}] {frac:6.1%} {_size(c.done)} of "
                    f"{_size(c.total)}, {elapsed:.0f}s")
        return f"{self.label} {_size(c.done)}, {elapsed:.0f}s"

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # the terminal went away: stop drawing
            self._stop.set()


def _delay() -> float:
    try:
        return float(os.environ.get(DELAY_ENV, DELAY_S))
    except ValueError:
        return DELAY_S


def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"
