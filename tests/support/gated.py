"""A storage whose writes wait for the test: a save exactly as slow as a test needs."""

from __future__ import annotations

import threading
from pathlib import Path

from storage_backends import PosixStorage


class GatedStorage(PosixStorage):
    """POSIX storage whose writes wait until ``gate`` is set (then fail with ENOSPC when
    ``fail``); a test that never opens it fails after a minute instead of hanging."""

    def __init__(self, root: Path, *, fail: bool = False) -> None:
        super().__init__(str(root))
        self.gate = threading.Event()
        self.fail = fail

    def write(self, path, buffers):
        assert self.gate.wait(60), "the test never opened the gate"
        if self.fail:
            raise OSError(28, "No space left on device (injected)")
        return super().write(path, buffers)
