"""The save decision: which ``save(step, ...)`` calls write, which of them also go to the root
when a memory tier holds every save, and what SIGTERM does."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from typing import Any, Callable, Iterator

from ckpt._shared.distributed import Group
from ckpt._shared.signals import exit_now
from ckpt.options import Schedule

log = logging.getLogger("ckpt")

_exiting = threading.Event()  # set once the main program is over (see _note_exit)


def _note_exit() -> None:
    _exiting.set()


# Runs when the main thread is done, before the threads are joined and before every atexit
# callback (concurrent.futures uses the same hook): a SIGTERM after it must not raise
# SystemExit, which Python would print as "Exception ignored in atexit callback".
try:
    threading._register_atexit(_note_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # another Python; or imported during shutdown
    import atexit

    atexit.register(_note_exit)


class SaveSchedule:
    """A manager's save decisions (``every_steps``, ``every_seconds``, the memory tier's
    persist cadence, preemption).

    ``clock`` (rank 0's decides ``every_seconds``) and ``last_save_time`` are plain attributes,
    so a test can drive time without sleeping.
    """

    def __init__(self, schedule: Schedule, group: Group, persist_every: int = 1) -> None:
        self.every_steps = schedule.every_steps if (
            schedule.every_steps or schedule.every_seconds) else 1
        self.every_seconds = schedule.every_seconds
        self.save_on_preemption = schedule.save_on_preemption
        self.persist_every = persist_every
        self.group = group
        self.clock: Callable[[], float] = time.monotonic
        self.last_save_time = self.clock()
        self.preempted_by: int | None = None  # the signal number, once SIGTERM arrived
        self._previous_handler: Any = None
        self._on_exit: Callable[[], None] | None = None
        self._deferring = False  # the main thread is in a save: an exit waits for its end
        self._deferred: int | None = None  # the signal whose exit waits

    def due(self, step: int, force: bool) -> bool:
        """Whether ``save(step)`` writes (collective with ``every_seconds``: every rank calls
        it, rank 0's clock decides). A due save restarts the clock."""
        due = force or self.step_due(step)
        if not due and self.every_seconds is not None:
            due = bool(self.group.broadcast(
                self.clock() - self.last_save_time >= self.every_seconds))
        due = due or self.preempted_save
        if due and self.group.is_coordinator:
            self.last_save_time = self.clock()
        return due

    def step_due(self, step: int) -> bool:
        """Whether ``every_steps`` makes ``step`` due: the same answer on every rank, with no
        collective and no side effect."""
        return bool(self.every_steps and step % self.every_steps == 0)

    @property
    def preempted_save(self) -> bool:
        """Whether the next save call saves whatever the schedule says, then exits."""
        return self.preempted_by is not None and self.save_on_preemption

    def persist_due(self, step: int, persist: bool | None) -> bool:
        """Whether a save published to memory also goes to the root: ``persist``, else the
        schedule, by step number (not a count of this process's saves), so that restarted
        processes and every rank agree on it."""
        if persist is not None:
            return persist
        return step % (self.persist_every * (self.every_steps or 1)) == 0

    def install_sigterm(self, on_exit: Callable[[], None]) -> None:
        """Handle SIGTERM (from the main thread only, as Python requires): remember it, and
        without ``save_on_preemption`` call ``on_exit`` and exit with 128 + the signal.
        Once the main program is over (the interpreter is exiting: threads joined, atexit
        callbacks), SIGTERM calls ``on_exit`` and lets the exit go on (raising there would
        only print "Exception ignored")."""
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            self.preempted_by = signum
            log.warning("ckpt.sigterm received; save_on_preemption=%s",
                        self.save_on_preemption)
            if _exiting.is_set():
                on_exit()  # finishes the save in flight; the process is exiting already
                return
            if self.save_on_preemption:
                return  # the training loop's next save() call saves this step and exits
            if self._deferring:
                self._deferred = signum  # exit_deferred exits once the save is published
                return
            on_exit()
            exit_now(signum, 128 + signum)  # raised again should a finalizer ignore it

        self._on_exit = on_exit
        self._previous_handler = signal.signal(signal.SIGTERM, handler)

    @contextlib.contextmanager
    def exit_deferred(self) -> Iterator[None]:
        """Around a save on the main thread: SIGTERM's exit (without ``save_on_preemption``)
        waits until the save is staged and published, then runs as the handler would have.
        The handler runs on the main thread, which may be the one publishing the step (a
        save to memory alone): exiting there would cut the step off halfway and lose it."""
        if self._deferring or threading.current_thread() is not threading.main_thread():
            yield
            return
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
            signum, self._deferred = self._deferred, None
            if signum is not None and self._on_exit is not None:
                self._on_exit()
                raise SystemExit(128 + signum)

    def uninstall_sigterm(self) -> None:
        """Put back the SIGTERM handler that was there before."""
        if self._previous_handler is not None and \
                threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None
