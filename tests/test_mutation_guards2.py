"""Guards found by mutation testing (h-mutate2): each test here kills a one-line mutant of
code landed in this session (the one-pass restore, the memory tier's restore) that the
modules' own tests let survive. The mutant is named in each docstring; applying it makes
the test fail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckpt import CheckpointManager, CorruptCheckpointError, PartialLoadError, SaveOptions
from storage_backends import PosixStorage

# Small chunks, one writer thread: every tensor spans several chunks of one data file.
OPTIONS = SaveOptions(chunk_bytes=4096, write_threads=1)


def make_state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(32, 48)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return {"model": model, "extra": torch.randn(48, 32, generator=gen)}


def values(state: dict) -> dict[str, torch.Tensor]:
    """The state's tensors by their stored keys, copied."""
    out = {f"model/{k}": v.detach().clone() for k, v in state["model"].state_dict().items()}
    out["extra"] = state["extra"].clone()
    return out


def save_step(root: Path, step: int, state: dict) -> None:
    with CheckpointManager(root, async_save=False, options=OPTIONS, handle_sigterm=False,
                           metrics=False) as mgr:
        mgr.save(step, state)


def chunks(step_dir: Path) -> list[dict]:
    """The step's chunk records in the order they are stored."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    return sorted((c for e in manifest["tensors"].values() for c in e["chunks"]),
                  key=lambda c: (c["file"], c["start"]))


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def changed(state: dict, before: dict[str, torch.Tensor]) -> set[str]:
    now = values(state)
    return {k for k in before if not torch.equal(now[k], before[k])}


class _NoStreaming(PosixStorage):
    """A storage that does not stream (as an object store, where every read is a request):
    a one-pass load reads each chunk whole and must digest it all the same."""

    stream_block = None


class _OddBlocks(PosixStorage):
    """Streams through blocks that divide no chunk: a one-pass load reads each chunk in
    several blocks, the last one short."""

    stream_block = 1000


@pytest.mark.parametrize("storage_type", [_NoStreaming, _OddBlocks])
def test_a_one_pass_restore_reads_and_digests_every_byte_whatever_the_storage(
        tmp_path, storage_type):
    """Mutants: ckpt/reader.py read_chunk checking only a digest taken block by block
    (``found is not None and found != chunk.digest``: a storage without ``stream_block``, as
    S3, loads a flipped bit silently) and reading every block of a chunk at the chunk's start
    (``read_into(chunk.start, part)``)."""
    save_step(tmp_path, 1, make_state(1))
    save_step(tmp_path, 2, make_state(2))
    records = chunks(tmp_path / "step-00000002")
    middle = max(records[1:-1], key=lambda c: c["length"])  # neither first nor last
    assert len(records) >= 4 and middle["length"] > 2000  # (several blocks of _OddBlocks)
    live = make_state(3)
    with CheckpointManager(storage_type(tmp_path), read_only=True, metrics=False) as mgr:
        assert mgr.restore(live) == 2
    assert changed(live, values(make_state(2))) == set()
    flip_byte(tmp_path / "step-00000002" / middle["file"], middle["start"] + middle["length"] - 1)
    live = make_state(3)
    with CheckpointManager(storage_type(tmp_path), read_only=True, metrics=False) as mgr:
        assert mgr.restore(live) == 1
        assert [s for s, _ in mgr.skipped] == [2] and "digest mismatch" in mgr.skipped[0][1]
    assert changed(live, values(make_state(1))) == set()


def test_the_forward_level_verifies_a_step_before_writing_any_live_tensor(tmp_path):
    """Mutant: ckpt/manager.py restore reading in one pass at the forward level too
    (``gate.level != "structure"``). That level puts back only the models when it raises;
    a plain tensor written before the corrupt chunk was found would stay overwritten under
    an error that says nothing of it."""
    save_step(tmp_path, 1, make_state(1))
    last = chunks(tmp_path / "step-00000001")[-1]  # in "extra", stored last
    flip_byte(tmp_path / "step-00000001" / last["file"], last["start"] + last["length"] - 1)
    live = make_state(2)
    before = values(live)
    with CheckpointManager(tmp_path, read_only=True, metrics=False) as mgr:
        with pytest.raises(CorruptCheckpointError, match="digest mismatch") as info:
            mgr.restore(live, verify="forward")
    assert not isinstance(info.value, PartialLoadError)
    assert changed(live, before) == set()


def test_a_one_pass_restore_names_what_every_failed_step_overwrote(tmp_path):
    """Mutant: ckpt/manager.py restore keeping only the last failed step's tensors
    (``dirty = ...`` for ``dirty |= ...``). Step 2 fails at its last chunk, after writing
    every tensor; step 1 at its first. The error must name every tensor either overwrote,
    not only the one step 1 touched."""
    save_step(tmp_path, 1, make_state(1))
    save_step(tmp_path, 2, make_state(2))
    for step, which in ((1, 0), (2, -1)):
        c = chunks(tmp_path / f"step-{step:08d}")[which]
        flip_byte(tmp_path / f"step-{step:08d}" / c["file"], c["start"] + c["length"] // 2)
    live = make_state(3)
    before = values(live)
    with CheckpointManager(tmp_path, read_only=True, metrics=False) as mgr:
        with pytest.raises(PartialLoadError, match="no committed step") as info:
            mgr.restore(live)
    overwritten = changed(live, before)
    assert overwritten == set(before)  # (the case needs step 2 to have written them all)
    assert info.value.changed == overwritten
    assert f"overwrote {len(overwritten)} live tensors" in str(info.value)

