"""An atomic load reads each chunk once where it can, and still changes nothing live when a
chunk is corrupt.

Chunks for new tensors (a state item held as a plain dict of tensors) are read once, straight
into them, and handed over only when every chunk has passed. Chunks for live tensors are read
once into staging memory where the storage keeps no page cache between two reads (object
stores), within a budget; over the budget they are verified first and read again. On every
path a corrupt *last* chunk leaves the live state as it was.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from ckpt import CheckpointManager, CorruptCheckpointError, SaveOptions
from ckpt._load import staging
from storage_backends import PosixStorage, fsspec_store
from storage_backends.fsspec_store import FsspecStorage
from tests.support.s3_fixture import _moto, s3  # noqa: F401  (fixtures)

# Small chunks, one writer thread: several chunks per tensor, all in one data file.
OPTIONS = SaveOptions(chunk_bytes=4096, write_threads=1)


class Counting(PosixStorage):
    """Counts the bytes of chunks a load reads, whichever way it reads them (the files'
    headers, before the first chunk, are not counted)."""

    def __init__(self, root) -> None:
        super().__init__(root, create=False)
        manifest = json.loads((Path(root) / "step-00000001" / "manifest.json").read_text())
        self.first = min(c["start"] for e in manifest["tensors"].values() for c in e["chunks"])
        self.data_read = 0

    def _count(self, path: str, start: int, n: int) -> None:
        if "manifest" not in path and start >= self.first:
            self.data_read += n

    def read_blocks(self, path, start, length, buffer):
        for part in super().read_blocks(path, start, length, buffer):
            self._count(path, start, len(part))
            start += len(part)
            yield part

    def open_reader(self, path):
        reader, storage = super().open_reader(path), self

        class Counted:
            def read_into(self, start, out):
                reader.read_into(start, out)
                storage._count(path, start, len(out))

            def close(self):
                reader.close()

        return Counted()


class NoPageCache(Counting):
    """Reads as an object store does (whole ranges, no page cache kept between two reads)."""

    stream_block = None


def save(root: Path, state: dict) -> int:
    """Saves ``state`` as step 1; returns the bytes of its chunks."""
    with CheckpointManager(root, async_save=False, options=OPTIONS, metrics=False) as mgr:
        mgr.save(1, state, force=True)
    manifest = json.loads((root / "step-00000001" / "manifest.json").read_text())
    return sum(c["length"] for e in manifest["tensors"].values() for c in e["chunks"])


def flip_last_chunk(root: Path) -> str:
    """Flips a bit in the chunk stored last; returns its tensor's key."""
    step = root / "step-00000001"
    manifest = json.loads((step / "manifest.json").read_text())
    key, last = max(((k, c) for k, e in manifest["tensors"].items() for c in e["chunks"]),
                    key=lambda kc: (kc[1]["file"], kc[1]["start"]))
    with open(step / last["file"], "r+b") as f:
        f.seek(last["start"] + last["length"] - 1)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    return key


def module(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 40, bias=False),
                               torch.nn.Linear(40, 16, bias=False))


def weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=gen), "v": torch.randn(48, 32, generator=gen)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def copy(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in sd.items()}


def test_a_load_into_new_tensors_reads_each_chunk_once(tmp_path):
    data = save(tmp_path, {"z_weights": weights(1)})
    storage = Counting(tmp_path)
    state = {"z_weights": None}
    with CheckpointManager(storage, read_only=True, metrics=False) as mgr:
        assert mgr.restore(state, step=1) == 1  # an explicit step: verified before applied
    assert same(state["z_weights"], weights(1))
    assert storage.data_read == data


def test_a_corrupt_last_chunk_of_new_tensors_leaves_the_live_state_untouched(tmp_path):
    """Read once into new tensors, the bad chunk is found after every other chunk (and the
    module's, verified first) was read: the module and the dict item stay as they were."""
    save(tmp_path, {"a_model": module(1), "z_weights": weights(1)})
    assert flip_last_chunk(tmp_path).startswith("z_weights/")
    live, held = module(2), weights(2)
    before_model, before_weights = copy(live.state_dict()), copy(held)
    state = {"a_model": live, "z_weights": held}
    with CheckpointManager(Counting(tmp_path), read_only=True, metrics=False) as mgr:
        with pytest.raises(CorruptCheckpointError, match="digest mismatch"):
            mgr.restore(state, step=1)
    assert state["z_weights"] is held and same(held, before_weights)
    assert same(live.state_dict(), before_model)


def test_live_tensors_without_a_page_cache_are_read_once_into_staging(tmp_path):
    data = save(tmp_path, {"model": module(1), "extra": torch.randn(40, 24)})
    storage = NoPageCache(tmp_path)
    live = module(2)
    param = live[0].weight
    state = {"model": live, "extra": torch.zeros(40, 24)}
    with CheckpointManager(storage, read_only=True, metrics=False) as mgr:
        assert mgr.restore(state, step=1) == 1
    assert same(live.state_dict(), module(1).state_dict())
    assert live[0].weight is param  # in place: the same parameter, its values replaced
    assert storage.data_read == data


def test_a_corrupt_last_chunk_on_the_staged_path_leaves_the_live_state_untouched(tmp_path):
    save(tmp_path, {"a_model": module(1), "z_extra": torch.randn(40, 24)})
    assert flip_last_chunk(tmp_path) == "z_extra"
    live, extra = module(2), torch.randn(40, 24)
    before_model, before_extra = copy(live.state_dict()), extra.clone()
    storage = NoPageCache(tmp_path)
    with CheckpointManager(storage, read_only=True, metrics=False) as mgr:
        with pytest.raises(CorruptCheckpointError, match="digest mismatch"):
            mgr.restore({"a_model": live, "z_extra": extra}, step=1)
    assert same(live.state_dict(), before_model) and torch.equal(extra, before_extra)


@pytest.mark.parametrize("tight", ["fraction", "ranks of the host"])
def test_live_tensors_over_the_staging_budget_are_verified_then_read_again(
        tmp_path, monkeypatch, caplog, tight):
    data = save(tmp_path, {"model": module(1)})
    if tight == "fraction":
        monkeypatch.setattr(staging, "BUDGET_FRACTION", 1e-15)  # a budget of 0 bytes
    else:  # so many ranks loading on this host that this one's share is 0 bytes
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(10 ** 15))
    caplog.set_level(logging.INFO, logger="ckpt")
    storage = NoPageCache(tmp_path)
    live = module(2)
    with CheckpointManager(storage, read_only=True, metrics=False) as mgr:
        assert mgr.restore({"model": live}, step=1) == 1
    assert same(live.state_dict(), module(1).state_dict())
    assert storage.data_read == 2 * data
    assert any("exceed the staging budget" in r.getMessage() for r in caplog.records)


class CountingS3(FsspecStorage):
    """An S3 root that counts the bytes of the ranged GETs a load asks for."""

    data_read = 0

    def read_into(self, path, start, out):
        super().read_into(path, start, out)
        if "manifest" not in path:
            self.data_read += memoryview(out).nbytes


@pytest.mark.s3
def test_an_in_place_load_from_s3_downloads_each_chunk_once(s3, monkeypatch):
    # Reads of a block or more are ranged GETs of their own, past the block cache: with
    # 64 KiB blocks, every 64 KiB chunk of this state is one.
    monkeypatch.setattr(fsspec_store, "READ_BLOCK", 64 << 10)
    big = torch.nn.Linear(256, 256, bias=False)
    root = s3.root("once")
    with CheckpointManager(root, async_save=False, storage_options=s3.storage_options,
                           options=SaveOptions(chunk_bytes=64 << 10), metrics=False) as mgr:
        mgr.save(1, {"model": big}, force=True)
    storage = CountingS3(root, create=False, storage_options=s3.storage_options)
    live = torch.nn.Linear(256, 256, bias=False)
    with CheckpointManager(storage, read_only=True, metrics=False) as mgr:
        assert mgr.restore({"model": live}, step=1) == 1
    assert torch.equal(live.weight, big.weight)
    assert storage.data_read == big.weight.numel() * 4
