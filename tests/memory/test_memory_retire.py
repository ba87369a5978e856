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

import json
import logging
import os

import pytest
import torch

import ckpt
from ckpt._memory.retired import (MAX_BYTES, MAX_ENTRIES, RETIRED_FORMAT, RETIRED_NAME,
                                  parse, read_retired, record_retired)
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
    """Recording adds (step, token) pairs, drops those below the oldest step the caller
    still holds, keeps the newest MAX_ENTRIES; the same record twice writes nothing."""
    storage = PosixStorage(str(tmp_path))
    record_retired(storage, {(5, "aaaa"), (6, "bbbb")}, None)
    record_retired(storage, {(9, "cccc")}, 6)
    assert read_retired(storage).saves == {(6, "bbbb"), (9, "cccc")}
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
