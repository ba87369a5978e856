"""A section name the heartbeat cannot publish (longer than the peers accept) is refused
where the user gives it, with the limit in the message; and if one reaches the markers all
the same, the rank beats on without progress: its beat never fails (its peers would find it
silent and restart the job without it; its own watchdog thread would die).
"""

from __future__ import annotations

import json
import time

import pytest
import torch.distributed as dist

from trainer.hangs import HangRule
from trainer.heartbeat import Heartbeat
from trainer.sections import NAME_CHARS, Sections


def test_a_user_section_name_longer_than_a_beat_carries_is_refused():
    sections = Sections()
    with pytest.raises(ValueError, match=f"1 to {NAME_CHARS} characters"):
        with sections.user("evaluate-" + "x" * NAME_CHARS):
            pass
    with sections.user("e" * NAME_CHARS):  # the longest that fits
        assert sections.position().section == "e" * NAME_CHARS


def test_a_section_the_peers_would_refuse_is_beaten_without_progress():
    sections = Sections()
    sections.begin_attempt()
    for step in range(1, 4):  # every section judged
        sections.step(step)
        sections.enter("data")
        sections.enter("collective")
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    lost: list = []
    beat = Heartbeat(dist.PrefixStore("hb", master), 0, 1, timeout=5.0, interval=0.05,
                     on_lost=lost.append, sections=sections,
                     hang_rule=HangRule(factor=2.0, floor=0.05, ceiling=1.0)).start()
    try:
        sections.enter("x" * (NAME_CHARS + 1))
        time.sleep(0.3)
        first = json.loads(master.get("hb/0"))
        time.sleep(0.3)
        later = json.loads(master.get("hb/0"))
    finally:
        beat.stop()
    assert later["seq"] > first["seq"]  # it beats on (peers would find it silent, lost)
    assert later["state"] == "alive" and "section" not in later
    assert lost == [] and beat.reported is None
