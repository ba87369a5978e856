"""Training-health guards: notice a step that went wrong before its update is kept.

:class:`HealthGuard` judges one step at a time from two numbers every rank agrees on (the
global mean loss and the gradient norm, both after the trainer's all-reduce):

- a **non-finite loss** (NaN or ±Inf);
- a **non-finite gradient norm** (the trainer leaves this one to a ``GradScaler`` when it
  has one: an overflowed scaled gradient is the scaler's business, it skips the step);
- a **loss spike**: the loss is above ``spike_factor`` times the median of the last
  ``window`` accepted losses (checked once ``min_history`` losses were accepted).

The guard only detects and counts. What to do about a bad step (roll back to the newest good
checkpoint, skip the offending batch, give up after ``max_rollbacks``) is the trainer's part;
see ``trainer.ElasticTrainer`` and docs/observability.md.

:class:`HealthyWindow` turns the guard's verdicts into *verified* checkpoints: a save is
verified once the ``steps`` steps after it were all judged healthy; a bad step (or, with the
guard's ``grad_norm_limit``, a gradient norm above it) before that means it never is.

Example::

    guard = HealthGuard(spike_factor=5.0, window=100, min_history=20, max_rollbacks=3)
    verdict = guard.observe(step, loss, grad_norm)
    if not verdict.ok:
        guard.rollback(verdict)      # raises TrainingHealthError past max_rollbacks
        restored = restore_newest_checkpoint()
        guard.rewind(restored)       # forget the losses of the steps undone
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics

#: Verdict reasons.
OK = "ok"
NONFINITE_LOSS = "nonfinite_loss"
NONFINITE_GRAD_NORM = "nonfinite_grad_norm"
LOSS_SPIKE = "loss_spike"
#: Not a verdict (the step is accepted): why a step confirmed no save (HealthyWindow).
GRAD_NORM_OVER_LIMIT = "grad_norm_over_limit"


class TrainingHealthError(Exception):
    """Training kept going wrong: more rollbacks than ``max_rollbacks``.

    Deliberately not a ``RuntimeError``: the trainer must not mistake it for a broken
    process group (whose errors are RuntimeErrors it recognises by their wording).
    """

    def __init__(self, message: str, verdicts: list[Verdict]) -> None:
        super().__init__(message)
        self.verdicts = verdicts


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The guard's judgement of one step."""

    step: int
    ok: bool
    reason: str                       # OK, NONFINITE_LOSS, NONFINITE_GRAD_NORM or LOSS_SPIKE
    loss: float
    grad_norm: float | None
    median: float | None = None       # median of the recent accepted losses (None: too few)
    threshold: float | None = None    # spike_factor * median

    def describe(self) -> str:
        """One line for logs and errors."""
        text = f"step {self.step}: {self.reason} (loss={self.loss:.6g}"
        if self.grad_norm is not None:
            text += f", grad_norm={self.grad_norm:.6g}"
        if self.median is not None:
            text += f", recent median={self.median:.6g}"
        if self.threshold is not None:
            text += f", threshold={self.threshold:.6g}"
        return text + ")"


class HealthGuard:
    """Judges each step's loss and gradient norm; counts rollbacks against a budget.

    Args:
        spike_factor: a loss above ``spike_factor * median(recent losses)`` is a spike
            (None: no spike check). The default 5.0 is deliberately conservative: a false
            alarm costs a rollback, a skipped good batch and part of the rollback budget,
            while NaN/Inf, the catastrophic case, is caught whatever the factor. Use 2-3
            for a late, stable phase of training with a low-variance loss.
        window: how many of the most recent accepted losses the median is taken over.
        min_history: no spike check until this many losses were accepted (the median of a
            few early, fast-falling losses says little). After a restart of the process
            the history starts empty again.
        check_grad_norm: judge the gradient norm's finiteness.
        max_rollbacks: :meth:`rollback` raises :class:`TrainingHealthError` when asked for
            one more than this (per guard, i.e. per ``fit`` of the trainer).
        grad_norm_limit: a finite gradient norm above this is not healthy for verification
            (:class:`HealthyWindow`): no save before such a step becomes verified. It does
            not roll back (clipping, ``StepConfig.max_grad_norm``, deals with the update).
            None: only finiteness counts.

    The spike check assumes a positive loss (cross-entropy, MSE, ...): with a median at or
    below zero it is skipped.
    """

    def __init__(self, *, spike_factor: float | None = 5.0, window: int = 100,
                 min_history: int = 20, check_grad_norm: bool = True,
                 max_rollbacks: int = 3, grad_norm_limit: float | None = None) -> None:
        if spike_factor is not None and not spike_factor > 1.0:
            raise ValueError(f"spike_factor must be above 1 (or None), not {spike_factor!r}")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int, not {window!r}")
        if not isinstance(min_history, int) or not 1 <= min_history <= window:
            raise ValueError(f"min_history must be an int in 1..window ({window}), not "
                             f"{min_history!r}")
        if not isinstance(max_rollbacks, int) or max_rollbacks < 0:
            raise ValueError(f"max_rollbacks must be a non-negative int, not {max_rollbacks!r}")
        if grad_norm_limit is not None and not (isinstance(grad_norm_limit, (int, float))
                                                and grad_norm_limit > 0
                                                and math.isfinite(grad_norm_limit)):
            raise ValueError(f"grad_norm_limit must be a positive number or None, not "
                             f"{grad_norm_limit!r}")
        self.grad_norm_limit = grad_norm_limit
        self.spike_factor = spike_factor
        self.window = window
        self.min_history = min_history
        self.check_grad_norm = check_grad_norm
        self.max_rollbacks = max_rollbacks
        self._history: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self.rollbacks: list[Verdict] = []

    # -- judging -------------------------------------------------------------------------------
    def median(self) -> float | None:
        """Median of the recent accepted losses, or None while fewer than ``min_history``."""
        if len(self._history) < self.min_history:
            return None
        return statistics.median(v for _, v in self._history)

    def observe(self, step: int, loss: float, grad_norm: float | None = None) -> Verdict:
        """Judge one step. An accepted loss joins the history; a rejected one does not.

        ``grad_norm`` None means "not judged" (not measured, or left to a GradScaler).
        """
        loss = float(loss)
        norm = None if grad_norm is None else float(grad_norm)
        if not math.isfinite(loss):
            return Verdict(step, False, NONFINITE_LOSS, loss, norm)
        if self.check_grad_norm and norm is not None and not math.isfinite(norm):
            return Verdict(step, False, NONFINITE_GRAD_NORM, loss, norm)
        median = self.median()
        threshold = None
        if self.spike_factor is not None and median is not None and median > 0:
            threshold = self.spike_factor * median
            if loss > threshold:
                return Verdict(step, False, LOSS_SPIKE, loss, norm, median, threshold)
        self._history.append((step, loss))
        return Verdict(step, True, OK, loss, norm, median, threshold)

    # -- after a bad step ----------------------------------------------------------------------
    def rollback(self, verdict: Verdict) -> int:
        """Count a rollback for ``verdict``; returns how many there were so far.

        Raises:
            TrainingHealthError: this would be rollback number ``max_rollbacks + 1``.
        """
        if len(self.rollbacks) >= self.max_rollbacks:
            history = "; ".join(v.describe() for v in [*self.rollbacks, verdict])
            raise TrainingHealthError(
                f"training is unhealthy: {verdict.describe()} would need rollback "
                f"{len(self.rollbacks) + 1}, more than max_rollbacks={self.max_rollbacks}. "
                f"Bad steps so far: {history}. Skipping batches did not help: lower the "
                f"learning rate, look at the skipped samples (logged with each rollback, and "
                f"in the audit log), or raise max_rollbacks", [*self.rollbacks, verdict])
        self.rollbacks.append(verdict)
        return len(self.rollbacks)

    def rewind(self, step: int) -> None:
        """The training state went back to ``step``: forget the losses of later steps."""
        kept = [(s, v) for s, v in self._history if s <= step]
        self._history.clear()
        self._history.extend(kept)

    def reset(self) -> None:
        """Forget the loss history and the rollbacks (a fresh ``fit``)."""
        self._history.clear()
        self.rollbacks = []

    def checks(self) -> list[str]:
        """What a healthy step passed, for the evidence of a verified checkpoint."""
        out = [NONFINITE_LOSS]
        if self.check_grad_norm:
            out.append(NONFINITE_GRAD_NORM)
        if self.spike_factor is not None:
            out.append(f"{LOSS_SPIKE}(factor={self.spike_factor:g}, window={self.window})")
        if self.grad_norm_limit is not None:
            out.append(f"{GRAD_NORM_OVER_LIMIT}(limit={self.grad_norm_limit:g})")
        return out

    def over_limit(self, verdict: Verdict) -> bool:
        """Whether an accepted step's gradient norm is above ``grad_norm_limit``."""
        return (self.grad_norm_limit is not None and verdict.grad_norm is not None
                and verdict.grad_norm > self.grad_norm_limit)


class HealthyWindow:
    """The saves awaiting verification, and the healthy steps since each.

    A save of step S is *confirmed* once steps S+1 .. S+``steps`` were all judged healthy
    (accepted by the guard, and within its ``grad_norm_limit``). A step that is not healthy
    first drops every save waiting: the training after them did not stay healthy, so they
    are never verified. A rollback (:meth:`rewind`) drops the saves after the step it went
    back to. Pure bookkeeping: writing the marker is the caller's part.

    Args:
        steps: the window, in steps.
        guard: the health guard whose verdicts are observed (its rules go into the evidence).
    """

    def __init__(self, steps: int, guard: HealthGuard) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"the verified window must be a positive int, not {steps!r}")
        self.steps, self.guard = steps, guard
        # saved step -> [healthy steps since, max loss, max grad norm]
        self._pending: dict[int, list] = {}

    @property
    def pending(self) -> list[int]:
        """The saves awaiting their window, oldest first."""
        return sorted(self._pending)

    def saved(self, step: int) -> None:
        """A checkpoint of ``step`` was taken (or restored: its window starts again)."""
        self._pending.setdefault(step, [0, None, None])

    def observe(self, verdict: Verdict) -> tuple[list[tuple[int, dict]], list[int]]:
        """Count ``verdict``'s step: (the saves it confirmed, each with its evidence; the
        saves it dropped as not healthy)."""
        if not verdict.ok or self.guard.over_limit(verdict):
            dropped = [s for s in self.pending if s < verdict.step]
            for s in dropped:
                del self._pending[s]
            return [], dropped
        confirmed = []
        for step in self.pending:
            if step >= verdict.step:
                continue
            window = self._pending[step]
            window[0] += 1
            window[1] = _max(window[1], verdict.loss)
            norm = verdict.grad_norm  # None: not judged; not finite: not checked
            window[2] = _max(window[2], norm if norm is not None and math.isfinite(norm)
                             else None)
            if window[0] >= self.steps:
                del self._pending[step]
                confirmed.append((step, {
                    "window": self.steps, "confirmed_at": verdict.step,
                    "checks": self.guard.checks(), "max_loss": window[1],
                    "max_grad_norm": window[2]}))
        return confirmed, []

    def rewind(self, step: int) -> None:
        """The state went back to ``step``: the saves after it wait no more."""
        self._pending = {s: w for s, w in self._pending.items() if s <= step}


def _max(current: float | None, value: float | None) -> float | None:
    if value is None:
        return current
    return value if current is None else max(current, value)


__all__ = ["GRAD_NORM_OVER_LIMIT", "LOSS_SPIKE", "NONFINITE_GRAD_NORM", "NONFINITE_LOSS",
           "OK", "HealthGuard", "HealthyWindow", "TrainingHealthError", "Verdict"]
