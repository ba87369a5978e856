"""Building many small objects at once without the cyclic garbage collector's full passes."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while building many small objects that form no
    cycles (a parsed manifest, a batch of table rows): each allocation burst otherwise sets
    off full passes that scan every object of the process, which in a large job's process
    cost more than the work itself (benchmarks/bench_scale.py). Nests; restores the state."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
