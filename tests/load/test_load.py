"""Loads change nothing when they fail, in bounded memory.

A chunk's digest is checked before the first live tensor is written, so a corrupt *last*
chunk is the hard case: a one-pass load would already have overwritten everything before it.
``restore()`` of the newest step is that one-pass load: there the step loaded next must
repair what it overwrote, or the error must name it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import CheckpointManager, CorruptCheckpointError, PartialLoadError, SaveOptions
from ckpt.errors import StateMismatchError
from storage_backends import PosixStorage

# Small chunks and one writer thread: every tensor spans several chunks of one data file,
# so "the last chunk" is the last one read.
OPTIONS = SaveOptions(chunk_bytes=4096, write_threads=1)


def make_state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 32))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return {"model": model, "extra": torch.randn(48, 32, generator=gen), "epoch": seed}


def snapshot(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in state["model"].state_dict().items()}
    out["extra"] = state["extra"].clone()
    return out


def assert_unchanged(state: dict, before: dict[str, torch.Tensor]) -> None:
    now = snapshot(state)
    changed = [k for k in before if not torch.equal(before[k], now[k])]
    assert changed == [], f"a failed load changed {changed}"


def last_chunk(step_dir: Path) -> tuple[Path, int]:
    """The data file and byte offset of the chunk stored last."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    chunks = [c for e in manifest["tensors"].values() for c in e["chunks"]]
    last = max(chunks, key=lambda c: (c["file"], c["start"]))
    return step_dir / last["file"], last["start"] + last["length"] - 1


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def save_step(root: Path, step: int, state: dict) -> None:
    with CheckpointManager(root, async_save=False, options=OPTIONS, metrics=False,
                           schedule=ckpt.Schedule(handle_sigterm=False)) as mgr:
        mgr.save(step, state)


def test_corrupt_last_chunk_of_an_explicit_step_changes_nothing(tmp_path):
    save_step(tmp_path, 1, make_state(1))
    flip_byte(*last_chunk(tmp_path / "step-00000001"))
    live = make_state(2)
    before = snapshot(live)
    with CheckpointManager(tmp_path, read_only=True, metrics=False) as mgr:
        with pytest.raises(CorruptCheckpointError, match="digest mismatch"):
            mgr.restore(live, step=1)
    assert_unchanged(live, before)
    assert live["epoch"] == 2


def test_corrupt_last_chunk_under_ckpt_load_changes_nothing(tmp_path):
    ckpt.save(make_state(1), tmp_path / "c", options=OPTIONS)
    flip_byte(*last_chunk(tmp_path / "c"))
    live = make_state(2)
    before = snapshot(live)
    with pytest.raises(CorruptCheckpointError, match="digest mismatch"):
        ckpt.load(live, tmp_path / "c")
    assert_unchanged(live, before)


def test_strict_fallback_past_a_corrupt_step_to_a_mismatched_one_changes_nothing(tmp_path):
    """Step 2 has a flipped byte, step 1 lacks an item. Verified before
    writing (strict), the error says nothing was loaded, and that must be true."""
    old = make_state(1)
    save_step(tmp_path, 1, {"model": old["model"], "epoch": 1})  # no "extra"
    save_step(tmp_path, 2, make_state(2))
    flip_byte(*last_chunk(tmp_path / "step-00000002"))
    live = make_state(3)
    before = snapshot(live)
    with CheckpointManager(tmp_path, read_only=True, metrics=False) as mgr:
        with pytest.raises(CorruptCheckpointError, match="digest mismatch"):
            mgr.restore(live, strict=True)
    assert_unchanged(live, before)


def test_one_pass_fallback_to_a_mismatched_step_names_the_overwritten_tensors(tmp_path):
    """The same for the newest step read in one pass: step 2's corrupt last
    chunk is found after the other tensors were written; step 1 cannot repair them (it
    lacks an item), so the error must say the state is mixed and name them."""
    old = make_state(1)
    save_step(tmp_path, 1, {"model": old["model"], "epoch": 1})  # no "extra"
    saved = make_state(2)
    save_step(tmp_path, 2, saved)
    flip_byte(*last_chunk(tmp_path / "step-00000002"))  # in "extra", stored last
    live = make_state(3)
    before, new = snapshot(live), snapshot(saved)
    with CheckpointManager(tmp_path, read_only=True, metrics=False) as mgr:
        with pytest.raises(PartialLoadError, match="'extra' is not in the checkpoint") as info:
            mgr.restore(live)
        assert [s for s, _ in mgr.skipped] == [2]
    now = snapshot(live)
    written = {k for k in now if not torch.equal(now[k], before[k])}
    assert {k for k in now if torch.equal(now[k], new[k])} == written - {"extra"}
    assert "extra" in written  # partly overwritten before its corrupt chunk
    assert info.value.changed == {k.replace("model.", "model/") for k in written}
    assert "the live state is mixed" in str(info.value)


def test_one_pass_restore_falls_back_and_repairs_every_tensor_it_overwrote(tmp_path):
    """The newest step is read once; its corrupt last chunk is found after every other
    tensor was written; the older step loaded next overwrites them all."""
    save_step(tmp_path, 1, make_state(1))
    save_step(tmp_path, 2, make_state(2))
    data_file, last_byte = last_chunk(tmp_path / "step-00000002")
    flip_byte(data_file, last_byte)
    live = make_state(3)
    with CheckpointManager(tmp_path, read_only=True, metrics=False) as mgr:
        assert mgr.restore(live) == 1
        assert [s for s, _ in mgr.skipped] == [2]
        why = mgr.skipped[0][1]  # the corruption, not the advice to load a good step again
        assert "digest mismatch" in why and "reloaded from the next step" in why, why
        assert "live state is mixed" not in why, why
        info = mgr.last_restore
    assert_unchanged(live, snapshot(make_state(1)))
    assert live["epoch"] == 1
    # each byte read once: step 2 up to its corrupt chunk, then step 1 whole (no verify
    # pass, which would read step 1 twice), and the two manifests
    data = sum(f.stat().st_size for f in (tmp_path / "step-00000001").glob("data-*"))
    manifests = sum(f.stat().st_size for f in tmp_path.glob("step-*/manifest.json"))
    assert last_byte > data / 2  # (so a second read of step 1 would show)
    assert data + last_byte - 4096 < info.bytes_from_storage <= data + last_byte + 1 + manifests


def test_one_pass_restore_of_a_step_that_no_step_repairs_says_so(tmp_path):
    save_step(tmp_path, 1, make_state(1))
    flip_byte(*last_chunk(tmp_path / "step-00000001"))
    live = make_state(2)
    with CheckpointManager(tmp_path, read_only=True, metrics=False) as mgr:
        with pytest.raises(PartialLoadError, match="no committed step") as info:
            mgr.restore(live)
    assert "extra" in info.value.changed and "model/0.weight" in info.value.changed
    assert "digest mismatch" in str(info.value) and "the live state is mixed" in str(info.value)


class _OddBlocks(PosixStorage):
    """Streams the verify pass through blocks of a size that divides no chunk, so blocks
    end mid-chunk and begin one chunk while they end another."""

    stream_block = 1000


def chunk_records(step_dir: Path) -> list[dict]:
    manifest = json.loads((step_dir / "manifest.json").read_text())
    return sorted((c for e in manifest["tensors"].values() for c in e["chunks"]),
                  key=lambda c: (c["file"], c["start"]))


def test_streamed_verification_across_odd_blocks_loads_exactly(tmp_path):
    saved = make_state(1)
    saved["empty"] = torch.zeros(0, 7)  # a zero-length chunk among the others
    save_step(tmp_path, 1, saved)
    assert any(c["length"] > 1000 for c in chunk_records(tmp_path / "step-00000001"))
    live = make_state(2)
    live["empty"] = torch.zeros(0, 7)
    with CheckpointManager(_OddBlocks(tmp_path), read_only=True, metrics=False) as mgr:
        assert mgr.restore(live, step=1) == 1
    assert_unchanged(live, snapshot(saved))


@pytest.mark.parametrize("storage_type", [PosixStorage, _OddBlocks])
def test_a_corrupt_byte_in_any_chunk_changes_nothing(tmp_path, storage_type):
    """Each chunk in turn gets one flipped byte (first, middle or last of the chunk):
    every restore of that explicit step fails and leaves every live tensor as it was."""
    save_step(tmp_path, 1, make_state(1))
    step_dir = tmp_path / "step-00000001"
    records = chunk_records(step_dir)
    assert len(records) >= 6
    for n, c in enumerate(records):
        offset = c["start"] + [0, c["length"] // 2, c["length"] - 1][n % 3]
        flip_byte(step_dir / c["file"], offset)
        live = make_state(2)
        before = snapshot(live)
        with CheckpointManager(storage_type(tmp_path), read_only=True, metrics=False) as mgr:
            with pytest.raises(CorruptCheckpointError, match="digest mismatch"):
                mgr.restore(live, step=1)
        assert_unchanged(live, before)
        flip_byte(step_dir / c["file"], offset)  # repaired for the next round


@pytest.mark.parametrize("storage_type", [PosixStorage, _OddBlocks])
def test_a_corrupt_byte_in_any_block_of_any_chunk_fails_a_one_pass_restore(tmp_path,
                                                                           storage_type):
    """restore() reads the newest step once, digesting block by block as the blocks land
    (with _OddBlocks: 1000-byte blocks, so chunks end mid-block): a flipped byte anywhere
    must still fail the step (only step 1 exists: PartialLoadError names what it wrote)."""
    save_step(tmp_path, 1, make_state(1))
    step_dir = tmp_path / "step-00000001"
    records = chunk_records(step_dir)
    for n, c in enumerate(records):
        offset = c["start"] + [0, c["length"] // 2, c["length"] - 1][n % 3]
        flip_byte(step_dir / c["file"], offset)
        with CheckpointManager(storage_type(tmp_path), read_only=True, metrics=False) as mgr:
            with pytest.raises(PartialLoadError, match="digest mismatch"):
                mgr.restore(make_state(2))
        flip_byte(step_dir / c["file"], offset)  # repaired for the next round
    live = make_state(2)
    with CheckpointManager(storage_type(tmp_path), read_only=True, metrics=False) as mgr:
        assert mgr.restore(live) == 1
    assert_unchanged(live, snapshot(make_state(1)))


def test_a_one_pass_load_that_fails_names_what_it_overwrote(tmp_path):
    saved = make_state(1)
    ckpt.save(saved, tmp_path / "c", options=OPTIONS)
    flip_byte(*last_chunk(tmp_path / "c"))
    live = make_state(2)
    before, new = snapshot(live), snapshot(saved)
    with pytest.raises(PartialLoadError) as info:
        ckpt.load(live, tmp_path / "c", atomic=False)
    message = str(info.value)
    assert "digest mismatch" in message
    now = snapshot(live)
    full = [k for k in now if torch.equal(now[k], new[k])]
    untouched = [k for k in now if torch.equal(now[k], before[k])]
    assert full and len(full) + len(untouched) < len(now)  # one tensor is half written
    assert f"{len(full)} tensors hold step 0's values" in message
    assert f"{len(now) - len(full) - len(untouched)} are partly overwritten" in message


def test_load_allocates_a_few_chunks_not_a_second_copy(tmp_path, monkeypatch):
    """The extra memory of a load into an existing state is a few chunk-sized buffers."""
    state = {f"t{i}": torch.randn(256, 1024) for i in range(16)}  # 16 MiB in 1 MiB tensors
    options = SaveOptions(chunk_bytes=256 << 10, write_threads=2)
    ckpt.save(state, tmp_path / "c", options=options)
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    allocated = []
    real_empty = torch.empty

    def counting_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        allocated.append(t.numel() * t.element_size())
        return t

    monkeypatch.setattr(torch, "empty", counting_empty)
    ckpt.load(live, tmp_path / "c")
    monkeypatch.undo()
    assert all(torch.equal(live[k], state[k]) for k in state)
    # one block buffer per reading thread (main + 2 pool threads); a second copy: 16 MiB
    assert sum(allocated) <= 3 * PosixStorage.stream_block, f"{sum(allocated)} bytes allocated"


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_non_contiguous_and_fresh_destinations_load_exactly(tmp_path, compression):
    gen = torch.Generator().manual_seed(0)
    state = {"t": torch.randn(96, 80, generator=gen), "vals": {"w": torch.arange(10.0)}}
    ckpt.save(state, tmp_path / "c",
              options=SaveOptions(chunk_bytes=4096, compression=compression))
    live = {"t": torch.zeros(80, 96).t(), "vals": None}  # a transposed view: bounce path
    assert not live["t"].is_contiguous()
    ckpt.load(live, tmp_path / "c")
    assert torch.equal(live["t"], state["t"])
    assert torch.equal(live["vals"]["w"], state["vals"]["w"])


class _FailsApplyRead(PosixStorage):
    """The verify pass reads ``target`` (path, start) fine, streamed through ``read_blocks``;
    the apply pass's read of it (through ``open_reader``) fails: a disk error, or a file
    removed between the two reads."""

    def __init__(self, root, target):
        super().__init__(root)
        self.target, self.verified, self.failed = target, False, False

    def read_blocks(self, path, start, length, buffer):
        if path == self.target[0] and start <= self.target[1] < start + length:
            self.verified = True
        return super().read_blocks(path, start, length, buffer)

    def open_reader(self, path):
        reader, storage = super().open_reader(path), self

        class Failing:
            def read_into(self, start, out):
                if (path, start) == storage.target:
                    storage.failed = True
                    raise OSError(5, "Input/output error (injected)")
                reader.read_into(start, out)

            def close(self):
                reader.close()

        return Failing()


def test_a_restore_that_fails_after_writing_says_what_it_wrote_and_stops(tmp_path):
    save_step(tmp_path, 1, make_state(1))
    save_step(tmp_path, 2, make_state(2))
    data_file, last_byte = last_chunk(tmp_path / "step-00000002")
    manifest = json.loads((tmp_path / "step-00000002" / "manifest.json").read_text())
    start = max(c["start"] for e in manifest["tensors"].values() for c in e["chunks"]
                if c["file"] == data_file.name)
    storage = _FailsApplyRead(tmp_path, (f"step-00000002/{data_file.name}", start))
    live = make_state(3)
    with CheckpointManager(storage, read_only=True, metrics=False) as mgr:
        with pytest.raises(PartialLoadError, match="injected") as info:
            mgr.restore(live)  # the newest step: one pass, no verify pass before it
        assert mgr.skipped == []  # not taken for a bad step: step 1 was not tried on top
    assert "partly overwritten" in str(info.value) and "are unchanged" in str(info.value)
    assert storage.failed and not storage.verified
    storage.failed = False
    with CheckpointManager(storage, read_only=True, metrics=False) as mgr:
        with pytest.raises(PartialLoadError, match="injected") as info:
            mgr.restore(live, strict=True)  # verified first, then the read fails
    assert storage.verified and storage.failed


class _TruncatesAfterVerify(PosixStorage):
    """Cuts ``victim`` short (a real truncation) once the verify pass has streamed it whole,
    before the apply pass reads it again."""

    def __init__(self, root, victim, keep):
        super().__init__(root)
        self.victim, self.keep = victim, keep

    def read_blocks(self, path, start, length, buffer):
        yield from super().read_blocks(path, start, length, buffer)
        if path == self.victim:
            os.truncate(os.path.join(self.root, path), self.keep)


def test_a_file_truncated_between_the_passes_is_reported_never_zero_filled(tmp_path):
    save_step(tmp_path, 1, make_state(1))
    data_file, last_byte = last_chunk(tmp_path / "step-00000001")
    keep = last_byte + 1 - 1000  # the last chunk loses its last 1000 bytes (250 floats)
    storage = _TruncatesAfterVerify(tmp_path, f"step-00000001/{data_file.name}", keep)
    live = make_state(2)
    before = snapshot(live)
    with CheckpointManager(storage, read_only=True, metrics=False) as mgr:
        with pytest.raises(PartialLoadError, match=f"ends before byte {last_byte + 1}") as info:
            mgr.restore(live, step=1)
    assert data_file.stat().st_size == keep
    assert "partly overwritten (extra)" in str(info.value)  # "extra" is stored last
    # the bytes the file no longer has were never written: the old values, not zeros
    assert torch.equal(live["extra"].reshape(-1)[-250:], before["extra"].reshape(-1)[-250:])


class _CountsOpens(PosixStorage):
    def __init__(self, root):
        super().__init__(root)
        self.opens = 0

    def _open_read(self, path):
        self.opens += 1
        return super()._open_read(path)


def test_each_pass_opens_each_file_once_per_thread_not_once_per_chunk(tmp_path):
    state = {f"t{i}": torch.randn(64, 64) for i in range(32)}  # 32 chunks in 2 files
    with CheckpointManager(tmp_path, async_save=False, metrics=False,
                           schedule=ckpt.Schedule(handle_sigterm=False),
                           options=SaveOptions(chunk_bytes=16 << 10, write_threads=2)) as mgr:
        mgr.save(1, state)
    storage = _CountsOpens(tmp_path)
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    with CheckpointManager(storage, read_only=True, metrics=False) as mgr:
        storage.opens = 0
        mgr.restore(live, step=1)
    assert all(torch.equal(live[k], state[k]) for k in state)
    # verify: one streamed run per file; apply: each file once per reading thread (<= 3)
    assert storage.opens <= 2 + 2 * 3, f"{storage.opens} opens for 2 files"


class GcProbe:
    """A stateful item that records whether the cyclic GC is enabled while it is loaded."""

    def __init__(self) -> None:
        self.w = torch.zeros(8)
        self.gc_enabled: list[bool] = []

    def state_dict(self) -> dict:
        return {"w": self.w}

    def load_state_dict(self, sd: dict) -> None:
        import gc

        self.gc_enabled.append(gc.isenabled())
        self.w.copy_(sd["w"])


def test_a_load_runs_with_the_cyclic_gc_paused_and_restores_it(tmp_path):
    import gc

    probe = GcProbe()
    with CheckpointManager(str(tmp_path), async_save=False) as mgr:
        mgr.save(1, {"probe": probe})
        assert gc.isenabled()
        assert mgr.restore({"probe": probe}) == 1
        assert probe.gc_enabled == [False]  # a full collection never runs inside the load
        assert gc.isenabled()  # and the collector is back afterwards


class CountingPool:
    """A thread pool that counts the tasks it is given."""

    def __init__(self) -> None:
        import concurrent.futures as cf

        self.pool, self.submitted = cf.ThreadPoolExecutor(2), 0

    def submit(self, *args, **kwargs):
        self.submitted += 1
        return self.pool.submit(*args, **kwargs)


class RequestStorage(PosixStorage):
    """Reads as an object store's: no streamed blocks, every read a request of its own."""

    stream_block = None


@pytest.mark.parametrize("rows,storage_type,threads", [
    (4, PosixStorage, False),  # 16 KiB chunks: the per-chunk Python outweighs the bytes
    (256, PosixStorage, True),  # 1 MiB chunks
    (4, RequestStorage, True),  # small requests: threads overlap their latency
])
def test_chunks_too_small_for_threads_are_read_on_the_calling_thread(tmp_path, rows,
                                                                     storage_type, threads):
    from ckpt._step.integrity import read_manifest
    from ckpt._load.reader import load_step

    state = {f"t{i}": torch.randn(rows, 1024) for i in range(8)}  # in 2 files
    with CheckpointManager(tmp_path, async_save=False, metrics=False,
                           schedule=ckpt.Schedule(handle_sigterm=False),
                           options=SaveOptions(write_threads=2)) as mgr:
        mgr.save(1, state)
    storage = storage_type(str(tmp_path))
    live, pool = {k: torch.zeros_like(v) for k, v in state.items()}, CountingPool()
    load_step(storage, "step-00000001", read_manifest(storage, "step-00000001", 1), live,
              pool=pool)
    pool.pool.shutdown()
    assert all(torch.equal(live[k], state[k]) for k in state)
    assert (pool.submitted > 0) == threads


# ----------------------------------------- descriptors, reused files, one-pass fallbacks


def open_files_under(root: Path) -> list[str]:
    """Files under ``root`` this process holds open (its descriptors, from /proc)."""
    prefix = str(root.resolve()) + os.sep
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used, closed meanwhile
            continue
        if target.startswith(prefix):
            out.append(target)
    return out


def test_a_load_closes_every_data_file_it_opened_whether_it_succeeds_or_fails(tmp_path):
    """A restore closes every data file it opened, whether it succeeds or fails its digest check: a
    trainer that restores often must not run out of descriptors."""
    state = {f"t{i}": torch.randn(64, 64) for i in range(16)}
    with CheckpointManager(tmp_path, async_save=False, metrics=False,
                           schedule=ckpt.Schedule(handle_sigterm=False),
                           options=SaveOptions(chunk_bytes=16 << 10, write_threads=2)) as mgr:
        mgr.save(1, state)
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    with CheckpointManager(tmp_path, read_only=True, metrics=False) as mgr:
        mgr.restore(live, step=1)
        assert all(torch.equal(live[k], state[k]) for k in state)
        assert open_files_under(tmp_path) == [], "a restore left data files open"
        data = sorted((tmp_path / "step-00000001").glob("data-*"))
        last = data[-1].stat().st_size - 1  # a chunk's last byte
        with open(data[-1], "r+b") as f:  # one flipped bit: the verify pass fails
            f.seek(last)
            byte = f.read(1)
            f.seek(last)
            f.write(bytes([byte[0] ^ 1]))
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(live, step=1)
        assert open_files_under(tmp_path) == [], "a failed restore left data files open"


def test_a_truncated_file_of_an_earlier_step_is_refused_before_anything_changes(tmp_path):
    """An incremental step reads its unchanged chunks from an earlier step's files, whose size its
    own manifest does not record. Truncated, they are refused by a structure-level restore before it
    writes anything, not half-way through the apply pass (PartialLoadError)."""
    frozen, trained = torch.randn(256, 64), torch.randn(64, 64)
    with CheckpointManager(tmp_path, async_save=False, metrics=False,
                           schedule=ckpt.Schedule(handle_sigterm=False),
                           options=SaveOptions(chunk_bytes=16 << 10, write_threads=1,
                                               incremental=True, full_every=100)) as mgr:
        mgr.save(1, {"frozen": frozen, "trained": trained})
        mgr.save(2, {"frozen": frozen, "trained": trained + 1}, force=True)
    for data in (tmp_path / "step-00000001").glob("data-*"):
        os.truncate(data, 60_000)  # into the last chunk of "frozen", which step 2 reuses
    live = {"frozen": torch.zeros(256, 64), "trained": torch.zeros(64, 64)}
    with CheckpointManager(tmp_path, read_only=True, metrics=False) as mgr:
        with pytest.raises(CorruptCheckpointError, match="is truncated") as info:
            mgr.restore(live, step=2, verify="structure")
    assert not isinstance(info.value, PartialLoadError)
    assert not live["frozen"].any() and not live["trained"].any(), "a refused restore wrote"


def linear_state(seed: int) -> dict:
    """A Linear model and a plain tensor, their values drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(32, 48)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return {"model": model, "extra": torch.randn(48, 32, generator=gen)}


def stored_tensors(state: dict) -> dict[str, torch.Tensor]:
    """The state's tensors by their stored keys, copied."""
    out = {f"model/{k}": v.detach().clone() for k, v in state["model"].state_dict().items()}
    out["extra"] = state["extra"].clone()
    return out


def changed_tensors(state: dict, before: dict[str, torch.Tensor]) -> set[str]:
    """The stored keys of the tensors of ``state`` that differ from ``before``."""
    now = stored_tensors(state)
    return {k for k in before if not torch.equal(now[k], before[k])}


class _NoStreaming(PosixStorage):
    """A storage that does not stream (as an object store, where every read is a request):
    a one-pass load reads each chunk whole and must digest it all the same."""

    stream_block = None


@pytest.mark.parametrize("storage_type", [_NoStreaming, _OddBlocks])
def test_a_one_pass_restore_reads_and_digests_every_byte_whatever_the_storage(
        tmp_path, storage_type):
    """A one-pass restore digests every byte of every chunk whatever the storage: one that does not
    stream (an object store: each chunk is read whole) and one that streams in blocks that divide no
    chunk (each block read at its own offset). A flipped bit makes it fall back to the step before,
    exact."""
    save_step(tmp_path, 1, linear_state(1))
    save_step(tmp_path, 2, linear_state(2))
    records = chunk_records(tmp_path / "step-00000002")
    middle = max(records[1:-1], key=lambda c: c["length"])  # neither first nor last
    assert len(records) >= 4 and middle["length"] > 2000  # (several blocks of _OddBlocks)
    live = linear_state(3)
    with CheckpointManager(storage_type(tmp_path), read_only=True, metrics=False) as mgr:
        assert mgr.restore(live) == 2
    assert changed_tensors(live, stored_tensors(linear_state(2))) == set()
    flip_byte(tmp_path / "step-00000002" / middle["file"], middle["start"] + middle["length"] - 1)
    live = linear_state(3)
    with CheckpointManager(storage_type(tmp_path), read_only=True, metrics=False) as mgr:
        assert mgr.restore(live) == 1
        assert [s for s, _ in mgr.skipped] == [2] and "digest mismatch" in mgr.skipped[0][1]
    assert changed_tensors(live, stored_tensors(linear_state(1))) == set()


def test_the_forward_level_verifies_a_step_before_writing_any_live_tensor(tmp_path):
    """At the forward level a restore verifies the whole step before it writes a live tensor: that
    level puts back only the models when it raises, so a plain tensor written before the corrupt
    chunk was found would stay overwritten under an error that says nothing of it."""
    save_step(tmp_path, 1, linear_state(1))
    last = chunk_records(tmp_path / "step-00000001")[-1]  # in "extra", stored last
    flip_byte(tmp_path / "step-00000001" / last["file"], last["start"] + last["length"] - 1)
    live = linear_state(2)
    before = stored_tensors(live)
    with CheckpointManager(tmp_path, read_only=True, metrics=False) as mgr:
        with pytest.raises(CorruptCheckpointError, match="digest mismatch") as info:
            mgr.restore(live, verify="forward")
    assert not isinstance(info.value, PartialLoadError)
    assert changed_tensors(live, before) == set()


def test_a_one_pass_restore_names_what_every_failed_step_overwrote(tmp_path):
    """When every step fails part-way through a one-pass restore, the error names every tensor any
    of them overwrote. Step 2 fails at its last chunk, after writing every tensor; step 1 at its
    first."""
    save_step(tmp_path, 1, linear_state(1))
    save_step(tmp_path, 2, linear_state(2))
    for step, which in ((1, 0), (2, -1)):
        c = chunk_records(tmp_path / f"step-{step:08d}")[which]
        flip_byte(tmp_path / f"step-{step:08d}" / c["file"], c["start"] + c["length"] // 2)
    live = linear_state(3)
    before = stored_tensors(live)
    with CheckpointManager(tmp_path, read_only=True, metrics=False) as mgr:
        with pytest.raises(PartialLoadError, match="no committed step") as info:
            mgr.restore(live)
    overwritten = changed_tensors(live, before)
    assert overwritten == set(before)  # (the case needs step 2 to have written them all)
    assert info.value.changed == overwritten
    assert f"overwrote {len(overwritten)} live tensors" in str(info.value)


class _DiskErrorInStep1(PosixStorage):
    """Step 1's data files fail with an I/O error after ``reads`` reads (a disk error: not
    the step's corruption, so no older step is tried after it)."""

    reads = 1

    def open_reader(self, path):
        reader = super().open_reader(path)
        if "step-00000001" not in path:
            return reader

        allowed = self.reads

        class Failing:
            reads = 0

            def read_into(self, start, out):
                self.reads += 1
                if self.reads > allowed:
                    raise OSError(5, "Input/output error")
                reader.read_into(start, out)

            def close(self):
                reader.close()

        return Failing()


@pytest.mark.parametrize("corrupt, reads", [(-1, 1), (0, 3)])
def test_a_fallback_step_that_fails_on_a_disk_error_names_what_the_newer_step_overwrote(
        tmp_path, corrupt, reads):
    """A fallback step that stops on a disk error (not corruption: no older step is tried after it)
    raises PartialLoadError naming every tensor either step wrote, the newer step's one-pass read
    included. Step 2 fails its digest at its last chunk (after overwriting every tensor) or at its
    first; step 1 then fails on an I/O error after ``reads`` chunks."""
    save_step(tmp_path, 1, linear_state(1))
    save_step(tmp_path, 2, linear_state(2))
    c = chunk_records(tmp_path / "step-00000002")[corrupt]
    flip_byte(tmp_path / "step-00000002" / c["file"], c["start"] + c["length"] - 1)
    live = linear_state(3)
    before = stored_tensors(live)
    storage = type("Disk", (_DiskErrorInStep1,), {"reads": reads})(tmp_path)
    with CheckpointManager(storage, read_only=True, metrics=False) as mgr:
        with pytest.raises(PartialLoadError, match="Input/output error") as info:
            mgr.restore(live)
        assert [s for s, _ in mgr.skipped] == [2]
    overwritten = changed_tensors(live, before)
    assert len(overwritten) >= 2  # (the case needs two tensors changed)
    # every tensor that changed is named (a read that failed may have begun to write one)
    assert overwritten <= info.value.changed <= set(before)
    assert "a failed one-pass read of a newer step had already overwritten" in str(info.value)
