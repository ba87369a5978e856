"""Progress markers: where a rank's training thread is, since when, and how long each part of
a step usually takes.

The training loop calls :meth:`Sections.enter` at each boundary of a step; the heartbeat's
beat thread reads :meth:`Sections.payload` once per beat and publishes it under the rank's
key, so every rank sees where its peers are. A marker is a clock read, a few assignments and
an uncontended lock: well under a microsecond, far below 1% of a 100 ms step
(``benchmarks/bench_hang.py`` measures it).

Sections of the trainer (in the order of a step)::

    data              one micro batch fetched (dataset or DataLoader)
    forward           its forward (the user's step_fn; FSDP gathers parameters inside it)
    backward          its backward (DDP's or FSDP's gradient collectives run inside the
                      last one's), then the gradient norm and clipping
    collective        the step's agreement all-reduce (loss, grad norm, SIGTERM)
    optimizer         optimizer and scheduler step
    save_wait         a due save waits for the previous async save to be written (never a
                      rank's hang: its limit is the save's deadline, and when every rank
                      waits there it is the storage that is slow, see trainer.hangs)
    save              a checkpoint taken (only steps whose save was due are timed)
    restore           a restore or a health rollback (never judged: it happens once)
    user              the user's hooks and anything wrapped in :meth:`Sections.user`
                      (never judged: evaluation may take minutes)
    finish            the end of the attempt: the last save's wait, the summary (never
                      judged)
    idle              before the first marker

``mark`` counts the trainer's own sections entered in this attempt. Every rank passes the
same sections in the same order (the same number of micro batches per step), so marks are
comparable across ranks: when a job is stuck, the rank with the lowest mark is the one that
holds the others up. ``collectives`` counts the agreement all-reduces entered (collective
N is the one a rank is in, or last passed).

Heartbeat payload
-----------------
Each beat (see :mod:`trainer.heartbeat`) is a JSON object; :meth:`Sections.payload` adds
the keys after ``state``::

    {"step": 57, "seq": 311, "time": 1764645600.2, "state": "alive",
     "section": "data",          # where the training thread is now
     "age": 0.412,               # seconds in it at the time of the beat (monotonic clock)
     "mark": 1203,               # trainer sections entered this attempt
     "collectives": 57,          # agreement all-reduces entered this attempt
     "limit": 1.5,               # the hang limit of this section now (null: not judged)
     "stats": {                  # per section, over this process's run so far
        "data": {"count": 171, "typical": 0.0021, "best": 0.0011, "last": 0.0024,
                 "worst": 0.31},
        ...,
        "step": {...}},          # whole steps, start to start
     "stack": "..."}             # only when the section is over its limit: the training
                                 # thread's Python stack

``typical`` is the median of the last :data:`WINDOW` durations (robust to the odd slow
one), ``best`` and ``worst`` the extremes since the process started, ``last`` the latest;
all in seconds, rounded to 0.1 ms. A section not yet finished once is absent from
``stats``. Peers' payloads are read with :meth:`trainer.heartbeat.Heartbeat.peer_payloads`.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

#: Sections the trainer marks itself, in the order of a step.
TRAINER_SECTIONS = ("data", "forward", "backward", "collective", "optimizer", "save_wait",
                    "save")
#: The wait for the previous async save (entered on every due save, on every rank alike).
SAVE_WAIT = "save_wait"
#: Sections whose stillness is never called a hang (see the module docstring).
UNJUDGED = frozenset({"idle", "restore", "user", "finish"})
#: Durations the typical one is the median of.
WINDOW = 32
#: The longest section name a beat may carry (peers drop beats with longer ones).
NAME_CHARS = 64


class SectionStats:
    """Durations of one section: count, typical (median of the last :data:`WINDOW`), best,
    worst and last. Updated by the training thread, read by the beat thread (under the
    owner's lock)."""

    __slots__ = ("count", "total", "best", "worst", "last", "_window")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0  # seconds, all durations summed (straggler windows take differences)
        self.best = float("inf")
        self.worst = 0.0
        self.last = 0.0
        self._window: collections.deque[float] = collections.deque(maxlen=WINDOW)

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        self.last = seconds
        if seconds < self.best:
            self.best = seconds
        if seconds > self.worst:
            self.worst = seconds
        self._window.append(seconds)

    @property
    def typical(self) -> float:
        """The median of the recent durations (0.0 before the first)."""
        w = sorted(self._window)
        if not w:
            return 0.0
        mid = len(w) // 2
        return w[mid] if len(w) % 2 else (w[mid - 1] + w[mid]) / 2

    def to_dict(self) -> dict[str, float]:
        return {"count": self.count, "typical": round(self.typical, 4),
                "best": round(self.best, 4), "last": round(self.last, 4),
                "worst": round(self.worst, 4)}


class Position(NamedTuple):
    """Where the training thread is: a section, entered at ``since`` (monotonic)."""

    section: str
    since: float
    mark: int
    collectives: int
    step: int | None


class Sections:
    """The progress markers of one rank's training thread.

    Args:
        clock: a monotonic clock (tests may pass their own).
    """

    def __init__(self, *, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        now = clock()
        # One tuple, replaced whole: a reader on another thread sees a consistent position.
        self._pos = Position("idle", now, 0, 0, None)
        self._count_it = False           # whether the current section's duration is recorded
        self._step_start: float | None = None
        self._stats: dict[str, SectionStats] = {}
        self.thread_id = threading.get_ident()  # the training thread (for its stack)

    # -- the training thread -------------------------------------------------------------------
    def begin_attempt(self) -> None:
        """A new attempt (a new process group): marks and collectives count from 0 again,
        as on the peers; the statistics stay (the same job, the same machine)."""
        with self._lock:
            self._pos = Position("idle", self._clock(), 0, 0, None)
            self._count_it = False
            self._step_start = None
            self.thread_id = threading.get_ident()

    def enter(self, name: str) -> None:
        """The training thread enters the trainer's section ``name`` now (the previous
        one ends and its duration is recorded)."""
        now = self._clock()
        section, since, mark, collectives, step = self._pos
        with self._lock:
            if self._count_it:
                self._stats_of(section).add(now - since)
            self._count_it = name not in UNJUDGED
            self._pos = Position(name, now, mark + 1,
                                 collectives + (name == "collective"), step)

    def step(self, step: int) -> None:
        """Step ``step`` starts now: the previous step's duration is recorded."""
        now = self._clock()
        with self._lock:
            if self._step_start is not None:
                self._stats_of("step").add(now - self._step_start)
            self._step_start = now
            self._pos = self._pos._replace(step=step)

    def discard(self) -> None:
        """The current section's duration is not recorded (e.g. a save that was not due:
        only real saves say how long a save takes)."""
        self._count_it = False

    def restart(self) -> None:
        """The position jumped (a restore or rollback): the next step's duration is not a
        step's."""
        with self._lock:
            self._step_start = None

    @contextlib.contextmanager
    def user(self, name: str = "user") -> Iterator[None]:
        """Code of the user's that may take long (evaluation, a wait): never judged a hang,
        not counted in ``mark``; the previous section resumes afterwards (its clock
        restarted). ``name`` must not be one of the trainer's sections."""
        if name in TRAINER_SECTIONS:
            raise ValueError(f"{name!r} is one of the trainer's own sections")
        if not isinstance(name, str) or not 0 < len(name) <= NAME_CHARS:
            raise ValueError(f"a section name is a string of 1 to {NAME_CHARS} characters "
                             f"(the heartbeat publishes it), not {name!r:.80}")
        before = self._pos
        now = self._clock()
        with self._lock:
            self._close(before, now)
            self._count_it = False
            self._pos = before._replace(section=name, since=now)
        try:
            yield
        finally:
            with self._lock:
                self._count_it = False  # the resumed section's time is cut in two
                self._pos = self._pos._replace(section=before.section, since=self._clock())

    def _close(self, pos: Position, now: float) -> None:
        if self._count_it:
            self._stats_of(pos.section).add(now - pos.since)

    def _stats_of(self, name: str) -> SectionStats:
        stats = self._stats.get(name)
        if stats is None:
            stats = self._stats[name] = SectionStats()
        return stats

    # -- any thread ------------------------------------------------------------------------------
    def position(self) -> Position:
        """Where the training thread is now."""
        return self._pos

    def age(self, now: float | None = None) -> float:
        """Seconds the training thread has been in its current section."""
        return (self._clock() if now is None else now) - self._pos.since

    def stats(self) -> dict[str, SectionStats]:
        """A copy of each section's statistics (and ``"step"``: whole steps)."""
        with self._lock:
            out = {}
            for name, s in self._stats.items():
                c = out[name] = SectionStats()
                c.count, c.total, c.best, c.worst, c.last = (s.count, s.total, s.best, s.worst,
                                                             s.last)
                c._window.extend(s._window)
            return out

    def payload(self) -> dict[str, Any]:
        """What a beat carries about this rank's progress (the module docstring's keys but
        ``limit`` and ``stack``, which the heartbeat adds)."""
        pos = self._pos
        return {"section": pos.section, "age": round(self._clock() - pos.since, 4),
                "mark": pos.mark, "collectives": pos.collectives,
                "stats": {k: v.to_dict() for k, v in self.stats().items()}}


__all__ = ["NAME_CHARS", "Position", "SAVE_WAIT", "SectionStats", "Sections",
           "TRAINER_SECTIONS", "UNJUDGED", "WINDOW"]
