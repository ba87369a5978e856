"""A rank that waited long in a collective for a late peer is not named hung once the peer
arrives: the waiting rank's last beat (up to an interval old) still shows it inside the
collective over its limit, but the late rank's own view knows that collective is over, or
that it has just entered it itself.

Checked on the rule (trainer.hangs.judge) and through a real heartbeat reading the stale
beat from a c10d store, as the late rank's watchdog sees it.
"""

from __future__ import annotations

import json
import time

import torch.distributed as dist

from trainer.hangs import HangRule, RankProgress, judge
from trainer.heartbeat import Heartbeat
from trainer.sections import Sections


def at(rank: int, section: str, mark: int, collectives: int, age: float,
       limit: float = 10.0) -> RankProgress:
    return RankProgress(rank, section, age, mark, collectives, limit)


def test_a_peer_seen_inside_a_collective_this_rank_completed_is_not_named():
    # rank 1 waited 11 s in collective 4 for rank 0; rank 0 came, the all-reduce finished,
    # rank 0 is in its optimizer step; rank 1's beat from just before still says collective
    view = {0: at(0, "optimizer", 41, 4, 0.01), 1: at(1, "collective", 40, 4, 11.0)}
    assert judge(view, me=0) is None
    # and a beat older still (rank 1 before collective 4, rank 0 past it)
    view = {0: at(0, "data", 42, 4, 0.01), 1: at(1, "optimizer", 36, 3, 11.0)}
    assert judge(view, me=0) is None


def test_a_peer_over_its_limit_beside_a_rank_that_just_arrived_is_not_named():
    # rank 0 has just entered collective 4, where rank 1 has waited 11 s for it
    view = {0: at(0, "collective", 40, 4, 0.02), 1: at(1, "collective", 40, 4, 11.0)}
    assert judge(view, me=0) is None
    assert judge(view) is None  # whoever looks: the collective is about to complete


def test_real_hangs_are_still_named():
    # rank 1 never came to collective 4: rank 0 (ahead, waiting) names it
    view = {0: at(0, "collective", 40, 4, 12.0), 1: at(1, "data", 37, 3, 11.0)}
    hang = judge(view, me=0)
    assert hang is not None and hang.culprits == [1]
    # rank 1's own view names itself
    assert judge(view, me=1).culprits == [1]
    # every rank inside collective 4 past its limit: all named, together
    view = {r: at(r, "collective", 40, 4, 12.0) for r in range(3)}
    hang = judge(view, me=2)
    assert hang is not None and hang.culprits == [0, 1, 2] and hang.together


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_late_ranks_watchdog_ignores_the_waiting_ranks_stale_beat():
    """Rank 0 (real Sections and Heartbeat on a TCPStore) was slow in its save, within the
    save's limit; rank 1 waited 11 s in collective 4, over its 10 s limit, and published
    that. Rank 0 then enters collective 4 (the all-reduce completes) and goes on. Before
    the fix rank 0's watchdog named rank 1 hung from that beat, ending a healthy job."""
    clock = Clock()
    sections = Sections(clock=clock)
    sections.begin_attempt()
    for step in range(1, 4):  # three steps of history: every section judged
        sections.step(step)
        for name in ("data", "forward", "backward", "collective", "optimizer", "save"):
            sections.enter(name)
            clock.now += 20.0 if name == "save" else 0.05
    sections.step(4)
    for name in ("data", "forward", "backward"):
        sections.enter(name)
        clock.now += 0.05
    sections.enter("collective")  # collective 4: rank 1 has waited there 11 s
    clock.now += 0.01
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = dist.PrefixStore("hb", dist.TCPStore("127.0.0.1", master.port, is_master=False))
    stale = {"step": 3, "seq": 90, "time": time.time(), "state": "alive",
             "section": "collective", "age": 11.0, "mark": sections.position().mark,
             "collectives": 4, "limit": 10.0, "stats": {}}
    master.set("hb/1", json.dumps(stale))
    rule = HangRule(factor=3.0, floor=1.0, ceiling=30.0)
    beat = Heartbeat(store, 0, 2, timeout=30.0, interval=0.05, sections=sections,
                     hang_rule=rule).start()
    try:
        deadline = time.monotonic() + 10
        while 1 not in beat.peer_payloads() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert beat.peer_payloads()[1]["section"] == "collective"
        assert beat.check() is None  # rank 0 just arrived: no verdict
        sections.enter("optimizer")  # the all-reduce completed; rank 1's beat is stale
        clock.now += 0.01
        assert beat.check() is None
    finally:
        beat.stop()
