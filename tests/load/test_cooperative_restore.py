"""Cooperative restore: under a process group, a chunk that several ranks need (a DDP
model's, or one replica of an HSDP shard) is read from the root once, by one rank, and sent
to the others; every rank ends bit-exact, and a chunk that fails on the rank that read it
fails the step on every rank alike.

The ranks of these tests share one host, where restores from a file system read plainly by
default (the page cache already reads the disk once for all); the workers switch the
cooperation on, as ranks on several hosts have it."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import ckpt

from tests.support import cooperative_workers as workers
from tests.support.ranks import run_ranks
from tests.support.s3_fixture import _moto, s3  # noqa: F401  (fixtures)

pytestmark = pytest.mark.multiproc


def test_each_rank_reads_only_its_share_and_every_rank_ends_bit_exact(tmp_path):
    """World 4: a replicated state plus a tensor replicated over one mesh dimension and
    sharded over the other. The bytes read from the root, counted as last_restore counts
    them, sum to the checkpoint once (not 4 times), each rank's about a quarter."""
    results = run_ranks(4, workers.restore_replicated, str(tmp_path / "root"), timeout=90)
    total = results[0]["checkpoint"]
    for r in results:
        assert r["step"] == 2 and r["exact"], r
        assert r["ranks"] == results[0]["ranks"]  # the same account on every rank
        assert r["mine"] < 0.4 * total, (r["mine"], total)  # its share, not the state
    summed = sum(results[0]["ranks"])
    assert total <= summed < 1.1 * total, (summed, total)  # (+ each rank's file headers)


def test_each_rank_checks_only_the_files_it_reads_and_a_bad_header_fails_the_step_everywhere(
        tmp_path):
    """Sizes and headers are checked by the ranks that read a file, not by every rank (N
    ranks checking N files is N^2 requests to an object store); a damaged header in a file
    one rank alone reads fails the step on every rank, with that rank's reason."""
    results = run_ranks(4, workers.headers_checked_then_one_corrupt, str(tmp_path / "root"),
                        timeout=90)
    files = results[0]["files"]
    assert files >= 4, files
    assert sum(len(r["checked"]) for r in results) < 2 * files, results  # not 4 x files
    for r in results:
        assert r["first"] == 2, r
        assert set(r["owned"]) <= set(r["checked"]), r
        assert r["second"] == 1 and r["exact"], r
        assert [s for s, _ in r["skipped"]] == [2], r
        assert r["skipped"][0][1].startswith(f"rank {r['damaged_reader']},"), r


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    """World 3, roots of one step each: plain values alone; a damaged header."""
    return run_ranks(3, workers.one_step_roots, str(tmp_path_factory.mktemp("one")), timeout=90)


def test_a_state_of_plain_values_alone_restores_with_nothing_to_share(one_step):
    """No chunk to read on any rank: the restore reads plainly, on every rank."""
    for r in one_step:
        assert r["values"] == {"step": 1, "meta": {"epoch": 3, "seen": [7, 8]}}, r


def test_a_bad_header_one_rank_finds_leaves_every_ranks_live_tensors_unchanged(one_step):
    """The only step (one pass, nothing to fall back to) has a damaged header in a file the
    last rank alone reads: every rank raises the same CorruptCheckpointError, with that
    rank's reason, before any rank's read lands in a live tensor."""
    errors = {r["header"]["error"] for r in one_step}
    assert len(errors) == 1, errors
    ((kind, text),) = errors
    assert kind == "CorruptCheckpointError", text
    assert f"rank {one_step[0]['header']['reader']}" in text, text
    for r in one_step:
        assert r["header"]["changed"] == [], r


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """World 4, one job: rank 1 damages what it sends, then a chunk rank 2 reads for all is
    corrupt in the root."""
    root = str(tmp_path_factory.mktemp("faults") / "root")
    return run_ranks(4, workers.damaged_then_corrupt, root, 1, 2, timeout=90)


def test_a_resharded_incremental_compressed_step_is_read_once_and_ends_bit_exact(tmp_path):
    """Saved at world 2 (rows sharded, incremental, zstd), restored at world 3: a rank's
    rows span chunks another rank's rows need too, the replicated tensor's chunks live in
    step 1's directory, and every chunk is compressed. Each chunk is read once in the whole
    job, and every rank ends bit-exact."""
    root = str(tmp_path / "root")
    run_ranks(2, workers.resharded_save, root, timeout=90)
    results = run_ranks(3, workers.resharded_restore, root, timeout=90)
    total = results[0]["checkpoint"]
    assert results[0]["steps"] == [1, 3], results[0]["steps"]  # rep's chunks: step 1's
    for r in results:
        assert r["step"] == 3 and r["exact"], r
        assert r["ranks"] == results[0]["ranks"]
    summed = sum(results[0]["ranks"])
    assert total <= summed < 1.05 * total, (summed, total)  # (+ each rank's file headers)


def test_a_corrupt_chunk_read_by_rank_2_fails_the_step_on_every_rank_alike(faults):
    """restore() of the newest step falls back to step 1 on every rank with the same reason
    (rank 2's digest mismatch); restore(step=2) raises on every rank and changes nothing,
    although only rank 2 read the chunk."""
    results = [r["corrupt"] for r in faults]
    reasons = {str(r["skipped"]) for r in results}
    errors = {r["error"] for r in results if r["error"] != results[2]["error"]}
    for r in results:
        assert r["newest"] == 1 and r["fell_back"], r
        assert [s for s, _ in r["skipped"]] == [2]
        assert r["error"] and "digest mismatch" in r["error"] and r["unchanged"], r
    assert len(reasons) == 1, reasons  # one reason, agreed
    assert "digest mismatch" in results[0]["skipped"][0][1]
    assert "rank 2" in results[0]["skipped"][0][1]
    assert len(errors) == 1 and "rank 2" in errors.pop()  # the others name the reader


def test_bytes_damaged_by_the_rank_that_sends_them_are_refused_by_every_receiver(faults):
    """A rank whose reads pass their digest but whose sent bytes are damaged (bad memory, a
    hostile peer): every receiver checks what it got against its own manifest, and every
    rank falls back to step 1."""
    for r in (f["hostile"] for f in faults):
        assert r["newest"] == 1, r
        assert [s for s, _ in r["skipped"]] == [2]
        assert "as received from rank 1" in r["skipped"][0][1]


def test_when_the_group_cannot_carry_the_chunks_every_rank_reads_them_itself(tmp_path):
    """Every send fails as a closed gloo connection does: the restore still ends bit-exact,
    each rank having read the whole checkpoint itself, once (its share for the exchange,
    then the rest: its share is in place and checked), and the log says why."""
    results = run_ranks(2, workers.broken_exchange, str(tmp_path / "root"), timeout=90)
    for r in results:
        assert r["step"] == 2 and r["exact"], r
        assert r["checkpoint"] <= r["mine"] < 1.05 * r["checkpoint"]
        assert r["logged"] and "Connection closed by peer" in r["logged"][0]


def exchange_breaks_after(rank: int, world: int, root: str, batches: int,
                          strict: bool = False) -> dict:
    """Every chunk its own batch of the exchange; its sends and receives fail from batch
    ``batches + 1`` on. Returns the bytes this rank read from the root, the chunks' bytes,
    and the bytes it received whole in the batches before."""
    from ckpt._load import cooperative

    workers.cooperate_on_one_host()
    workers.save_two_steps(root)
    cooperative.BATCH_BYTES = 1
    done, received = [0], [0]
    real_batch = cooperative.Shares._send_and_receive

    def one_batch(self, batch, data, check, storage):
        done[0] += 1
        out = real_batch(self, batch, data, check, storage)
        if out == (None, None):
            received[0] += sum(size for cid, size in batch if self.owner[cid] != self.me)
        return out

    class Breaking:  # sends and receives fail as on a closed gloo connection
        def __getattr__(self, name):
            op = getattr(dist, name)
            if name not in ("isend", "irecv"):
                return op

            def broken(*args, **kwargs):
                if done[0] > batches:
                    raise RuntimeError("[gloo] Connection closed by peer (injected)")
                return op(*args, **kwargs)
            return broken

    cooperative.Shares._send_and_receive = one_batch
    cooperative.dist = Breaking()
    state = {"model": workers.zeroed(workers.replicated(2))}
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        restored = mgr.restore(state, strict=strict)
        info = mgr.last_restore
    return {"step": restored, "exact": workers.same(state["model"], workers.replicated(2)),
            "mine": info.bytes_from_storage, "checkpoint": workers.data_bytes(root, 2),
            "received": received[0]}


def test_after_the_exchange_fails_part_way_each_rank_reads_only_what_it_lacks(tmp_path):
    """The exchange carries some chunks, then its sends fail: every rank reads from the root
    only what it neither read for the exchange nor received whole and checked (so the
    checkpoint once per rank, less what it received), and ends bit-exact."""
    results = run_ranks(2, exchange_breaks_after, str(tmp_path / "root"), 6, timeout=90)
    # The first batches went through: a rank received whole chunks before the failure.
    assert max(r["received"] for r in results) > 0.1 * results[0]["checkpoint"], results
    for r in results:
        assert r["step"] == 2 and r["exact"], r
        lacked = r["checkpoint"] - r["received"]
        assert lacked <= r["mine"] < lacked + 0.02 * r["checkpoint"], r  # (+ file headers)


def test_ranks_on_one_host_read_a_file_system_root_themselves_by_default(tmp_path):
    """One host, one page cache: the disk is read once for every rank anyway, so the default
    leaves the exchange out and each rank reads the whole checkpoint itself."""
    results = run_ranks(2, workers.one_host_by_default, str(tmp_path / "root"), timeout=90)
    for r in results:
        assert r["step"] == 2 and r["exact"], r
        assert r["mine"] >= r["checkpoint"]


def test_ranks_read_an_object_store_root_together_by_default(s3):
    """No page cache between an object store and its readers: by default the ranks share
    the reading even on one host; the bytes the store sent (counted per request, whole
    blocks of a read cache included) sum to the checkpoint once, and each rank asks for its
    share of the one data file in one ranged read, not one per chunk (42 chunks)."""
    results = run_ranks(2, workers.object_store_by_default, s3.root("coop"),
                        s3.storage_options, timeout=90)
    total = results[0]["checkpoint"]
    assert results[0]["files"] == 1
    for r in results:
        assert r["step"] == 1 and r["exact"], r
        assert max(r["ranks"]) < 0.75 * total, (r["ranks"], total)
        assert r["fetched"] < 0.75 * total, (r["fetched"], total)
        assert r["ranges"] == 1, r
    assert total <= sum(results[0]["ranks"]) < 1.1 * total
    assert total <= sum(r["fetched"] for r in results) < 1.1 * total


def test_a_corrupt_chunk_in_a_share_read_from_an_object_store_fails_the_step_everywhere(s3):
    """On an object store each rank reads its share of a file in one ranged read, and checks
    every chunk of it before sending: a bit flipped in the last rank's share makes every
    rank fall back to step 1, bit-exact, with that rank's reason."""
    results = run_ranks(2, workers.object_store_corrupt_share, s3.root("corrupt"),
                        s3.storage_options, timeout=90)
    for r in results:
        assert r["step"] == 1 and r["exact"], r
        assert [s for s, _ in r["skipped"]] == [2], r
        why = r["skipped"][0][1]
        assert "digest mismatch" in why and why.startswith("rank 1"), r
        assert "as received from" not in why, r  # found by the reader, not a receiver


def test_a_strict_restore_whose_exchange_fails_part_way_ends_bit_exact(tmp_path):
    """Verify, then apply: the exchange (the apply pass) carries some chunks, then fails;
    each rank verifies and reads the chunks it still lacks itself, and ends bit-exact."""
    results = run_ranks(2, exchange_breaks_after, str(tmp_path / "root"), 6, True,
                        timeout=90)
    assert max(r["received"] for r in results) > 0.1 * results[0]["checkpoint"], results
    for r in results:
        assert r["step"] == 2 and r["exact"], r
