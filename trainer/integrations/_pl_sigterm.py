"""SIGTERM for :class:`~trainer.integrations.lightning.CkptCheckpointIO` when the user asks ckpt
to handle it (``schedule=ckpt.Schedule(handle_sigterm=True)``): the checkpoint in flight is
committed before the process exits, within a bound.

The plugin writes in a thread of its own (``async_save=True``) or in the training thread, so
the manager's own handler, which finishes only the manager's save, would exit while the
``.ckpt`` is still being written. This handler is installed instead, while a write is in
flight (Lightning's handler is back between writes):

* a background write: wait up to ``timeout`` seconds for it, then exit with 128 + the signal
  (``SystemExit``: Lightning's ``on_exception`` and ``teardown`` run, with the file published).
  A write still running then is abandoned with ``os._exit`` (its hidden temporary file stays,
  the previous checkpoint is whole): past the bound a scheduler's SIGKILL would come anyway,
  and the interpreter would otherwise join the writer thread before exiting;
* a write in the training thread: it goes on; the process exits once it is committed.

Every step is logged (``ckpt: SIGTERM ...``). The exit leaves from wherever the handler ran,
also from a finalizer, which would ignore it (``ckpt/_shared/signals.py`` raises it again).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

from ckpt.tools import exit_now

log = logging.getLogger("ckpt")

#: ``CkptCheckpointIO(sigterm_timeout=...)``'s default, in seconds: below the grace period
#: schedulers give between SIGTERM and SIGKILL (Slurm's KillWait and Kubernetes' default
#: terminationGracePeriodSeconds are 30 s).
DEFAULT_TIMEOUT = 20.0

#: Waits up to the given seconds for the write in flight: (done, its error or None).
Settle = Callable[[float], "tuple[bool, BaseException | None]"]


class SigtermGuard:
    """Installs the handler around each write (from the main thread only, as Python
    requires; elsewhere it does nothing)."""

    def __init__(self, timeout: float) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise ValueError(f"sigterm_timeout must be a number of seconds >= 0, not "
                             f"{timeout!r}")
        self.timeout = float(timeout)
        self._previous: Any = None
        self._armed = False
        self._what = ""
        self._settle: Settle | None = None
        self._signum: int | None = None  # SIGTERM during a write in the training thread

    def arm(self, what: str, settle: Settle | None) -> None:
        """A write of ``what`` starts: in the background (``settle`` waits for it) or, with
        ``settle`` None, in this thread."""
        self._what, self._settle = what, settle
        if self._armed or threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.signal(signal.SIGTERM, self._handler)
        self._armed = True

    def hand_off(self, settle: Settle) -> None:
        """The write armed in this thread (``settle`` None) now runs in the background:
        ``settle`` waits for it. A SIGTERM that came while it was being handed off is acted
        on now (armed before the write starts, no signal finds Lightning's handler in place
        of this one)."""
        self._settle = settle
        signum, self._signum = self._signum, None
        if signum is not None:
            self._wait_then_exit(signum, settle)

    def disarm(self) -> None:
        """The write is over: Lightning's handler is back; a SIGTERM that came during a write
        in this thread exits now (SystemExit)."""
        if self._armed:
            signal.signal(signal.SIGTERM, self._previous)
            self._armed, self._previous = False, None
        self._settle = None
        signum, self._signum = self._signum, None
        if signum is not None:
            log.warning("ckpt: SIGTERM: %s committed; exiting with %d", self._what,
                        128 + signum)
            raise SystemExit(128 + signum)

    def _handler(self, signum: int, frame: Any) -> None:
        settle = self._settle
        if settle is None:  # the write runs in this very thread: it must finish first
            log.warning("ckpt: SIGTERM during the save of %s: exiting once it is committed",
                        self._what)
            self._signum = signum
            return
        self._wait_then_exit(signum, settle)

    def _wait_then_exit(self, signum: int, settle: Settle) -> None:
        log.warning("ckpt: SIGTERM: waiting up to %g s for the checkpoint in flight (%s) "
                    "to commit", self.timeout, self._what)
        started = time.monotonic()
        done, error = settle(self.timeout)
        if done:
            if error is None:
                log.warning("ckpt: SIGTERM: %s committed after %.1f s; exiting with %d",
                            self._what, time.monotonic() - started, 128 + signum)
            else:
                log.error("ckpt: SIGTERM: the save of %s failed (%s: %s); exiting with %d",
                          self._what, type(error).__name__, error, 128 + signum)
            exit_now(signum, 128 + signum)
        log.error("ckpt: SIGTERM: %s not committed after %g s (sigterm_timeout); exiting "
                  "without it: the previous checkpoint stays (a hidden .part file of this "
                  "one may be left in its folder)", self._what, self.timeout)
        _flush_logs()
        os._exit(128 + signum)


def _flush_logs() -> None:
    """Before ``os._exit``, which flushes nothing."""
    for logger in (log, logging.getLogger()):
        for handler in logger.handlers:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001 - a broken handler must not keep us alive
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
