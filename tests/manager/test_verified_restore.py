"""Verified steps in the manager: ``mark_verified`` writes a step's marker once (rank 0),
``restore(prefer="verified")`` takes the newest verified step first (from memory too), and
a marker that is damaged, edited, stale or planted is reported, never trusted.

Threat model: anyone who can write into the root can plant or edit ``verified.json`` files.
They can make a restore prefer an older step only with a marker that names the step and
the SHA-256 of its current manifest (which they could as well have rewritten); everything
else (garbage, a FIFO, a link, a huge file, a marker for another save of the number, or
for a step that does not exist) is ignored with a warning and costs one small read.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import ckpt
from tests.support.ranks import run_ranks
from tests.support.s3_fixture import _moto, s3  # noqa: F401  (fixtures)


def state(value: float) -> dict:
    return {"w": torch.full((4,), value)}


def saved_root(root, steps=(2, 4, 6), **kw) -> None:
    with ckpt.CheckpointManager(root, async_save=False, **kw) as mgr:
        for s in steps:
            mgr.save(s, state(s))


def restored(root, prefer: str, **kw) -> tuple[int | None, float]:
    target = state(-1)
    with ckpt.CheckpointManager(root, read_only=True, **kw) as mgr:
        step = mgr.restore(target, prefer=prefer)
    return step, target["w"][0].item()


def marker(root, step: int):
    return os.path.join(root, f"step-{step:08d}", "verified.json")


def test_restore_prefers_the_newest_verified_step(tmp_path):
    root = str(tmp_path / "r")
    saved_root(root)
    assert restored(root, "verified") == (6, 6.0)  # none verified: as today
    with ckpt.CheckpointManager(root) as mgr:
        v = mgr.mark_verified(2, {"window": 3, "confirmed_at": 5})
        assert (v.step, v.evidence) == (2, {"window": 3, "confirmed_at": 5})
        mgr.mark_verified(4)
        again = mgr.mark_verified(4, {"window": 9})      # kept: the first marker stays
        assert again.evidence == {} and mgr.verified_steps() == [2, 4]
    assert restored(root, "verified") == (4, 4.0)
    assert restored(root, "newest") == (6, 6.0)
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        assert mgr.restore(state(-1), step=2, prefer="verified") == 2  # explicit step wins
        with pytest.raises(ValueError, match="prefer"):
            mgr.restore(state(-1), prefer="oldest")


def test_load_prefers_the_verified_step_as_restore_does(tmp_path):
    root = str(tmp_path / "r")
    saved_root(root, steps=(2, 4, 6, 8))
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        assert mgr.load(prefer="verified")["w"][0].item() == 8.0  # none verified: newest
        with pytest.raises(ValueError, match="prefer"):
            mgr.load(prefer="oldest")
    with ckpt.CheckpointManager(root) as mgr:
        mgr.mark_verified(2)
        mgr.mark_verified(6)
    corrupt_data(root, 6)
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        assert mgr.load()["w"][0].item() == 8.0 and mgr.loaded_step == 8
        # the newest verified step is corrupt: the older verified one, before step 8
        assert mgr.load(prefer="verified")["w"][0].item() == 2.0 and mgr.loaded_step == 2
        assert [s for s, _ in mgr.skipped] == [6]
        assert mgr.load(step=4, prefer="verified")["w"][0].item() == 4.0  # explicit wins
        assert mgr.load(prefer="verified")["w"][0].item() == 2.0
        mgr.save(4, state(40))              # the steps it passed over may be saved again
    with ckpt.CheckpointManager(root, async_save=False) as mgr:  # and so with restore
        assert mgr.restore(state(-1), prefer="verified") == 2
        mgr.save(4, state(41))


def corrupt_data(root, step: int) -> None:
    """Flip the last 4 bytes of ``step``'s first data file."""
    folder = os.path.join(root, f"step-{step:08d}")
    data = sorted(f for f in os.listdir(folder) if f.startswith("data"))
    with open(os.path.join(folder, data[0]), "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff")


def test_a_corrupt_verified_step_falls_back_to_the_older_verified_then_the_rest(tmp_path):
    root = str(tmp_path / "r")
    saved_root(root)
    with ckpt.CheckpointManager(root) as mgr:
        mgr.mark_verified(2)
        mgr.mark_verified(4)
    data = [f for f in os.listdir(os.path.join(root, "step-00000004")) if f.endswith(".safetensors")
            or f.startswith("data")]
    path = os.path.join(root, "step-00000004", data[0])
    with open(path, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff")
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        target = state(-1)
        assert mgr.restore(target, prefer="verified") == 2
        assert [s for s, _ in mgr.skipped] == [4]


def test_a_save_may_reuse_the_steps_a_verified_restore_passed_over(tmp_path):
    root = str(tmp_path / "r")
    saved_root(root)
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        mgr.mark_verified(2)
        assert mgr.restore(state(-1), prefer="verified") == 2
        mgr.save(4, state(40))                           # the new timeline's step 4
        assert mgr.verified_steps() == [2]
    assert restored(root, "newest") == (6, 6.0)
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        assert mgr.restore(state(-1)) == 6
        with pytest.raises(ckpt.StepOrderError):
            mgr.save(4, state(4))                         # a plain restore passed none over


def test_mark_verified_refuses_what_it_cannot_vouch_for(tmp_path):
    root = str(tmp_path / "r")
    saved_root(root)
    with ckpt.CheckpointManager(root) as mgr:
        with pytest.raises(ckpt.CheckpointNotFoundError, match="not committed"):
            mgr.mark_verified(5)
        with pytest.raises(ValueError, match="plain JSON"):
            mgr.mark_verified(2, {"loss": float("nan")})
        with pytest.raises(ValueError, match="bytes as JSON"):
            mgr.mark_verified(2, {"log": "x" * 10_000})
        with pytest.raises(TypeError):
            mgr.mark_verified(2, {1: "not a str key"})
        with pytest.raises(TypeError):
            mgr.mark_verified("2")
        assert mgr.verified_steps() == []
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        with pytest.raises(ckpt.CheckpointError, match="read_only"):
            mgr.mark_verified(2)


def test_hand_edited_stale_and_planted_markers_are_never_trusted(tmp_path):
    root = str(tmp_path / "r")
    saved_root(root, steps=(2, 4, 6, 8, 10, 14))
    with ckpt.CheckpointManager(root) as mgr:
        mgr.mark_verified(2)
        mgr.mark_verified(4)
    good = json.loads(open(marker(root, 4)).read())
    # step 6: step 4's marker copied; step 12 does not exist: a folder holding only a
    # marker that names it
    shutil.copy(marker(root, 4), marker(root, 6))
    # step 8: garbage; step 10: a FIFO (a reader must not block on it)
    with open(marker(root, 8), "wb") as f:
        f.write(b"\x1b[31m{not json" * 5000)
    os.mkfifo(marker(root, 10))
    os.symlink(marker(root, 2), marker(root, 14))  # step 14: a link to a valid marker
    os.mkdir(os.path.join(root, "step-00000012"))
    with open(marker(root, 12), "w") as f:
        json.dump({**good, "step": 12}, f)
    # step 4's own marker edited: a later time is fine, a changed digest is not
    with open(marker(root, 4), "w") as f:
        json.dump({**good, "manifest_sha256": "0" * 64}, f)

    cps = ckpt.inspect.open(root)
    states = {s: cps.marker(s) for s in cps.steps()}
    assert sorted(states) == [2, 4, 6, 8, 10, 14]
    assert states[2].status == "verified"
    assert {s: m.status for s, m in states.items() if s != 2} == dict.fromkeys(
        (4, 6, 8, 10, 14), "untrusted")
    assert "another save" in states[4].problem and "names step 4, not step 6" in \
        states[6].problem
    assert "larger than" in states[8].problem and "not a file" in states[10].problem
    assert "symbolic link" in states[14].problem
    with ckpt.CheckpointManager(root) as mgr:
        assert mgr.verified_steps() == [2]
        assert mgr.restore(state(-1), prefer="verified") == 2
        mgr.mark_verified(4)                             # an untrusted marker is replaced
        assert mgr.verified_steps() == [2, 4]
        with pytest.raises(ckpt.StorageError, match="symbolic link"):
            mgr.mark_verified(14)                        # never written through a link


def test_a_verified_restore_takes_the_step_from_memory(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    tier = ckpt.MemoryTierOptions(shm_dir=str(shm), job="verified", keep=2)
    with ckpt.CheckpointManager(str(tmp_path / "r"), memory_tier=tier, async_save=False) as mgr:
        for s in (2, 4, 6):
            mgr.save(s, state(s))
        mgr.mark_verified(4)
        target = state(-1)
        assert mgr.restore(target, prefer="verified") == 4
        assert mgr.last_restore.tier == "memory" and target["w"][0].item() == 4.0


def test_a_memory_only_save_is_never_verified_and_a_verified_restore_passes_it_over(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    tier = ckpt.MemoryTierOptions(shm_dir=str(shm), job="memonly", keep=3)
    with ckpt.CheckpointManager(str(tmp_path / "r"), memory_tier=tier, async_save=False) as mgr:
        mgr.save(2, state(2))
        mgr.save(4, state(4), persist=False)              # in this node's memory only
        with pytest.raises(ckpt.CheckpointNotFoundError, match="memory tier only"):
            mgr.mark_verified(4)
        mgr.mark_verified(2)
        target = state(-1)
        assert mgr.restore(target, prefer="verified") == 2
        assert mgr.last_restore.tier == "memory" and target["w"][0].item() == 2.0
        # The memory-only 4 went with the verified restore (a rollback): a restart resumes 2.
        assert mgr.restore(state(-1)) == 2 and mgr.last_restore.tier == "memory"


def _two_ranks(rank: int, world: int, root: str) -> tuple:
    import torch.distributed as dist

    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        for s in (2, 4, 6):
            mgr.save(s, {"w": torch.full((4,), float(s)), "r": ckpt.PerRank(rank)})
        marked = mgr.mark_verified(4, {"window": 2})
        dist.barrier()
        target = {"w": torch.zeros(4), "r": ckpt.PerRank(-1)}
        step = mgr.restore(target, prefer="verified")
        return marked is not None, step, target["w"][0].item()


def test_rank_zero_marks_and_every_rank_restores_the_verified_step(tmp_path):
    root = str(tmp_path / "r")
    assert run_ranks(2, _two_ranks, root) == [(True, 4, 4.0), (False, 4, 4.0)]


def test_an_object_store_root_marks_create_only(s3):
    root = s3.root("verified")
    opts = s3.storage_options
    with ckpt.CheckpointManager(root, storage_options=opts, async_save=False) as mgr:
        for s in (2, 4):
            mgr.save(s, state(s))
        mgr.mark_verified(2, {"window": 1})
        assert mgr.mark_verified(2, {"window": 5}).evidence == {"window": 1}
        assert mgr.verified_steps() == [2]
        assert mgr.restore(state(-1), prefer="verified") == 2
        mgr.save(4, state(40))          # passed over: retired and saved again (create-only)
    assert restored(root, "newest", storage_options=opts) == (4, 40.0)
