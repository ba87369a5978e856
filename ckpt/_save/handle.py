"""A save as its caller sees it: :class:`SaveHandle` while it runs, :class:`SaveResult` after."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ckpt._shared.progress import ByteCounter


@dataclass(frozen=True)
class SaveResult:
    """What one committed save wrote."""

    step: int
    location: str
    bytes_written: int
    bytes_reused: int
    files: int
    blocking_seconds: float
    write_seconds: float


class SaveHandle:
    """A save in flight: ``done()``, ``wait(timeout)`` and ``result(timeout)``.

    ``wait`` and ``result`` return the :class:`SaveResult`, or raise the writer's error
    (a :class:`CheckpointError` with the original chained as ``__cause__``), once the done
    callbacks (metrics, logs) have run too: what a caller reads after ``wait`` is current.
    A save to a root is done when its step is committed; the retention that follows runs
    after (``CheckpointManager.wait`` waits for both).
    """

    def __init__(self, step: int, future: cf.Future, blocking_seconds: float,
                 progress: ByteCounter | None = None) -> None:
        self.step = step
        self.blocking_seconds = blocking_seconds
        self.progress = progress  # bytes written so far, for a terminal's progress line
        self._future = future
        self.error_reported = False
        self._callbacks_left = 0
        self._callbacks_ran = threading.Condition()

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SaveResult:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            result = self._future.result(timeout)
        except cf.TimeoutError as e:
            # cf.TimeoutError is the builtin TimeoutError, which an OSError with errno
            # ETIMEDOUT also is (a store that stopped answering): the writer's own error
            # must not read as "still running", or every later wait would repeat it.
            if not self._future.done():
                raise TimeoutError(f"the save of step {self.step} is still running") from None
            if self._future.exception() is not e:  # it finished just after the wait ran out
                return self.wait()
            self.error_reported = True
            self._await_callbacks(deadline)
            raise
        except BaseException:
            self.error_reported = True
            self._await_callbacks(deadline)
            raise
        self._await_callbacks(deadline)
        return result

    result = wait

    def failed(self) -> bool:
        return self._future.done() and self._future.exception() is not None

    def exception(self) -> BaseException | None:
        """The writer's error once done (None while running or on success); not raising."""
        return self._future.exception() if self._future.done() else None

    def outcome(self) -> SaveResult:
        """The result of a finished save, for a done callback (which ``wait`` would wait on)."""
        return self._future.result(0)

    def add_done_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        """Call ``fn(handle)`` when the save finishes (on the writer thread); ``wait``
        returns after it ran."""
        with self._callbacks_ran:
            self._callbacks_left += 1

        def run(_: cf.Future) -> None:
            try:
                fn(self)
            finally:
                with self._callbacks_ran:
                    self._callbacks_left -= 1
                    self._callbacks_ran.notify_all()
        self._future.add_done_callback(run)

    def _await_callbacks(self, deadline: float | None) -> None:
        # A future wakes its waiters before it runs its callbacks: without this, a caller
        # could read the metrics of a save it waited for before they were recorded.
        with self._callbacks_ran:
            self._callbacks_ran.wait_for(
                lambda: self._callbacks_left == 0,
                None if deadline is None else max(0.0, deadline - time.monotonic()))
