"""When a rank's training thread has stopped making progress, and which rank holds the job up.

A heartbeat thread keeps beating while the training thread is stuck (in a data loader, in
a storage call, spinning in Python, waiting in a collective), so liveness says nothing;
the progress markers (:mod:`trainer.sections`) do. The rule:

- A section's **limit** is ``factor`` times its typical duration in this run, and never
  less than ``factor`` typical steps (a short section's jitter is measured against the
  step), clamped to ``[floor, ceiling]``; and never less than 1.5 times the longest this
  section has taken in this process (what was slow once and finished is not a hang).
  A section seen fewer than ``min_count`` times, and the unjudged ones (``restore``,
  ``user``, ``idle``, ``finish``), have no limit.
- ``save_wait`` (a due save waiting for the previous async save to be written) is the
  storage's time, not the rank's: its limit is the save's deadline (``save_deadline``), not
  a multiple of the typical step, so ranks that all wait there on a slow storage are not
  named (the manager logs ``ckpt.save_slow`` instead). Past the deadline the storage is
  taken for stuck: a rank alone there (the others gone on) is named, or all of them
  together, as a storage hang.
- Every rank passes the same sections in the same order, so the rank with the **lowest
  mark** is the one the others wait for. A rank is **hung** when it has the lowest mark
  and has been in its section longer than the section's limit. Ranks ahead of it (waiting
  in collective N it never entered) are never named. When all ranks share the lowest mark
  (all inside collective N, say) and are over the limit, all are named.
- No verdict while a rank at the lowest mark is still within its limit: it arrived there
  lately, so the job is moving (a rank over the limit beside it in a collective waited for
  it). Nor while a peer's beat shows it before or inside a collective that this rank has
  completed: every rank entered that collective, so the beat is older than the peer's
  position (a beat is up to an interval old) and the peer is no culprit of the moment.

Each rank judges its own section on its own clock and publishes the age, the limit and,
once over the limit, its training thread's Python stack with its beat (peers never
extrapolate another rank's age: they use what that rank said of itself).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import traceback
from typing import Any

from trainer.sections import NAME_CHARS, SAVE_WAIT, UNJUDGED

#: A stack published with a beat is cut to this many characters (its innermost frames).
STACK_CHARS = 6000


@dataclasses.dataclass(frozen=True)
class HangRule:
    """How long a section may stand still (module docstring).

    Args:
        factor: k, the multiple of the typical duration.
        floor, ceiling: bounds of ``factor x typical`` in seconds.
        min_count: observations of a section before it is judged.
        save_deadline: the limit of ``save_wait`` in seconds: how long one async save may
            take to be written (as long as ``ckpt.SaveOptions``' default commit timeout).
    """

    factor: float = 3.0
    floor: float = 10.0
    ceiling: float = 30.0
    min_count: int = 2
    save_deadline: float = 600.0

    def __post_init__(self) -> None:
        if self.factor <= 1 or self.floor <= 0 or self.ceiling < self.floor:
            raise ValueError(f"hang rule needs factor > 1 and 0 < floor <= ceiling, not "
                             f"factor={self.factor} floor={self.floor} "
                             f"ceiling={self.ceiling}")
        if self.min_count < 1:
            raise ValueError(f"min_count must be at least 1, not {self.min_count}")
        if not self.save_deadline > 0:
            raise ValueError(f"save_deadline must be positive, not {self.save_deadline}")

    def limit(self, section: str, stats: dict[str, dict[str, float]]) -> float | None:
        """Seconds ``section`` may last given the run's ``stats`` (a payload's ``stats``);
        None when it is not judged."""
        if section in UNJUDGED:
            return None
        if section == SAVE_WAIT:
            return self.save_deadline  # the storage's time: bounded by the save's deadline
        own = stats.get(section)
        if own is None or own["count"] < self.min_count:
            return None
        typical = own["typical"]
        step = stats.get("step")
        if step is not None and step["count"] >= self.min_count:
            typical = max(typical, step["typical"])
        bounded = min(self.ceiling, max(self.floor, self.factor * typical))
        return max(bounded, 1.5 * own["worst"])


@dataclasses.dataclass(frozen=True)
class RankProgress:
    """One rank's progress as it published it (or, for this rank, as it is now)."""

    rank: int
    section: str
    age: float
    mark: int
    collectives: int
    limit: float | None
    step: int | None = None
    stack: str | None = None

    @property
    def over(self) -> bool:
        return self.limit is not None and self.age > self.limit

    @classmethod
    def from_payload(cls, rank: int, payload: Any) -> "RankProgress | None":
        """From a beat's payload; None when it carries no progress (no markers yet) or
        progress that does not make sense (anyone who reaches the store can write a beat:
        it must not crash the watchdog, nor fill the records with its text)."""
        try:
            section, stack, step = payload["section"], payload.get("stack"), payload.get("step")
            age, limit = float(payload["age"]), payload.get("limit")
            limit = None if limit is None else float(limit)
            mark, collectives = payload["mark"], payload["collectives"]
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        numbers = [age] + ([] if limit is None else [limit])
        if (not isinstance(section, str) or len(section) > NAME_CHARS
                or not all(math.isfinite(x) and x >= 0 for x in numbers)
                or not all(type(x) is int for x in (mark, collectives))
                or not (step is None or type(step) is int)):
            return None
        return cls(rank, section, age, mark, collectives, limit, step,
                   stack[-STACK_CHARS:] if isinstance(stack, str) else None)


@dataclasses.dataclass(frozen=True)
class Hang:
    """A verdict: the ranks that hold the job up, where they are, and the others."""

    culprits: list[int]
    progress: dict[int, RankProgress]   # every rank judged (culprits and the waiting)

    @property
    def together(self) -> bool:
        """All ranks are stuck at the same place (none is behind the others)."""
        return len({p.mark for p in self.progress.values()}) == 1

    def describe(self) -> str:
        parts = []
        for r in self.culprits:
            p = self.progress[r]
            parts.append(f"rank {r} in {section_name(p)} for {p.age:.1f}s (limit "
                         f"{p.limit:.1f}s, step {p.step})")
        waiting = sorted(set(self.progress) - set(self.culprits))
        text = "; ".join(parts)
        if waiting:
            where = sorted({section_name(self.progress[r]) for r in waiting})
            text += f"; ranks {waiting} wait for it in {', '.join(where)}"
        elif self.together and all(p.section == SAVE_WAIT for p in self.progress.values()):
            text += "; every rank waits for its previous save (the storage is stuck)"
        elif self.together and len(self.culprits) > 1:
            text += "; no rank is behind the others (a communication or shared-storage hang)"
        return text


def section_name(p: RankProgress) -> str:
    """``collective 57`` for a collective, else the section's name."""
    return f"collective {p.collectives}" if p.section == "collective" else p.section


def completed(p: RankProgress) -> int:
    """The agreement collectives ``p``'s rank has come out of (every rank entered them)."""
    return p.collectives - (p.section == "collective")


def judge(progress: dict[int, RankProgress], me: int | None = None) -> Hang | None:
    """The ranks that hold the job up (module docstring), None while none does.

    ``me``: the rank whose view this is (its own progress is current, the peers' as they
    last published it); peers' beats older than what ``me`` knows are not judged."""
    if not progress:
        return None
    if me is not None and me in progress:
        done = completed(progress[me])
        if any(p.collectives < done or (p.collectives == done and p.section == "collective")
               for r, p in progress.items() if r != me):
            return None  # a stale beat: the peer's next one says where it is now
    low = min(p.mark for p in progress.values())
    lowest = [r for r, p in progress.items() if p.mark == low]
    if any(progress[r].limit is not None and not progress[r].over for r in lowest):
        return None  # a rank came to the lowest mark lately: the job is moving
    culprits = sorted(r for r in lowest if progress[r].over)
    return Hang(culprits, dict(progress)) if culprits else None


def thread_stack(thread_id: int) -> str | None:
    """The Python stack of thread ``thread_id`` now (innermost frames last), or None if
    that thread is gone. Read from another thread: the stuck thread need not cooperate."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return None
    text = "".join(traceback.format_stack(frame))
    return text[-STACK_CHARS:]


__all__ = ["Hang", "HangRule", "RankProgress", "STACK_CHARS", "completed", "judge",
           "section_name", "thread_stack"]
