"""A replaced node's ranks restore from the replicas other nodes hold, each replicated byte
fetched over the network once for the node: one rank fetches a chunk, its node-mates
receive it from that rank and check its digest. World 4 on gloo, two "nodes" of two ranks
(names given to the memory tier); node B is lost and node C takes its ranks. The bytes the
holders send are counted where they leave. Bodies in tests/support/peer_shared_workers.py.

These ranks share one host, where by default node-mates each fetch their own (the network is
a copy in memory there); after the first test the workers turn the sharing on, as ranks on
several hosts have it."""

from __future__ import annotations

import pytest

from tests.support.peer_shared_workers import replaced_node_restores
from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shared")
    shm = tmp / "shm"
    shm.mkdir()
    return run_ranks(4, replaced_node_restores, str(tmp / "root"), str(shm), timeout=150)


def served(runs: list[dict], case: str) -> float:
    """The bytes every holder sent for one restore, in multiples of the state."""
    return sum(r[case]["served"] for r in runs) / runs[0][case]["state"]


def test_on_one_host_by_default_each_rank_fetches_its_own(runs):
    for r in runs:
        assert r["one_host"]["step"] == 2 and r["one_host"]["exact"], r["one_host"]
    assert 2.0 <= served(runs, "one_host") < 2.1


def test_the_replaced_nodes_ranks_fetch_each_replicated_byte_once(runs):
    """Node C's two ranks need the whole DDP state from node A: the holders send it once
    (before: once per rank, 2.0x), and every rank ends bit-exact, none reading the root."""
    for r in runs:
        assert r["one_pass"]["step"] == 2 and r["one_pass"]["exact"], r["one_pass"]
        assert r["one_pass"]["from_storage"] == 0
    assert [r["one_pass"]["tier"] for r in runs] == ["memory", "memory", "peer", "peer"]
    assert 1.0 <= served(runs, "one_pass") < 1.05  # (+ each rank's file headers)


def test_a_strict_restore_fetches_them_once_per_pass(runs):
    """Verify, then apply: the fetching rank reads its share twice; 2.0x, not 4.0x."""
    assert all(r["strict"]["step"] == 2 and r["strict"]["exact"] for r in runs)
    assert 2.0 <= served(runs, "strict") < 2.1


def test_when_the_exchange_cannot_send_every_rank_fetches_for_itself(runs):
    """The chunk exchange's sends fail (a closed connection): every rank learns it at the
    next agreement, says so in the log, and fetches what it still lacks from the holders
    itself (the ranges stayed planned), only what the exchange did not bring it; bit-exact
    from memory all the same."""
    for r in runs:
        out = r["cannot_send"]
        assert out["step"] == 2 and out["exact"] and out["from_storage"] == 0, out
        assert out["logged"] and "Connection closed by peer" in out["logged"][0]
    # The shared fetch (1.0x), then each of node C's ranks what its node-mate fetched for
    # it (1.0x in all): what a rank read itself is in place, checked, and not read again.
    assert 2.0 <= served(runs, "cannot_send") < 2.1


def test_a_node_mate_sending_wrong_bytes_fails_the_step_on_every_rank_alike(runs):
    """Rank 2 reads its share (its digests pass), then damages what it sends: rank 3 refuses
    it, and every rank gives up step 2 from memory for the same reason and restores the next
    source, the root's step 1, bit-exact."""
    reasons = {str(r["bad_mate"]["skipped"]) for r in runs}
    assert len(reasons) == 1, reasons
    for r in runs:
        out = r["bad_mate"]
        assert (out["step"], out["tier"], out["exact"]) == (1, "storage", True), out
        assert out["skipped"] and all(s == 2 for s, _, _ in out["skipped"])
        assert "digest mismatch" in out["skipped"][0][2]
        assert "as received from rank 2" in out["skipped"][0][2]


def test_a_holder_serving_wrong_bytes_fails_the_copy_on_every_rank_alike(runs):
    """Rank 0 (node A) serves damaged data: the node C rank that fetched it finds the digest
    mismatch, every rank gives up that copy for the same reason, and step 2 is restored
    bit-exact from its other copies."""
    reasons = {str(r["bad_holder"]["skipped"]) for r in runs}
    assert len(reasons) == 1, reasons
    for r in runs:
        out = r["bad_holder"]
        assert (out["step"], out["exact"], out["from_storage"]) == (2, True, 0), out
        assert [(s, t) for s, t, _ in out["skipped"]] == [(2, "memory")]
        assert "digest mismatch" in out["skipped"][0][2]
