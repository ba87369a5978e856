"""The rule for a save's step number: after the newest step a restore could pick.

A restore picks the newest good step, so a save numbered below it would never be resumed
from (a step counter that restarted: a new run in an old root, an epoch's batch index), and a
save under a step that exists would silently replace it. Both are refused with
:class:`ckpt.errors.StepOrderError`, except:

* ``overwrite=True``: the caller knows (a framework that resumed from an older checkpoint
  and saves its steps again): the same step is replaced, a lower one saved;
* steps that a restore or load of this manager skipped as bad: falling back past them and
  saving the same numbers again is how a run goes on after a damaged step;
* steps that were retired (``mgr.retire``, ``ckpt gc``): they are no longer there.
"""

from __future__ import annotations

from typing import Callable, Iterable

from ckpt.errors import StepOrderError


class StepOrder:
    """The steps a save must come after: the root's committed steps (listed at the first save
    and again after a restore, load or retire, plus this manager's saves to it since) and
    this manager's memory-only saves, less the steps a restore skipped as bad.

    Args:
        root: the root's URL, for messages.
        steps: lists the root's committed steps.
        skipped: the (step, reason) pairs that restores and loads skipped as bad.
        settle: waits for the save in flight (so that a listing holds it).
    """

    def __init__(self, root: str, steps: Callable[[], list[int]],
                 skipped: Callable[[], list[tuple[int, str]]],
                 settle: Callable[[], None]) -> None:
        self.root, self._steps, self._skipped, self._settle = root, steps, skipped, settle
        self._listed: set[int] | None = None  # the root's steps, listed once (one request)
        self._in_memory: set[int] = set()

    def _known(self, fresh: bool = False) -> set[int]:
        if self._listed is None or fresh:
            self._settle()
            self._listed = set(self._steps())
        bad = {step for step, _ in self._skipped()}
        return (self._listed - bad) | self._in_memory

    def check(self, step: int, overwrite: bool) -> None:
        """Raise StepOrderError unless ``step`` may be saved now."""
        if self._allowed(step, overwrite, self._known()):
            return
        # Refusing on a listing made earlier could be wrong (steps retired by `ckpt gc` in
        # another process since): look again before refusing.
        known = self._known(fresh=True)
        if self._allowed(step, overwrite, known):
            return
        newest = max(known)
        if step == newest:
            error = StepOrderError(
                f"save(step={step}): step {step} is already saved in {self.root}; saving it "
                "again would replace it. Pass overwrite=True to replace it on purpose, or "
                "save under the next step number (docs/guide.md, 'Step numbers')",
                path=self.root)
        else:
            error = StepOrderError(
                f"save(step={step}): a newer step, {newest}, is saved in {self.root}"
                f"{' (in its memory tier)' if newest in self._in_memory else ''}, and a "
                f"restore picks the newest, so it would resume from step {newest}, not from "
                "this save. If the step counter restarted (a new run, an epoch's batch "
                "index), keep counting up or save under another root; to go on from an older "
                f"step on purpose, retire the newer ones first: mgr.retire(s for s in "
                f"mgr.steps() if s >= {step}), or pass overwrite=True (docs/guide.md, 'Step "
                "numbers')", path=self.root)
        error.step, error.newest = step, newest
        raise error

    @staticmethod
    def _allowed(step: int, overwrite: bool, known: set[int]) -> bool:
        newest = max(known, default=None)
        return overwrite or newest is None or step > newest

    def saved(self, step: int, to_root: bool) -> None:
        """This manager saved ``step``, to the root or to memory only (after :meth:`check`)."""
        if to_root and self._listed is not None:
            self._listed.add(step)
        else:
            self._in_memory.add(step)

    def retired(self, steps: Iterable[int]) -> None:
        """``steps`` were retired: list the root again at the next save."""
        self._in_memory.difference_update(steps)
        self._listed = None

    def restored(self, step: int | None, fell_back: bool) -> None:
        """A restore or load ran (it may have skipped steps as bad): list again. One that
        looked for the newest step (``fell_back``) and returned ``step`` passed over the
        memory-only saves after it: unusable, they no longer count."""
        self._listed = None
        if fell_back and step is not None:
            self._in_memory = {s for s in self._in_memory if s <= step}
