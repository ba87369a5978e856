"""A save as its caller sees it: :class:`SaveHandle` while it runs, :class:`SaveResult` after."""

from __future__ import annotations

import concurrent.futures as cf
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
    (a :class:`CheckpointError` with the original chained as ``__cause__``).
    """

    def __init__(self, step: int, future: cf.Future, blocking_seconds: float,
                 progress: ByteCounter | None = None) -> None:
        self.step = step
        self.blocking_seconds = blocking_seconds
        self.progress = progress  # bytes written so far, for a terminal's progress line
        self._future = future
        self.error_reported = False

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SaveResult:
        try:
            return self._future.result(timeout)
        except cf.TimeoutError as e:
            # cf.TimeoutError is the builtin TimeoutError, which an OSError with errno
            # ETIMEDOUT also is (a store that stopped answering): the writer's own error
            # must not read as "still running", or every later wait would repeat it.
            if not self._future.done():
                raise TimeoutError(f"the save of step {self.step} is still running") from None
            if self._future.exception() is not e:  # it finished just after the wait ran out
                return self.wait()
            self.error_reported = True
            raise
        except BaseException:
            self.error_reported = True
            raise

    result = wait

    def failed(self) -> bool:
        return self._future.done() and self._future.exception() is not None

    def exception(self) -> BaseException | None:
        """The writer's error once done (None while running or on success); not raising."""
        return self._future.exception() if self._future.done() else None

    def add_done_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        """Call ``fn(handle)`` when the save finishes (on the writer thread)."""
        self._future.add_done_callback(lambda _: fn(self))
