"""The holder's side of the restore protocol checks what a peer asks before serving it: a
request ckpt's own reader never sends is logged and not answered (or answered with a bounded
number of zero bytes), and the serving thread goes on answering the ordinary requests. Real
gloo processes; the body is in tests/support/hostile_peer_workers.py."""

from __future__ import annotations

import pytest

from ckpt._memory.peer_server import ANSWER_MAX

from tests.support.hostile_peer_workers import serve_hostile_requests
from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.multiproc]


def test_hostile_requests_do_not_stop_the_serving_thread(tmp_path):
    """Rounds with pieces of 0, negative or huge size, negative or huge tags, an unknown kind,
    more planned ranges than there are or a negative count of them, a repeated round of a
    kind; READs with bad tags, an unknown op: none kills the server, none
    makes it allocate what it was asked (a READ of 1 TiB is answered with at most ANSWER_MAX
    zero bytes), and it then serves a READ and a round as usual and ends at DONE."""
    holder, reader = run_ranks(2, serve_hostile_requests, str(tmp_path), timeout=90)
    assert holder == {"errors": []}
    assert reader == {"ones": True, "huge_zeros": ANSWER_MAX, "bad_zeros": 10, "read": True,
                      "round": True}
