"""A peer that is alive but stuck must not hold the rank that serves it forever:
``MemorySource.close`` gives up on peers that made no progress for ``STALL_S``, with a
warning naming them. Real gloo processes; the body is in tests/support/memory_workers.py."""

from __future__ import annotations

import pytest

from tests.support.ranks import run_ranks
from tests.support.memory_workers import serve_a_stuck_peer

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def test_close_gives_up_on_a_stuck_peer_with_a_warning(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    out = run_ranks(2, serve_a_stuck_peer, str(tmp_path / "root"), str(shm), "stall",
                    ["hostS_n0", "hostS_n1"], str(tmp_path / "flag"), timeout=60)
    assert out[1]["tier"] == "peer"  # rank 1 really depended on rank 0's serving
    # Rank 0's close returned while rank 1 was stuck (else rank 1 would wait for the flag
    # forever and the ranks would time out), saying why:
    assert out[0]["serving_after_close"]
    assert [w for w in out[0]["warnings"] if "ranks [1]" in w and "giving up" in w]
    assert not out[0]["serving_at_end"]  # the peer recovered: the serving thread ended
