"""A step retired under a process group (``mgr.retire`` on one rank, the trainer's way, or on
every rank) is never restored from memory, on any rank, though the other ranks' segments and
the replicas still hold it: the retiring rank records the retired saves (step, token) in the
root (``ckpt/_memory/retired.py``) and every rank's restore passes over them, saying why. A
later save of the same step number (the new timeline's) is restored from memory as usual. The
record is input from the root: a damaged, hand-edited or planted one never fails a restore
(it restores from the root, a warning names the file) and is never followed outside the root.

Two gloo ranks, each on a node of its own (``node=n<rank>``) with its steps replicated on the
other node; every rank stops without closing, as a crash would."""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil

import pytest
import torch

import ckpt
from ckpt._memory.retired import (MAX_BYTES, MAX_ENTRIES, RETIRED_FORMAT, RETIRED_NAME,
                                  _token_of, parse, read_retired, record_retired,
                                  root_saves)
from ckpt._memory.tier import node_prefix
from storage_backends.posix import PosixStorage
from tests.support.ranks import run_ranks


def _tier(shm: str, rank: int, persist_every: int) -> ckpt.MemoryTierOptions:
    return ckpt.MemoryTierOptions(shm_dir=shm, node=f"n{rank}", job="retire", keep=5,
                                  persist_every=persist_every, replicas=1)


def _w(step: int, line: int = 0) -> torch.Tensor:
    """The weights at ``step`` of the line of training ``line`` (the same on every rank: a
    plain tensor is taken as replicated, one rank writes it to the root)."""
    return torch.randn(64, generator=torch.Generator().manual_seed(step + 1000 * line))


def save_and_retire(rank: int, world: int, root: str, shm: str, who: str, persist_every: int,
                    again: bool) -> list[int]:
    """Save 1..5 (3 always to the root), wait for the replicas, retire steps 1 and 5 (4
    and 5 when they are in memory only) on rank 0, every rank or none (``who``); with
    ``again``, save step 5 again on every rank, the new line's. Then stop without closing.
    Returns the steps the root's record names."""
    import torch.distributed as dist

    mgr = ckpt.CheckpointManager(root, memory_tier=_tier(shm, rank, persist_every),
                                 async_save=False)
    for step in range(1, 6):
        mgr.save(step, {"w": _w(step)}, force=True, persist=True if step == 3 else None)
    assert mgr.wait_replicated(60)
    dist.barrier()
    for turn in range(world):  # (every rank in turn: the root's collector is not shared)
        if turn == rank and (who == "every" or who == "rank0" == f"rank{rank}"):
            mgr.retire([1, 5] if persist_every == 1 else [4, 5])
        dist.barrier()
    if again:
        mgr.save(5, {"w": _w(5, line=1)}, force=True)
        assert mgr.wait_replicated(60)
        dist.barrier()
    return sorted(s for s, _ in read_retired(PosixStorage(root)).saves)


def restore(rank: int, world: int, root: str, shm: str, persist_every: int) -> dict:
    """Restore the newest step (a restarted job); what it restored, from where, what it
    passed over, and the warnings that named the retired-saves record."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING and RETIRED_NAME in record.getMessage():
                seen.append(record.getMessage())

    handler = Keep()
    logging.getLogger("ckpt").addHandler(handler)
    state = {"w": torch.zeros(64)}
    mgr = ckpt.CheckpointManager(root, memory_tier=_tier(shm, rank, persist_every),
                                 async_save=False)
    step = mgr.restore(state)
    info = mgr.last_restore
    lines = {line: bool(torch.equal(state["w"], _w(step, line))) for line in (0, 1)}
    return {"step": step, "tier": str(info.tier), "bytes": info.bytes_from_storage,
            "line": [line for line, same in lines.items() if same],
            "skipped": [list(s) for s in info.skipped], "warnings": seen}


@pytest.mark.multiproc
@pytest.mark.parametrize("who,persist_every", [("rank0", 1), ("every", 1), ("rank0", 1000)],
                         ids=["one-rank", "every-rank", "memory-only"])
def test_a_retired_step_is_restored_from_memory_on_no_rank(tmp_path, who, persist_every):
    """Rank 0 (or every rank) retires steps 1 and 5 (4 and 5, held in memory only), the
    job crashes: the restart restores the step before on every rank, from memory, bit-exact,
    and names each retired step after it among those it passed over. The record names
    every retired step (the oldest too: the other segments still hold it)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    root = str(tmp_path / "root")
    recorded = run_ranks(2, save_and_retire, root, str(shm), who, persist_every, False)
    assert recorded == [[1, 5] if persist_every == 1 else [4, 5]] * 2
    out = run_ranks(2, restore, root, str(shm), persist_every)
    before = 4 if persist_every == 1 else 3
    for o in out:
        assert (o["step"], o["line"], o["bytes"]) == (before, [0], 0), o
        assert o["tier"] in ("memory", "peer"), o
        retired = [s for s in o["skipped"] if "retired" in s[2]]
        assert [s[:2] for s in retired] == [[s, "memory"] for s in range(5, before, -1)], o


@pytest.mark.multiproc
def test_the_same_step_saved_again_after_its_retire_is_restored_from_memory(tmp_path):
    """Step 5 retired on rank 0, then saved again by every rank (the new line of training,
    another save of the same number): the restart restores the new step 5 from memory."""
    shm = tmp_path / "shm"
    shm.mkdir()
    root = str(tmp_path / "root")
    run_ranks(2, save_and_retire, root, str(shm), "rank0", 1, True)
    for o in run_ranks(2, restore, root, str(shm), 1):
        assert (o["step"], o["line"], o["bytes"], o["skipped"]) == (5, [1], 0, []), o
        assert o["tier"] in ("memory", "peer"), o


def _lose_node(shm: str, node: str) -> None:
    """``node`` is replaced: its memory (its segments and the replicas there) is gone."""
    lost = glob.glob(os.path.join(shm, "*", f"{node_prefix('retire', node)}*"))
    assert lost, os.listdir(shm)
    for path in lost:
        shutil.rmtree(path)


def retire_after_loss(rank: int, world: int, root: str, shm: str, persist_every: int,
                      restore_first: bool, again: bool) -> dict:
    """On node 0, whose memory was lost: restore (or not) on every rank, retire step 5 on
    rank 0; with ``again``, save step 5 again on every rank, the new line's. Then stop
    without closing. Returns the steps the root's record names and rank 0's warnings."""
    import torch.distributed as dist

    warned: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warned.append(record.getMessage())

    mgr = ckpt.CheckpointManager(root, memory_tier=_tier(shm, rank, persist_every),
                                 async_save=False)
    if restore_first:
        assert mgr.restore({"w": torch.zeros(64)}) == 5
    dist.barrier()
    if rank == 0:
        logging.getLogger("ckpt").addHandler(Keep())
        mgr.retire([5])
    dist.barrier()
    if again:
        mgr.save(5, {"w": _w(5, line=1)}, force=True)
        assert mgr.wait_replicated(60)
        dist.barrier()
    return {"recorded": sorted(s for s, _ in read_retired(PosixStorage(root)).saves),
            "warnings": warned}


@pytest.mark.multiproc
@pytest.mark.parametrize("persist_every,restore_first", [(1, True), (1, False), (1000, True)],
                         ids=["restored-and-persisted", "persisted", "restored-memory-only"])
def test_a_step_retired_on_a_node_that_lost_its_memory_is_restored_from_memory_on_no_rank(
        tmp_path, persist_every, restore_first):
    """Node 0 loses its memory (a replaced node), the job restores step 5 from node 1's
    replicas (or does not restore), rank 0 retires step 5, the job crashes: the restart
    restores step 4 on every rank, from memory, and passes over step 5 as retired. Rank 0's
    node holds no save of step 5: its token comes from the restore that found it in the
    other node's memory, or from the root's manifest of step 5."""
    shm = tmp_path / "shm"
    shm.mkdir()
    root = str(tmp_path / "root")
    run_ranks(2, save_and_retire, root, str(shm), "none", persist_every, False)
    _lose_node(str(shm), "n0")
    out = run_ranks(2, retire_after_loss, root, str(shm), persist_every, restore_first, False)
    assert out[0]["recorded"] == [5] and not out[0]["warnings"], out
    for o in run_ranks(2, restore, root, str(shm), persist_every):
        assert (o["step"], o["line"], o["bytes"]) == (4, [0], 0), o
        assert o["tier"] in ("memory", "peer"), o
        assert [s[:2] for s in o["skipped"] if "retired" in s[2]] == [[5, "memory"]], o


@pytest.mark.multiproc
def test_a_memory_only_step_no_one_can_name_is_retired_with_a_warning(tmp_path):
    """Node 0 loses its memory and rank 0 retires step 5, held in memory only on node 1,
    without a restore first: nothing names its save, and the warning names the step and
    says to restore first."""
    shm = tmp_path / "shm"
    shm.mkdir()
    root = str(tmp_path / "root")
    run_ranks(2, save_and_retire, root, str(shm), "none", 1000, False)
    _lose_node(str(shm), "n0")
    out = run_ranks(2, retire_after_loss, root, str(shm), 1000, False, False)
    assert out[0]["recorded"] == [], out
    assert any("[5]" in w and "Restore first" in w for w in out[0]["warnings"]), out


@pytest.mark.multiproc
def test_the_same_step_saved_again_after_a_retire_on_a_node_that_lost_its_memory(tmp_path):
    """Node 0 loses its memory, rank 0 retires step 5 (recorded from the root), then every
    rank saves step 5 again (the new line's save): the restart restores the new step 5 from
    memory."""
    shm = tmp_path / "shm"
    shm.mkdir()
    root = str(tmp_path / "root")
    run_ranks(2, save_and_retire, root, str(shm), "none", 1000, False)
    _lose_node(str(shm), "n0")
    run_ranks(2, retire_after_loss, root, str(shm), 1000, True, True)
    for o in run_ranks(2, restore, root, str(shm), 1000):
        assert (o["step"], o["line"], o["bytes"], o["skipped"]) == (5, [1], 0, []), o
        assert o["tier"] in ("memory", "peer"), o


def test_the_root_names_each_save_by_the_token_in_its_files_names(tmp_path):
    """A committed step's token, read from its manifest (format 2: its rank tables' names;
    format 1: its data files'), is the save's; a step the root lacks names none."""
    root = str(tmp_path / "root")
    mgr = ckpt.CheckpointManager(root, async_save=False)
    mgr.save(1, {"w": _w(1)}, force=True)
    mgr.save(2, {"w": _w(2)}, force=True)
    step2 = os.listdir(os.path.join(root, "step-00000002"))
    tokens = {n.split("-")[2] for n in step2 if n.startswith(("data-", "table-"))}
    assert len(tokens) == 1, step2
    found = root_saves(PosixStorage(root), [2, 7])
    assert found == {(2, tokens.pop())}


def test_a_damaged_manifest_in_the_root_names_no_save(tmp_path, caplog):
    """A step's manifest that fails its checks names no save (a warning names the step);
    only a name the save's naming makes exactly yields a token."""
    root = str(tmp_path / "root")
    ckpt.CheckpointManager(root, async_save=False).save(2, {"w": _w(2)}, force=True)
    manifest = os.path.join(root, "step-00000002", "manifest.json")
    raw = bytearray(open(manifest, "rb").read())
    raw[len(raw) // 2] ^= 0x01
    with open(manifest, "wb") as f:
        f.write(raw)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        assert root_saves(PosixStorage(root), [2]) == set()
    assert "step 2" in caplog.text
    for name in ["data-00-abc-r00001-000.safetensors", "data-01-abc-r00001.ckt",
                 "table-01-abc-r00001-000.ckt", "table-01-ab/c-r00001.ckt",
                 "data-00-" + "a" * 65 + "-r00000-000.safetensors", "manifest.json"]:
        assert _token_of(name) is None, name
    assert _token_of("data-01-abc-r00001-000.safetensors") == "abc"
    assert _token_of("table-2c-abc-r00300.ckt") == "abc"


def _plant(root: str, tmp_path, how: str) -> None:
    path = os.path.join(root, RETIRED_NAME)
    if how == "garbage":
        with open(path, "wb") as f:
            f.write(b'{"format": "ckpt-memory-retired/1", "retired": [{"step": "5"')
    elif how == "hand-edited":
        with open(path, "w") as f:
            json.dump({"format": RETIRED_FORMAT, "retired": [{"step": -5, "token": 7}]}, f)
    elif how == "link-outside":  # to a good document that retires nothing: never followed
        outside = tmp_path / "outside.json"
        outside.write_text(json.dumps({"format": RETIRED_FORMAT, "retired": []}))
        os.symlink(outside, path)


@pytest.mark.multiproc
@pytest.mark.parametrize("how", ["garbage", "hand-edited", "link-outside"])
def test_a_damaged_retired_record_fails_no_restore(tmp_path, how):
    """Steps 1..5 saved, none retired, then the record in the root damaged, hand-edited or
    replaced by a link to a file outside the root: the restart restores step 5 bit-exact
    from the root (the record cannot say which memory steps were retired), and rank 0's
    warning names the file."""
    shm = tmp_path / "shm"
    shm.mkdir()
    root = str(tmp_path / "root")
    run_ranks(2, save_and_retire, root, str(shm), "none", 1, False)
    _plant(root, tmp_path, how)
    out = run_ranks(2, restore, root, str(shm), 1)
    for o in out:
        assert (o["step"], o["line"], o["tier"]) == (5, [0], "storage"), o
        assert o["skipped"] and all(RETIRED_NAME in s[2] for s in o["skipped"]), o
    assert out[0]["warnings"] and RETIRED_NAME in out[0]["warnings"][0], out[0]


def test_the_record_holds_the_retired_saves_and_forgets_steps_no_segment_holds(tmp_path):
    """Recording adds (step, token) pairs, drops the earlier ones below the oldest step the
    caller still holds (never those it adds: a node that lost its memory holds fewer steps),
    keeps the newest MAX_ENTRIES; the same record twice writes nothing."""
    storage = PosixStorage(str(tmp_path))
    record_retired(storage, {(5, "aaaa"), (6, "bbbb")}, None)
    record_retired(storage, {(9, "cccc")}, 6)
    assert read_retired(storage).saves == {(6, "bbbb"), (9, "cccc")}
    record_retired(storage, {(4, "dddd")}, 9)
    assert read_retired(storage).saves == {(4, "dddd"), (9, "cccc")}
    record_retired(storage, {(9, "cccc")}, 4)
    assert read_retired(storage).saves == {(4, "dddd"), (9, "cccc")}
    before = os.stat(tmp_path / RETIRED_NAME).st_ino
    record_retired(storage, {(9, "cccc")}, None)
    assert os.stat(tmp_path / RETIRED_NAME).st_ino == before
    record_retired(storage, {(s, "t") for s in range(10, 10 + MAX_ENTRIES + 5)}, None)
    saves = read_retired(storage).saves
    assert len(saves) == MAX_ENTRIES and min(s for s, _ in saves) == 15


def test_recording_replaces_a_planted_link_and_a_damaged_record(tmp_path, caplog):
    """A link planted at the record's name is replaced, its target untouched; a damaged
    record is replaced with a warning that names it."""
    root = tmp_path / "root"
    root.mkdir()
    target = tmp_path / "target"
    target.write_text("keep")
    os.symlink(target, root / RETIRED_NAME)
    storage = PosixStorage(str(root))
    record_retired(storage, {(5, "aaaa")}, None)
    assert target.read_text() == "keep" and not os.path.islink(root / RETIRED_NAME)
    (root / RETIRED_NAME).write_bytes(b"\x00" * 10)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        record_retired(storage, {(6, "bbbb")}, None)
    assert RETIRED_NAME in caplog.text
    assert read_retired(storage).saves == {(6, "bbbb")}


@pytest.mark.parametrize("raw", [
    b"[" * 100000, b'{"format": "ckpt-memory-retired/1", "retired": []' + b" " * MAX_BYTES + b"}",
    b'{"format": "other", "retired": []}',
    json.dumps({"format": RETIRED_FORMAT, "retired": [{"step": True, "token": "a"}]}).encode(),
    json.dumps({"format": RETIRED_FORMAT, "retired": [{"step": 1, "token": "a" * 65}]}).encode(),
    json.dumps({"format": RETIRED_FORMAT,
                "retired": [{"step": 1, "token": "a"}] * (MAX_ENTRIES + 1)}).encode(),
    b"\xff\xfe", b'{"format": "ckpt-memory-retired/1", "retired": [1e999]}',
], ids=["deep", "too-long", "format", "bool-step", "long-token", "too-many", "not-utf8",
        "not-an-entry"])
def test_a_hostile_record_is_refused_whole(tmp_path, raw):
    """Whatever the record holds, reading it raises nothing: one that fails its checks is
    refused whole (its problem named, no save trusted)."""
    with pytest.raises(ValueError):
        parse(raw)
    (tmp_path / RETIRED_NAME).write_bytes(raw)
    found = read_retired(PosixStorage(str(tmp_path)))
    assert not found.saves and RETIRED_NAME in found.problem
    assert "not restored" in found.why(3, "any")
