"""Stragglers: ranks slower than their peers, scored per window of steps, and an optional drop.

A **window** is ``StragglerConfig.window`` consecutive steps (W, default 10) finished in this
attempt (steps a health rollback undid do not count). At the end of each window every rank
takes, from its progress markers (:class:`trainer.sections.Sections`), the mean time per
step it spent in each section during the window, and one all-gather of these rows gives
every rank the ``world x sections`` table. Every rank then computes the same scores, so a
decision to drop a rank is the same on every rank at the same step. (An all-gather, not a
sum: each rank can only report its own times. A time that is not a finite number of seconds
counts as 0.)

Scores (1.0 is typical, 2.0 twice as slow):

- **relative**, per rank and section: the rank's time over the *median of the ranks* (the
  lower middle value when the count is even, so that with two ranks the slower one is
  measured against the faster one);
- **vs_best**, per rank and section: the rank's time over its own best window so far in
  this attempt (a rank that slowed down since it started, even when all did);
- **overall**: the same two ratios over the sum of the sections where a rank works on its
  own (:data:`OWN_WORK`). The other sections wait on peers: with DDP the fast ranks wait
  for the slow one inside the gradient all-reduce of the backward pass, so those sections
  take as long on every rank and say nothing about who is slow.

Times below :data:`FLOOR_S` per step are raised to it before dividing: a section of a few
microseconds has ratios that are noise.

A rank whose overall relative score is at least ``threshold`` in a window is **flagged**
(logged, counted in the metrics, recorded). With ``drop=True`` a rank flagged in ``windows``
consecutive windows (N) is **dropped**: every rank leaves the attempt at the same step, the
others to be restarted by torchrun without it (:mod:`trainer.straggler_drop`).
A rank that keeps up from its start is dropped N windows after it began to lag
(:func:`detect_windows`); one that slows down mid-window may need one window more.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from trainer.metrics import format_event

#: One ``event key=value ...`` line per event (docs/observability.md lists them).
events = logging.getLogger("ckpt.trainer")

#: Sections in which a rank works on its own (no collective inside, under DDP).
OWN_WORK = ("data", "forward", "optimizer")
#: Per-step times below this many seconds are raised to it before a ratio is taken.
FLOOR_S = 1e-3
#: Up to this many ranks a window's record holds every rank's per-section tables.
DETAIL_RANKS = 16


def median_low(values: Sequence[float]) -> float:
    """The median; of an even count, the lower of the two middle values."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def ratio(t: float, ref: float, floor: float = FLOOR_S) -> float:
    """``t / ref`` with both raised to ``floor`` first."""
    return max(t, floor) / max(ref, floor)


def seconds_or_zero(value: Any) -> float:
    """``value`` as seconds: 0.0 for anything but a finite number >= 0 (a rank's report
    that is NaN, infinite or negative says nothing about its speed)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return 0.0
    return v if math.isfinite(v) and v >= 0 else 0.0


def slowest_section(seconds: Mapping[Any, Mapping[str, float]], rank: Any) -> str | None:
    """The section in which ``rank`` loses the most time per step against the median of
    the ranks (``seconds[rank][section]``). Seconds, not ratios: a section of microseconds
    may have the highest ratio and cost nothing."""
    row = seconds.get(rank) or {}
    if not row:
        return None
    excess = {s: t - median_low([r.get(s, 0.0) for r in seconds.values()])
              for s, t in row.items()}
    return max(sorted(excess), key=lambda s: excess[s])


@dataclasses.dataclass(frozen=True)
class WindowScores:
    """The scores of one window (ranks of this attempt)."""

    index: int                               # 0 for the attempt's first window
    first_step: int
    last_step: int
    seconds: dict[int, dict[str, float]]     # mean seconds per step, by rank and section
    relative: dict[int, dict[str, float]]    # over the median of the ranks
    vs_best: dict[int, dict[str, float]]     # over the rank's own best window
    overall: dict[int, float]                # relative, own-work sections summed
    overall_vs_best: dict[int, float]        # vs_best, own-work sections summed

    def slowest(self) -> int:
        """The rank with the highest overall score (the lowest rank on a tie)."""
        return max(sorted(self.overall), key=lambda r: self.overall[r])

    def worst_section(self, rank: int) -> str | None:
        """The section in which ``rank`` loses the most time against the others."""
        return slowest_section(self.seconds, rank)

    def to_record(self, detail: Iterable[int] | None = None) -> dict[str, Any]:
        """The window as JSON (ranks as strings, ratios to 3 decimals, seconds to 0.1 ms):
        every rank's overall scores, and the per-section tables and slowest section of the
        ``detail`` ranks (default: all)."""
        ranks = sorted(self.overall if detail is None else set(detail) & set(self.overall))

        def table(d: Mapping[int, Mapping[str, float]], digits: int) -> dict:
            return {str(r): {s: round(v, digits) for s, v in d[r].items()} for r in ranks}
        return {"window": self.index, "first_step": self.first_step,
                "last_step": self.last_step,
                "overall": {str(r): round(v, 3) for r, v in sorted(self.overall.items())},
                "overall_vs_best": {str(r): round(v, 3)
                                    for r, v in sorted(self.overall_vs_best.items())},
                "section": {str(r): self.worst_section(r) for r in ranks},
                "relative": table(self.relative, 3), "vs_best": table(self.vs_best, 3),
                "seconds": table(self.seconds, 4)}


class Scorer:
    """Scores the windows of one attempt in turn, remembering each rank's best.

    Args:
        sections: the section names, in the order of the rows' columns.
        own_work: the sections summed for the overall score (default :data:`OWN_WORK`).
        floor: see :data:`FLOOR_S`.
    """

    def __init__(self, sections: Sequence[str], own_work: Iterable[str] = OWN_WORK,
                 floor: float = FLOOR_S) -> None:
        self.sections = tuple(sections)
        self.own_work = tuple(s for s in self.sections if s in set(own_work))
        self.floor = float(floor)
        self.windows = 0
        self._best: dict[tuple[int, str], float] = {}   # (rank, section or "") -> seconds

    def _best_of(self, rank: int, key: str, t: float) -> float:
        best = min(self._best.get((rank, key), float("inf")), max(t, self.floor))
        self._best[(rank, key)] = best
        return best

    def score(self, table: Sequence[Sequence[float]], first_step: int,
              last_step: int) -> WindowScores:
        """Score one window: ``table[rank][i]`` is rank's mean seconds per step in
        ``sections[i]``."""
        if not table or any(len(row) != len(self.sections) for row in table):
            raise ValueError(f"a window's table needs one row of {len(self.sections)} "
                             f"section times per rank, got {[len(r) for r in table]}")
        ranks = range(len(table))
        seconds = {r: dict(zip(self.sections, map(seconds_or_zero, table[r]))) for r in ranks}
        relative: dict[int, dict[str, float]] = {r: {} for r in ranks}
        vs_best: dict[int, dict[str, float]] = {r: {} for r in ranks}
        for s in self.sections:
            median = median_low([seconds[r][s] for r in ranks])
            for r in ranks:
                t = seconds[r][s]
                relative[r][s] = ratio(t, median, self.floor)
                vs_best[r][s] = ratio(t, self._best_of(r, s, t), self.floor)
        own = {r: sum(seconds[r][s] for s in self.own_work) for r in ranks}
        median = median_low(list(own.values()))
        overall = {r: ratio(own[r], median, self.floor) for r in ranks}
        overall_vs_best = {r: ratio(own[r], self._best_of(r, "", own[r]), self.floor)
                           for r in ranks}
        scores = WindowScores(self.windows, first_step, last_step, seconds, relative,
                              vs_best, overall, overall_vs_best)
        self.windows += 1
        return scores


class DropPolicy:
    """Which rank to drop: one whose overall score reached ``threshold`` in ``windows``
    consecutive windows (the slowest of them if several; one rank per decision).

    ``streaks`` counts, per rank, the consecutive windows flagged so far.
    """

    def __init__(self, threshold: float, windows: int) -> None:
        if threshold <= 1.0:
            raise ValueError(f"a straggler threshold must be above 1.0 (times the median), "
                             f"not {threshold!r}")
        if windows < 1:
            raise ValueError(f"windows must be at least 1, not {windows!r}")
        self.threshold, self.windows = float(threshold), int(windows)
        self.streaks: dict[int, int] = {}

    def flagged(self, scores: WindowScores) -> list[int]:
        """The ranks at or above the threshold in this window."""
        return [r for r, v in sorted(scores.overall.items()) if v >= self.threshold]

    def observe(self, scores: WindowScores) -> int | None:
        """Count this window; the rank to drop now, or None."""
        flagged = set(self.flagged(scores))
        self.streaks = {r: (self.streaks.get(r, 0) + 1 if r in flagged else 0)
                        for r in scores.overall}
        due = [r for r, n in self.streaks.items() if n >= self.windows]
        if not due or len(scores.overall) < 2:
            return None
        return max(sorted(due), key=lambda r: scores.overall[r])


# ------------------------------------------------------------------------------- in the trainer


class StragglerWatch:
    """Scores the ranks of one attempt at the end of every window; drops a straggler.

    Args:
        config: a :class:`trainer.config.StragglerConfig`.
        attempt: the attempt's rank, world size and whether it has peers
            (:class:`trainer.launch.Attempt`).
        sections: this rank's progress markers (:class:`trainer.sections.Sections`); a
            window's times are differences of their sections' cumulative ``total``.
        records, metrics: where scores are written (run records: rank 0 only; the metrics on
            every rank, exported by rank 0).
        exits: the attempt's :class:`trainer.exits.ExitPolicy`, to leave on a drop
            (:func:`trainer.straggler_drop.leave_for_drop`).
        names: the sections scored (default: the trainer's own).
        can_drop: whether a drop can be carried out (torchrun restarts the others).
    """

    def __init__(self, config: Any, *, attempt: Any, sections: Any, records: Any = None,
                 metrics: Any = None, exits: Any = None, names: Sequence[str] | None = None,
                 own_work: Iterable[str] = OWN_WORK, can_drop: bool = True) -> None:
        if names is None:
            from trainer.sections import TRAINER_SECTIONS

            names = TRAINER_SECTIONS
        self.config, self.attempt, self.sections = config, attempt, sections
        self.records, self.metrics, self.exits = records, metrics, exits
        self.scorer = Scorer(names, own_work)
        self.policy = DropPolicy(config.threshold, config.windows)
        self.can_drop = can_drop
        self.last: WindowScores | None = None
        self._start = self._totals()
        self._steps = 0
        self._first: int | None = None

    def _totals(self) -> list[float]:
        stats = self.sections.stats()
        return [float(getattr(stats.get(n), "total", 0.0)) for n in self.scorer.sections]

    def restart_window(self) -> None:
        """Start a new window now (after a restore: its time is no step's)."""
        self._start, self._steps, self._first = self._totals(), 0, None

    def step_done(self, step: int, handle: Any = None) -> WindowScores | None:
        """``step`` finished (every rank calls this after the same steps). At the end of a
        window: exchange, score, report and maybe drop (``handle``: the save of ``step``
        in flight, if any). Returns the window's scores, None mid-window."""
        if self._first is None:
            self._first = step
        self._steps += 1
        if self._steps < self.config.window:
            return None
        import torch  # here: the run summary imports this module without torch

        totals = self._totals()
        # A collective like the step's agreement: every rank enters it at the same step, so
        # the hang detector judges it too (its wait counts in the next window).
        self.sections.enter("collective")
        row = torch.tensor([(t - t0) / self._steps for t, t0 in zip(totals, self._start)],
                           dtype=torch.float64)
        scores = self.last = self.scorer.score(self._gather(row), self._first, step)
        self._start, self._steps, self._first = totals, 0, None
        flagged = self.policy.flagged(scores)
        drop = self.policy.observe(scores)  # counts the streaks even when drops are off
        if not (self.config.drop and self.can_drop):
            drop = None
        self._report(scores, flagged, drop)
        if drop is not None and self.exits is not None:
            from trainer.straggler_drop import leave_for_drop

            leave_for_drop(self.exits, drop, step, handle, score=scores.overall[drop],
                           windows=self.policy.streaks[drop],
                           section=scores.worst_section(drop))
        return scores

    def _gather(self, row: Any) -> list[list[float]]:
        """Every rank's row, by rank (the same table on every rank)."""
        if not self.attempt.collective:
            return [row.tolist()]
        import torch
        import torch.distributed as dist

        rows = [torch.empty_like(row) for _ in range(self.attempt.world_size)]
        dist.all_gather(rows, row)
        return [r.tolist() for r in rows]

    def _report(self, scores: WindowScores, flagged: list[int], drop: int | None) -> None:
        rank = self.attempt.rank
        if self.metrics is not None:
            self.metrics.stragglers_scored(scores.overall, scores.relative,
                                           scores.overall_vs_best, flagged=len(flagged),
                                           dropped=drop is not None)
        if rank != 0:
            return
        if self.records is not None:
            # Per-section tables of every rank for a small job; of the flagged and the
            # slowest rank only past DETAIL_RANKS ranks (a record per window, for the run).
            detail = (None if len(scores.overall) <= DETAIL_RANKS
                      else {*flagged, scores.slowest()})
            self.records.record("stragglers", **scores.to_record(detail), flagged=flagged,
                                streaks={str(r): n for r, n in self.policy.streaks.items()},
                                dropped=drop, window_steps=self.config.window,
                                threshold=self.config.threshold, drop_after=self.config.windows
                                if self.config.drop else None)
        for r in flagged:
            events.warning(format_event(
                "train.straggler", rank=rank, straggler=r, step=scores.last_step,
                score=round(scores.overall[r], 3),
                vs_best=round(scores.overall_vs_best[r], 3),
                section=scores.worst_section(r), windows=self.policy.streaks.get(r, 0),
                threshold=self.config.threshold,
                action="drop" if r == drop else "none"))


def watch_for(trainer: Any, parts: Any) -> StragglerWatch | None:
    """The straggler watch of an attempt of ``trainer`` (an ElasticTrainer) whose parts are
    built; None when scores are off or there is one rank. Only data and the optimizer step
    count as own work when the forward waits for the peers: under FSDP (it gathers the
    parameters), and under DDP for a model with buffers (DDP broadcasts them from rank 0 at
    the start of each forward: the others wait there for a rank slow in its data, and the
    forward would make every rank look as slow as it). A drop needs torchrun (which
    restarts the others); elsewhere ranks are flagged only."""
    config = trainer.config.stragglers
    if not config.enabled or not parts.attempt.collective:
        return None
    module = getattr(parts, "module", None)
    has_buffers = module is not None and any(True for _ in module.buffers())
    own_work = ("data", "optimizer") if trainer.config.step.fsdp or has_buffers else OWN_WORK
    return StragglerWatch(config, attempt=parts.attempt, sections=trainer.sections,
                          records=parts.records, metrics=trainer.metrics, exits=parts.exits,
                          own_work=own_work, can_drop=trainer.elastic)


# ------------------------------------------------------------------------------- the summary


def _rank_key(value: Any) -> str | None:
    """A rank as the records key it: a decimal string, None for anything else. ASCII
    digits only, and few: ``str.isdigit`` also takes '²' (which ``int`` refuses), and
    ``int`` refuses more than 4300 digits; a hand-edited record must not end the summary."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None
    text = str(value)
    return text if text.isascii() and text.isdigit() and len(text) <= 18 else None


def _window_record(rec: Any) -> dict[str, Any] | None:
    """A ``stragglers`` record as the summary reads it, None when it is not one (a torn
    line, or a record not written by :class:`StragglerWatch`): the summary skips it."""
    if not isinstance(rec, Mapping):
        return None
    overall, seconds = rec.get("overall"), rec.get("seconds", {})
    sections = rec.get("section", {})
    if not isinstance(overall, Mapping) or not isinstance(seconds, Mapping) \
            or not isinstance(sections, Mapping):
        return None
    overall = {k: v for k, v in overall.items() if _rank_key(k) is not None
               and isinstance(v, (int, float)) and math.isfinite(v)}
    if not overall:
        return None
    seconds = {k: v for k, v in seconds.items() if _rank_key(k) is not None
               and isinstance(v, Mapping)
               and all(isinstance(t, (int, float)) for t in v.values())}
    flagged = rec.get("flagged", [])
    flagged = [_rank_key(r) for r in flagged] if isinstance(flagged, list) else []
    streaks = rec.get("streaks", {})
    streaks = ({k: v for k, v in streaks.items() if _rank_key(k) is not None
                and type(v) is int} if isinstance(streaks, Mapping) else {})
    steps = [rec.get(k) for k in ("first_step", "last_step")]
    sections = {k: v for k, v in sections.items() if k in overall and isinstance(v, str)}
    return {"overall": overall, "seconds": seconds, "section": sections,
            "flagged": [r for r in flagged if r is not None and r in overall],
            "dropped": _rank_key(rec.get("dropped")),
            "streaks": streaks,
            "first_step": steps[0] if isinstance(steps[0], int) else None,
            "last_step": steps[1] if isinstance(steps[1], int) else None,
            "window_steps": rec.get("window_steps"), "threshold": rec.get("threshold")}


def summarize(windows: Sequence[tuple[int, Mapping[str, Any]]]) -> dict[str, Any] | None:
    """The run summary's ``stragglers``: from the ``stragglers`` records of every attempt
    (``(attempt, record)``, oldest first); None when no window was scored. Records that are
    not well-formed are skipped.

    ``last``: the newest window's overall scores by rank (ranks of that attempt);
    ``worst``: the highest overall score of the run; ``flagged``: per attempt and rank, the
    windows at or above the threshold; ``dropped``: the ranks dropped, with the step.
    """
    windows = [(a, w) for a, rec in windows if (w := _window_record(rec)) is not None]
    if not windows:
        return None
    flagged: dict[tuple[int, str], dict[str, Any]] = {}
    dropped, worst = [], None
    for attempt, rec in windows:
        overall = rec.get("overall", {})
        for r, score in overall.items():
            section = rec["section"].get(r) or slowest_section(rec["seconds"], r)
            if worst is None or score > worst["score"]:
                worst = {"attempt": attempt, "rank": int(r), "score": score,
                         "section": section, "step": rec.get("last_step")}
        for r in rec["flagged"]:
            key = (attempt, r)
            f = flagged.setdefault(key, {"attempt": attempt, "rank": int(r), "windows": 0,
                                         "first_step": rec.get("first_step"), "max_score": 0})
            f["windows"] += 1
            f["last_step"] = rec.get("last_step")
            f["max_score"] = max(f["max_score"], overall.get(str(r), 0))
        if rec["dropped"] is not None:
            r = rec["dropped"]
            dropped.append({"attempt": attempt, "rank": int(r), "step": rec.get("last_step"),
                            "score": overall.get(r),
                            "windows": rec["streaks"].get(r)})
    attempt, newest = windows[-1]
    return {"window_steps": newest.get("window_steps"), "threshold": newest.get("threshold"),
            "windows": len(windows),
            "last": {"attempt": attempt, "step": newest.get("last_step"),
                     "overall": dict(newest.get("overall", {}))},
            "worst": worst, "flagged": list(flagged.values()), "dropped": dropped}


def describe(summary: Mapping[str, Any] | None) -> str | None:
    """One line for the run summary's text (None when nothing was flagged)."""
    if not summary or not (summary.get("flagged") or summary.get("dropped")):
        return None
    parts = [f"rank {f['rank']} (attempt {f['attempt']}) slow in {f['windows']} window(s), "
             f"up to {f['max_score']:.2f}x the median" for f in summary["flagged"]]
    parts += [f"dropped rank {d['rank']} of attempt {d['attempt']} at step {d['step']} after "
              f"{d['windows']} window(s)" for d in summary["dropped"]]
    return f"  stragglers (windows of {summary['window_steps']} steps): " + "; ".join(parts)


def detect_windows(windows: int | None = None) -> int:
    """Windows from the start of a lag to the drop of a rank that lags a whole window or
    more: ``windows`` (the config's N; default :class:`trainer.config.StragglerConfig`'s)."""
    if windows is None:
        from trainer.config import StragglerConfig

        windows = StragglerConfig().windows
    return int(windows)


__all__ = ["DETAIL_RANKS", "DropPolicy", "FLOOR_S", "OWN_WORK", "Scorer", "StragglerWatch",
           "WindowScores", "describe", "detect_windows", "median_low", "ratio",
           "seconds_or_zero", "slowest_section", "summarize", "watch_for"]
