"""Sharded saves on real gloo ranks, and loads resharded onto other world sizes."""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

import ckpt
from tests.support.ranks import run_ranks
from tests.support import sharded_workers as W

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("world4"))
    results = run_ranks(4, W.save_world, root, 10)
    return root, results


@pytest.mark.parametrize("world", [3, 2, 1])
def test_save_at_4_loads_at_fewer_ranks_element_for_element(saved_at_4, world):
    root, saved = saved_at_4
    results = run_ranks(world, W.load_world, root)
    for rank, r in enumerate(results):
        assert r["step"] == 10
        assert r["mismatches"] == [], f"rank {rank}"
        # Per-rank RNG: rank r continues saved rank r's stream.
        assert r["rng_next"] == saved[rank]["rng_next"]


def test_save_at_1_loads_at_4(tmp_path):
    root = str(tmp_path)
    saved = run_ranks(1, W.save_world, root, 3)
    results = run_ranks(4, W.load_world, root)
    for rank, r in enumerate(results):
        assert r["step"] == 3 and r["mismatches"] == []
        assert r["rng_next"] == saved[0]["rng_next"]  # rank r gets saved rank r % 1


def test_a_format_1_save_by_two_ranks_restores_each_ranks_values(tmp_path):
    """``rank_tables=False`` under a process group: one manifest holding every chunk and
    every rank's per-rank tree (gathered at save); each rank restores its own RNG stream."""
    root = str(tmp_path)
    saved = run_ranks(2, W.save_world, root, 4, {"rank_tables": False})
    m = ckpt.inspect.open(root).manifest(4)
    assert m.format_version == 1 and sorted(m.items["rng"]["per_rank"]) == ["0", "1"]
    for rank, r in enumerate(run_ranks(2, W.load_world, root)):
        assert r["step"] == 4 and r["mismatches"] == [], rank
        assert r["rng_next"] == saved[rank]["rng_next"], rank


def test_single_process_reads_a_four_rank_checkpoint(saved_at_4):
    root, _ = saved_at_4
    g = W.global_tensors()
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        m = mgr.manifest(10)
        assert m.world_size == 4
        # Every rank's RNG state is saved, and shards of one tensor came from several ranks.
        assert sorted(m.items["rng"]["per_rank"]) == ["0", "1", "2", "3"]
        assert len({c.file for c in m.tensors["row"].chunks}) > 1
        out = {k: torch.zeros_like(v) for k, v in g.items()}
        mgr.restore(out)
    for k, v in g.items():
        assert torch.equal(out[k], v), k


def test_replicated_tensors_are_written_once_and_spread_over_ranks(tmp_path):
    root = str(tmp_path)
    state_bytes = run_ranks(4, W.save_replicated, root)[0]
    files = glob.glob(os.path.join(root, "step-00000001", "data-*"))
    on_disk = sum(os.path.getsize(f) for f in files)
    assert state_bytes <= on_disk <= state_bytes * 1.01
    writers = {os.path.basename(f).split("-")[-2] for f in files}
    assert len(writers) == 4, writers  # balanced: every rank wrote a share


def test_a_rank_killed_mid_save_commits_nothing_and_survivors_raise(tmp_path):
    root = str(tmp_path)
    results = run_ranks(3, W.save_then_lose_a_rank, root, 2, allow_exit={2}, timeout=90)
    assert results[2] is None
    for r in results[:2]:
        assert r.startswith("raised:"), r
    with ckpt.CheckpointManager(root) as mgr:
        assert mgr.steps() == [1]
        model = W.make_model(3)
        assert mgr.restore({"model": model}) == 1
    ref = W.make_model(0)
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v)
    assert not glob.glob(os.path.join(root, ".tmp-*"))  # the new writer cleaned up


def test_fsdp2_model_and_optimizer_state_reshard(tmp_path):
    root = str(tmp_path)
    expected = run_ranks(2, W.fsdp_save_load, root, "save")
    got = run_ranks(3, W.fsdp_save_load, root, "load")
    # After restoring at world 3 and taking the same step, parameters equal the world-2 run's.
    for k, v in expected[0].items():
        assert torch.allclose(torch.tensor(got[0][k]), torch.tensor(v), atol=1e-6), k


def test_one_pass_restore_that_fails_on_one_rank_is_repaired_or_named_on_all(tmp_path):
    """Rank 1's file of the newest step is corrupt; rank 0 reads its own files in one pass
    and loads step 2 whole. Both fall back to step 1, which overwrites everything; with no
    step 1, rank 0 must say its live state holds a step the job rejected (not "nothing")."""
    root = str(tmp_path)
    run_ranks(2, W.save_world, root, 1)
    run_ranks(2, W.save_world, root, 2)
    victim = sorted(glob.glob(os.path.join(root, "step-00000002", "data-*-r00001-*")))[0]
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) - 1)
        last = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([last[0] ^ 0x40]))
    for r in run_ranks(2, W.restore_outcome, root):
        assert r == {"step": 1, "mismatches": []}
    shutil.rmtree(os.path.join(root, "step-00000001"))
    rank0, rank1 = run_ranks(2, W.restore_outcome, root)
    assert rank1["error"] == "PartialLoadError" and "digest mismatch" in rank1["message"]
    assert rank0["error"] == "PartialLoadError", rank0
    assert "row" in rank0["changed"] and "the live state is mixed" in rank0["message"]


# ------------------------------------------------- ranks that disagree on their items


@pytest.mark.multiproc
def test_per_rank_items_in_another_key_order_save_and_each_rank_stages_only_its_own(tmp_path):
    """Ranks may list the state's keys in any order: the save succeeds and restores exactly, and
    without a memory tier each rank stages to host only the boxes it writes (one rank stages the
    replicated "w"). A format-1 save whose ranks disagree on their per-rank items is refused on
    every rank with a CheckpointError that says so."""
    seen = run_ranks(2, W.save_keys_in_rank_order_recording_staged, str(tmp_path), timeout=120)
    assert not (tmp_path / "step-00000005").exists()
    for rank, s in enumerate(seen):
        assert s["mismatch"] and "different per-rank items" in s["mismatch"], (rank, s)
        assert s["step"] == 1 and s["rng_exact"] and s["blob_exact"] and s["w_exact"], (rank, s)
    stages_w = [rank for rank, s in enumerate(seen) if "w" in s["staged"]]
    assert len(stages_w) == 1, seen  # one writer; the other rank holds no copy of it


@pytest.mark.multiproc
def test_a_rank_whose_peer_fails_for_good_on_load_says_so_and_tries_no_older_step(tmp_path):
    """``load()``: one rank's fatal error (its refusal to unpickle) stops every rank on that step;
    the others name it rather than skip the step as if it were corrupt."""
    got = run_ranks(2, W.load_where_one_rank_refuses_pickle, str(tmp_path), timeout=120)
    assert got[1].startswith("UnsupportedValueError: "), got
    assert got[0].startswith("CheckpointError: another rank failed to load step 1: "
                             "UnsupportedValueError"), got


@pytest.mark.multiproc
def test_an_item_only_one_rank_holds_is_refused_not_dropped(tmp_path):
    """The manifest holds rank 0's items: an item only rank 1 saves (a plain value, a tensor) is
    refused on every rank, by name, in both formats, and nothing is committed."""
    got = run_ranks(2, W.save_an_item_only_rank_1_holds, str(tmp_path), timeout=120)
    for rank, s in enumerate(got):
        assert s["steps"] == [], (rank, s)
        for message in s["refused"]:
            assert message and "ranks save different items" in message, (rank, s)
            assert "'extra', 't1'" in message and "ckpt.PerRank" in message, (rank, s)
