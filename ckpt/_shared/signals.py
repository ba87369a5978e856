"""Leaving the process from a signal handler, even where Python ignores the exit.

A handler runs wherever the main thread is between two bytecodes, also inside a finalizer
or a weakref callback (a collection the training loop set off). There Python prints an
exception as "Exception ignored" and goes on: a ``SystemExit`` raised by a SIGTERM handler
would be lost, and training would run on until the scheduler's SIGKILL. :func:`exit_now`
raises the exit and watches for it among the exceptions Python ignores
(``sys.unraisablehook``, called on the main thread there). If it is there, a handler that
raises the same exit is put in place and the signal is sent again to the main thread a
moment later, out of the finalizer: the exit propagates (whatever handler the first one's
cleanup put back meanwhile).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from typing import Any, NoReturn

log = logging.getLogger("ckpt")

#: Seconds after an exit was ignored before the signal is sent again (the finalizer, and
#: the hook that noticed it, which ignores exceptions too, are over by then).
AGAIN_AFTER_S = 0.05

_raised: tuple[BaseException, int] | None = None  # the newest exit raised, and its signal
_watching = False


def exit_now(signum: int, code: int) -> NoReturn:
    """From the handler of ``signum``: raise ``SystemExit(code)``; should Python ignore it
    where the handler ran, it is raised again (see the module's docstring)."""
    global _raised, _watching
    if not _watching:
        _watching = True
        sys.unraisablehook = _hook(sys.unraisablehook)
    exc = SystemExit(code)
    _raised = (exc, signum)
    raise exc


def _hook(previous: Any) -> Any:
    def hook(unraisable: Any) -> None:
        raised = _raised
        if raised is None or unraisable.exc_value is not raised[0]:
            previous(unraisable)
            return
        exc, signum = raised
        log.warning("ckpt: the exit for signal %d was raised inside %r, which ignores "
                    "exceptions; signalling again", signum, unraisable.object)
        before = signal.getsignal(signum)

        def again(signum: int, frame: Any) -> None:
            signal.signal(signum, before)
            exit_now(signum, exc.code)
        signal.signal(signum, again)
        threading.Thread(target=_signal_again, args=(signum,), name="ckpt-signal-again",
                         daemon=True).start()
    return hook


def _signal_again(signum: int) -> None:
    time.sleep(AGAIN_AFTER_S)
    signal.pthread_kill(threading.main_thread().ident, signum)
