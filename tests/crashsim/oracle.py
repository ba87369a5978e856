"""What must hold in every crash state of a root (POSIX or an object store URL).

* ``restore`` returns the newest step before the operation or the newest after it (only the
  latter once the operation had returned), with every value bit-exact to what was saved;
* every visible step (one with a manifest) verifies at the digest level, so a reader never
  meets a torn step; each one that verifies restores to exactly what was saved as that step;
  no step appears that was never saved; a step kept by the operation is never lost;
* verify agrees with restore: the newest step that verifies is the step restore returned,
  and ``ckpt verify --all`` exits 0 exactly when every visible step verifies;
* opening a writer on the crashed root (which removes leftovers and unreferenced files)
  changes none of that.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Any, Callable

import torch

import ckpt
import verify
from verify.cli import main as cli


@dataclass
class Expect:
    """The steps (step -> saved values) before and after the explored operation."""

    old: dict[int, dict[str, Any]]
    new: dict[int, dict[str, Any]]
    template: Callable[[], dict[str, Any]]
    # Steps restore may also return (a documented gap, e.g. re-saving an existing step).
    also_allowed: frozenset = frozenset()

    def known(self, step: int) -> bool:
        return step in self.old or step in self.new

    def matches(self, step: int, state: dict[str, Any]) -> bool:
        """Whether ``state`` holds what was saved as ``step``, before or after."""
        return any(step in d and same(state, d[step]) for d in (self.new, self.old))


def same(state: dict[str, Any], expected: dict[str, Any]) -> bool:
    for key, want in expected.items():
        got = state.get(key)
        if isinstance(want, torch.Tensor):
            if not (isinstance(got, torch.Tensor) and got.dtype == want.dtype
                    and torch.equal(got, want)):
                return False
        elif got != want:
            return False
    return True


ONE_THREAD = ckpt.SaveOptions(write_threads=1)  # tiny states: a pool costs more than it saves


def _restore(root: str, expect: Expect, step: int | None = None) -> tuple[Any, dict]:
    state = expect.template()
    try:
        with ckpt.CheckpointManager(root, read_only=True, metrics=False,
                                    options=ONE_THREAD) as mgr:
            return mgr.restore(state, step=step), state
    except Exception as e:  # noqa: BLE001 (a finding, reported by the caller)
        return e, state


def _cli_verify_all(root: str) -> int:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        return cli(["verify", root, "--all", "--level", "digest"])


def check(root: str, expect: Expect, *, after_return: bool, recover: bool = True) -> list[str]:
    """The problems of one crash state (empty: it is one POSIX allows ckpt to be in)."""
    problems = _check_once(root, expect, after_return)
    if problems or not recover:
        return problems
    before = _restore(root, expect)[0]
    try:
        ckpt.CheckpointManager(root, schedule=ckpt.Schedule(handle_sigterm=False),
                               metrics=False).close()
    except Exception as e:  # noqa: BLE001
        return [f"opening a writer after the crash raised {type(e).__name__}: {e}"]
    return [f"after a writer's cleanup: {p}" for p in _check_once(root, expect, after_return)] + (
        [] if _restore(root, expect)[0] == before else ["the cleanup changed the restored step"])


def _check_once(root: str, expect: Expect, after_return: bool) -> list[str]:
    problems = []
    old_latest = max(expect.old, default=None)
    new_latest = max(expect.new)
    allowed = {new_latest} if after_return else {old_latest, new_latest, *expect.also_allowed}
    got, state = _restore(root, expect)
    if isinstance(got, Exception):
        problems.append(f"restore raised {type(got).__name__}: {got}")
    elif got not in allowed:
        problems.append(f"restore returned step {got}; allowed: {sorted(allowed, key=str)}")
    elif got is not None and not (same(state, expect.new[got]) if after_return
                                  else expect.matches(got, state)):
        problems.append(f"restore returned step {got} with values that were never saved")
    with ckpt.CheckpointManager(root, read_only=True, metrics=False) as mgr:
        visible = mgr.steps()
    good = []
    for s in visible:
        report = verify.verify(root, step=s, level="digest", threads=1)
        if not report.ok:
            problems.append(f"step {s} is visible but torn: "
                            f"{[p.message for p in report.problems] or report.error}")
            continue
        good.append(s)
        if not expect.known(s):
            problems.append(f"step {s} verifies but was never saved")
            continue
        if s == got:
            continue  # restored and compared above
        loaded, state = _restore(root, expect, step=s)
        if loaded != s or not expect.matches(s, state):
            problems.append(f"step {s} verifies but restore(step={s}) gave {loaded!r} / "
                            "other values")
    code = _cli_verify_all(root)
    want = 0 if good and len(good) == len(visible) else (2 if not visible else 1)
    if code != want:
        problems.append(f"`ckpt verify --all` exited {code}; the steps' own verdicts say {want}")
    newest_good = max(good, default=None)
    if not isinstance(got, Exception) and newest_good != got:
        problems.append(f"verify's newest good step is {newest_good}, restore returned {got}")
    for s in sorted(expect.old.keys() & expect.new.keys()):
        if s not in good and same(expect.old[s], expect.new[s]):
            problems.append(f"step {s}, kept by the operation, is lost")
    return problems
