"""Every error ckpt raises derives from :class:`CheckpointError`.

Subclasses also derive from the builtin they refine, so ``except FileNotFoundError`` keeps
working for callers who do not know ckpt. Each carries the path (or key) it is about, says
what to do in its message, and pickles across processes (the message is the only argument
that ``BaseException.__reduce__`` replays, so extra fields are keyword-only with defaults).
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every ckpt error."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self):  # keep `path` when the error crosses a process boundary
        return (_rebuild, (type(self), str(self), self.path))


def _rebuild(cls: type, message: str, path: str | None) -> CheckpointError:
    return cls(message, path=path)


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint (or no root) exists where one was asked for."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A checkpoint's manifest or data failed validation: it must not be loaded."""


class CheckpointLockedError(CheckpointError, BlockingIOError):
    """Another writer holds the root's lock."""


class StateMismatchError(CheckpointError, KeyError):
    """The checkpoint does not fit the state it is loaded into (keys, shapes, dtypes)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class PartialLoadError(CheckpointError):
    """A load failed after it had begun to write live tensors; the message names which
    tensors hold the new values, which are partly written and which are unchanged.

    ``changed`` holds the live tensors' keys that were written (wholly or partly), and
    ``corrupt`` says whether the cause was the step's data (a digest mismatch or an
    unreadable chunk): loading another good step that holds those tensors repairs the state.
    Both are process-local (not kept when the error is pickled).
    """

    def __init__(self, message: str, *, path: str | None = None,
                 changed: frozenset[str] = frozenset(), corrupt: bool = False) -> None:
        super().__init__(message, path=path)
        self.changed, self.corrupt = changed, corrupt


class UnsupportedValueError(CheckpointError, TypeError):
    """A value in the state can be neither a tensor nor JSON (and pickle was not allowed)."""


class StepOrderError(CheckpointError, ValueError):
    """A save's step number is not after the root's newest step: lower (a restore would
    resume from the newer one), or the same one without ``overwrite=True``. ``step`` is
    the step refused and ``newest`` the root's newest step (None where not known)."""

    step: int | None = None
    newest: int | None = None


class StorageError(CheckpointError, OSError):
    """The storage backend failed to read, write or commit (the backend's error is chained)."""


class ForwardCheckError(CorruptCheckpointError):
    """A restored step failed its forward check (``verify="forward"``): NaN/Inf weights or
    outputs, or an output that differs from the one recorded at save time."""


class MetricsServerError(CheckpointError, OSError):
    """The metrics HTTP server could not listen on its address and port (the port is in use,
    or the address is not this host's)."""
