"""Waiting for the previous async save is the storage's time, not a hung rank: when storage
slows down, every rank waits at its next due save for longer than a step's section may last;
the watchdog must not name a culprit (and end a healthy job) for that. A rank really stuck
elsewhere is still named.

Driven through the loop's own commit of a step (``TrainingLoop._commit_step``) with real
progress markers; the slow storage is a checkpointer whose previous write takes 40 s on the
markers' clock (10 x the typical save) while every rank publishes where it is.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

from trainer.hangs import HangRule, RankProgress, judge
from trainer.loop import TrainingLoop
from trainer.sections import Sections

RULE = HangRule()  # the defaults: 3 x typical, 10 s floor, 30 s ceiling
STEP_SECTIONS = ("data", "forward", "backward", "collective", "optimizer")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def progress(rank: int, sections: Sections) -> RankProgress:
    """What ``rank`` publishes with its beat (trainer.heartbeat does the same)."""
    p = sections.payload()
    return RankProgress(rank, p["section"], p["age"], p["mark"], p["collectives"],
                        RULE.limit(p["section"], p["stats"]), sections.position().step)


class SlowStorage:
    """A checkpointer whose previous write is still going: the due save waits ``wait_s``
    for it (inside ``save`` when nobody waited before, as ``CheckpointManager.save`` does),
    and every rank's view is judged while it waits."""

    def __init__(self, clock: Clock, ranks: dict[int, Sections], wait_s: float,
                 parties: int | None = None) -> None:
        self.clock, self.ranks, self.wait_s = clock, ranks, wait_s
        # every rank's training thread is in the wait at once (each rank commits on its own)
        self.together = threading.Barrier(parties or len(ranks))
        self.verdicts: list = []
        self.waited = False

    def due(self, step: int) -> bool:
        return step % 10 == 0

    def wait_previous(self, step: int, **_: object) -> float:
        self._wait()
        return self.wait_s

    def save(self, step: int, meta: dict, *, stop: str | None = None) -> object | None:
        if not self.due(step):
            return None
        if not self.waited:
            self._wait()
        self.waited = False
        self.clock.now += 1.0  # the snapshot
        return object()

    def _wait(self) -> None:
        if self.together.wait(timeout=10) == 0:
            self.clock.now += self.wait_s
            view = {r: progress(r, s) for r, s in self.ranks.items()}
            self.verdicts.append(judge(view, me=0))
        self.together.wait(timeout=10)
        self.waited = True


def loop_of(sections: Sections, checkpointer: SlowStorage) -> SimpleNamespace:
    records = SimpleNamespace(audit=lambda *a, **k: None, record=lambda *a, **k: None)
    parts = SimpleNamespace(checkpointer=checkpointer, records=records, heartbeat=None,
                            step=0)
    return SimpleNamespace(parts=parts, trainer=SimpleNamespace(sections=sections),
                           _meta=lambda step, loss: {"step": step})


def run_step(step: int, clock: Clock, ranks: dict[int, Sections], storage: SlowStorage,
             *, skip: tuple[int, ...] = ()) -> None:
    """Every rank (but ``skip``) does step ``step``: 1 s of sections, then the commit."""
    batch = SimpleNamespace(mine=[0], micro=[[0]])
    for r, s in ranks.items():
        if r in skip:
            continue
        s.step(step)
        for name in STEP_SECTIONS:
            s.enter(name)
            clock.now += 0.2 / len(ranks)
    threads = [threading.Thread(target=TrainingLoop._commit_step,
                                args=(loop_of(s, storage), step, 1.0, 0.5, batch))
               for r, s in ranks.items() if r not in skip]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)


def history(clock: Clock, ranks: dict[int, Sections], storage: SlowStorage,
            steps: int) -> None:
    """``steps`` steps at 1 s, a save every 10 taking 1 s: every section judged."""
    for s in ranks.values():
        s.begin_attempt()
    for step in range(1, steps + 1):
        run_step(step, clock, ranks, storage)
    storage.verdicts.clear()


def test_every_rank_waiting_on_a_slow_save_is_not_a_hang():
    clock = Clock()
    ranks = {r: Sections(clock=clock) for r in range(3)}
    fast = SlowStorage(clock, ranks, wait_s=0.0)
    history(clock, ranks, fast, 30)
    # the storage slows down: the previous write now takes 40 s more, past the old limit
    slow = SlowStorage(clock, ranks, wait_s=40.0)
    for step in range(31, 41):
        run_step(step, clock, ranks, slow)
    assert slow.verdicts, "the due save did not wait"
    assert all(v is None for v in slow.verdicts), slow.verdicts[0].describe()
    # the wait is published as its own section, bounded by the save's deadline
    assert progress(0, ranks[0]).section == "save"  # (back in the save once written)
    assert RULE.limit("save_wait", {}) == RULE.save_deadline


def test_every_rank_waiting_past_the_saves_deadline_is_a_storage_hang():
    clock = Clock()
    ranks = {r: Sections(clock=clock) for r in range(2)}
    history(clock, ranks, SlowStorage(clock, ranks, wait_s=0.0), 20)
    stuck = SlowStorage(clock, ranks, wait_s=RULE.save_deadline + 1)
    for step in range(21, 31):
        run_step(step, clock, ranks, stuck)
    hang = stuck.verdicts[-1]
    assert hang is not None and hang.culprits == [0, 1]
    assert "storage is stuck" in hang.describe()


def test_a_rank_stuck_in_forward_is_still_named_while_a_peer_waits_on_its_save():
    clock = Clock()
    ranks = {r: Sections(clock=clock) for r in range(2)}
    history(clock, ranks, SlowStorage(clock, ranks, wait_s=0.0), 30)
    # step 31: rank 0 gets stuck in forward; rank 1's previous write is slow (40 s)
    ranks[0].step(31)
    ranks[0].enter("data")
    ranks[0].enter("forward")
    ranks[1].step(31)
    for name in STEP_SECTIONS:
        ranks[1].enter(name)
    slow = SlowStorage(clock, ranks, wait_s=40.0, parties=1)
    slow.due = lambda step: True  # type: ignore[method-assign]
    loop = loop_of(ranks[1], slow)
    TrainingLoop._commit_step(loop, 31, 1.0, 0.5, SimpleNamespace(mine=[0], micro=[[0]]))
    # rank 0 has the lowest mark and is over its forward limit: named, though rank 1 is
    # in its save wait (within the save's deadline)
    hang = slow.verdicts[-1]
    assert hang is not None and hang.culprits == [0], hang and hang.describe()
    assert hang.progress[1].section == "save_wait" and not hang.progress[1].over
    assert "rank 0 in forward" in hang.describe()
