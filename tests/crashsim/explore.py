"""Run one recorded operation through the explorer: every crash state, checked."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from . import model, oracle
from .record import Trace, merge, recording, snapshot_tree


@dataclass
class Result:
    """What one exploration saw."""

    ops: int
    prefixes: int
    enumerated: int
    states: int
    checked: int = 0  # distinct as readers see them (model.visible)
    violations: list[tuple[int, list[str]]] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        return (f"{self.ops} ops, {self.prefixes} prefixes, {self.enumerated} crash states "
                f"enumerated, {self.states} distinct, {self.checked} distinct to a reader "
                f"checked, {len(self.violations)} violations, {self.seconds:.1f} s")

    def describe(self, n: int = 3) -> str:
        lines = [self.summary()]
        for prefix, problems in self.violations[:n]:
            lines.append(f"  crash after op {prefix}: " + "; ".join(problems))
        return "\n".join(lines)


@contextlib.contextmanager
def recorded(root: str) -> Iterator[tuple[dict, list[Trace]]]:
    """Snapshot ``root``, then record what the storage does inside the block."""
    base = snapshot_tree(root)
    with recording(root) as trace:
        yield base, [trace]


def explore(root: str, base: dict, traces: list[Trace] | list[tuple], expect: oracle.Expect,
            *, recover: bool = True, stop_after: int | None = None) -> Result:
    """Check every crash state of the recorded operation; ``stop_after`` violations ends it."""
    t0 = time.perf_counter()
    ops = merge(traces) if traces and isinstance(traces[0], Trace) else traces
    a = model.analyse(base, ops)
    real = {p: d for p, d in snapshot_tree(root).items() if not p.startswith(model.IGNORED)}
    if real != a.final:
        raise AssertionError(f"the recorder missed something: the model ends with "
                             f"{sorted(set(a.final) ^ set(real))} differing from {root}")
    states, enumerated = model.crash_states(a)
    result = Result(len(ops), len(ops) + 1, enumerated, len(states))
    work = tempfile.mkdtemp(prefix="crash-states-")
    verdicts: dict[tuple, list[str]] = {}
    try:
        for i, state in enumerate(states):
            key = (model.fingerprint(model.visible(state.tree)), state.after_return)
            if key not in verdicts:
                where = os.path.join(work, f"s{i}")
                model.materialize(state.tree, where)
                verdicts[key] = oracle.check(where, expect, after_return=state.after_return,
                                             recover=recover)
                shutil.rmtree(where)
                result.checked += 1
            problems = verdicts[key]
            if problems:
                result.violations.append((state.prefix, problems))
                if stop_after is not None and len(result.violations) >= stop_after:
                    break
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result.seconds = time.perf_counter() - t0
    return result


def run(root: str, operation: Callable[[], object], expect: oracle.Expect, **kw) -> Result:
    """Record ``operation`` on ``root`` and explore it."""
    with recorded(root) as (base, traces):
        operation()
    return explore(root, base, traces, expect, **kw)
