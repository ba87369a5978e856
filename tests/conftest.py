"""Shared fixtures of the ckpt test-suite.

The repository is not installed: make both it (``import ckpt``, ``import tests.support``)
importable however pytest was started.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
for _p in (str(_TESTS.parent),):
    if _p not in sys.path:
        sys.path.insert(0, _p)


@pytest.fixture
def one_thread():
    """Bit-exact comparisons of computations need a fixed intra-op thread count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def storage_reads(monkeypatch):
    """Every path the POSIX storage stats or reads, in order."""
    from storage_backends import PosixStorage

    seen: list[str] = []
    for name in ("read", "read_into", "size"):
        original = getattr(PosixStorage, name)

        def spy(self, path, *args, _original=original, **kwargs):
            seen.append(path)
            return _original(self, path, *args, **kwargs)

        monkeypatch.setattr(PosixStorage, name, spy)
    return seen
