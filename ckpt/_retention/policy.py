"""The retention policy: which committed steps of a root to keep.

One policy object serves both the manager (applied after each commit) and ``ckpt gc``
(applied on demand). A manager whose policy retires steps records it in each step's manifest
metadata under :data:`RECORD_KEY`, so that ``ckpt gc`` run later applies the rules the run's
writer applies. The record lives in the manifest, not in a file of its own beside the steps,
because the manifest is committed atomically with its step (no second write to keep in step
with it, no window where the two disagree), is already parsed and validated by every reader,
and travels with a step copied to another root.

This module is pure: no storage, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Manifest metadata key of the recorded policy (``ckpt_*`` keys are ckpt's own, not the user's).
RECORD_KEY = "ckpt_retention"
METRICS_KEY = "metrics"  # where save(..., metrics={...}) puts a step's metrics


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class KeepBest:
    """Retention by a metric passed at save time (``mgr.save(step, state, metrics={...})``).

    Args:
        n: how many of the best steps to keep.
        metric: the name of the metric, e.g. ``"val_loss"``.
        mode: ``"min"`` (lower is better) or ``"max"``.
    """

    n: int
    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"keep_best must be a positive integer, not {self.n!r}")
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError("keep_best needs best_metric=, the name of a metric passed to "
                             "save(..., metrics={name: value})")
        if self.mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', not {self.mode!r}")

    def select(self, values: Mapping[int, Any]) -> set[int]:
        """The ``n`` steps with the best values (a missing value, or one that is not a finite
        number, never ranks; on a tie the newer step wins)."""
        sign = 1.0 if self.mode == "min" else -1.0
        ranked = sorted((sign * v, -step) for step, v in values.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)
                        and math.isfinite(v))
        return {-neg_step for _, neg_step in ranked[:self.n]}


@dataclass(frozen=True)
class RetentionPolicy:
    """Which committed steps to keep. Each rule adds steps to the kept set.

    Args:
        keep_last: the newest N steps (0: none by count; None: no rule by count, so every
            step is kept unless ``keep_best`` is set).
        keep_every: also every step divisible by K. It only adds to ``keep_last`` or
            ``keep_best``: alone, every step is kept anyway.
        keep_best: also the N steps with the best value of a saved metric.

    Whatever the rules, the newest committed step known good is kept (``newest`` of
    :meth:`retained`), so a root never loses its last good step to retention, and so is
    the newest verified step (``verified``: one the training after it confirmed healthy,
    see ``CheckpointManager.mark_verified``).
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: KeepBest | None = None

    def __post_init__(self) -> None:
        if self.keep_last is not None and (not _is_int(self.keep_last) or self.keep_last < 0):
            raise ValueError(f"keep_last must be an integer >= 0 or None, not "
                             f"{self.keep_last!r}")
        if self.keep_every is not None and (not _is_int(self.keep_every)
                                            or self.keep_every < 1):
            raise ValueError(f"keep_every must be a positive integer or None, not "
                             f"{self.keep_every!r}")
        if self.keep_best is not None and not isinstance(self.keep_best, KeepBest):
            raise TypeError(f"keep_best must be a KeepBest or None, not "
                            f"{type(self.keep_best).__name__}")

    @property
    def keeps_all(self) -> bool:
        """Whether the rules keep every step (neither keep_last nor keep_best is set)."""
        return self.keep_last is None and self.keep_best is None

    def retained(self, steps: Sequence[int],
                 metrics: Mapping[int, Mapping[str, Any]] | None = None, *,
                 newest: int | None = None, verified: int | None = None) -> set[int]:
        """The steps to keep of the committed ``steps``.

        Args:
            steps: the committed steps (any order).
            metrics: step -> the metrics saved with it (``manifest.metadata["metrics"]``),
                needed for ``keep_best``; a step without the metric never ranks.
            newest: the newest committed step known good, kept whatever the rules (None:
                the rules alone decide).
            verified: the newest verified step, kept whatever the rules too (None: none).
        """
        ordered = sorted(steps)
        if self.keeps_all:
            keep = set(ordered)
        else:
            keep = set()
            if self.keep_last is not None:
                keep |= set(ordered[max(0, len(ordered) - self.keep_last):])
            if self.keep_best is not None:
                name = self.keep_best.metric
                keep |= self.keep_best.select(
                    {s: _metric((metrics or {}).get(s), name) for s in ordered})
            if self.keep_every is not None:
                keep |= {s for s in ordered if s % self.keep_every == 0}
        keep.update(s for s in (newest, verified) if s is not None)
        return keep

    def describe(self) -> str:
        """The rules in one line, as the manager's keywords spell them."""
        if self.keeps_all:
            return "keep every step"
        parts = []
        if self.keep_last is not None:
            parts.append(f"keep_last={self.keep_last}")
        if self.keep_every is not None:
            parts.append(f"keep_every={self.keep_every}")
        if self.keep_best is not None:
            best = self.keep_best
            parts.append(f"keep_best={best.n} by {best.metric} ({best.mode})")
        return ", ".join(parts) + ", and the newest good step"

    # -- the record in a manifest -------------------------------------------------------------
    def to_record(self) -> dict[str, Any]:
        """This policy as JSON values (the manifest's ``ckpt_retention`` entry)."""
        best = self.keep_best
        return {"keep_last": self.keep_last, "keep_every": self.keep_every,
                "keep_best": None if best is None else {"n": best.n, "metric": best.metric,
                                                        "mode": best.mode}}

    @classmethod
    def from_record(cls, record: Any) -> RetentionPolicy:
        """The policy a manifest recorded.

        Raises:
            ValueError: not a record of this form. Unknown keys are refused rather than
                ignored: a rule this version cannot apply might keep a step it would delete.
        """
        if not isinstance(record, Mapping) or set(record) != {"keep_last", "keep_every",
                                                              "keep_best"}:
            raise ValueError(f"expected keep_last, keep_every and keep_best, not {record!r}")
        best = record["keep_best"]
        if best is not None:
            if not isinstance(best, Mapping) or set(best) != {"n", "metric", "mode"}:
                raise ValueError(f"keep_best: expected n, metric and mode, not {best!r}")
            best = KeepBest(best["n"], best["metric"], best["mode"])
        return cls(record["keep_last"], record["keep_every"], best)

    def record_in(self, metadata: dict[str, Any] | None) -> dict[str, Any] | None:
        """A save's ``metadata`` with this policy recorded (unchanged when it keeps every
        step: there is nothing for ``ckpt gc`` to follow)."""
        if self.keeps_all:
            return metadata
        return {**(metadata or {}), RECORD_KEY: self.to_record()}


def _metric(saved: Mapping[str, Any] | None, name: str) -> float | None:
    """A metric's value as saved (``save(..., metrics=...)`` stores a non-finite one as
    text), or None."""
    value = saved.get(name) if isinstance(saved, Mapping) else None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def saved_metrics(metadata: Mapping[str, Any]) -> Mapping[str, Any]:
    """The metrics a manifest's metadata holds (empty when none, or not a mapping)."""
    found = metadata.get(METRICS_KEY)
    return found if isinstance(found, Mapping) else {}
