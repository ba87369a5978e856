"""The checks of one committed step on storage: its manifest is the one of its directory, and
every file it owns or reuses has the size the step needs."""

from __future__ import annotations

import os

import pytest
import torch

from ckpt import CheckpointManager, SaveOptions, Schedule
from ckpt._format.names import MANIFEST_NAME
from ckpt._step.integrity import check_structure, read_manifest
from ckpt.errors import CorruptCheckpointError
from ckpt._format.sealed import reseal
from storage_backends import PosixStorage


def save_steps(root, steps: dict, **kw) -> None:
    """Save ``steps`` (step -> state) in ``root`` (small chunks, one writer thread)."""
    kw.setdefault("options", SaveOptions(chunk_bytes=16 << 10, write_threads=1))
    with CheckpointManager(root, async_save=False, schedule=Schedule(handle_sigterm=False),
                           metrics=False, **kw) as mgr:
        for step, state in steps.items():
            mgr.save(step, state, force=True)


def test_a_manifest_that_names_another_step_than_its_directory_is_corrupt(tmp_path):
    """A manifest that names another step than its directory's (copied or edited there) is corrupt,
    though well formed on its own."""
    save_steps(tmp_path, {1: {"t": torch.ones(4)}, 2: {"t": torch.ones(4) * 2}})
    path = tmp_path / "step-00000002" / MANIFEST_NAME
    path.write_bytes(reseal(path.read_bytes().replace(b'"step":2', b'"step":5')))
    storage = PosixStorage(str(tmp_path))
    assert read_manifest(storage, "step-00000002").step == 5  # well formed on its own
    with pytest.raises(CorruptCheckpointError, match="manifest says step 5, but lies in "
                                                     "step-00000002"):
        read_manifest(storage, "step-00000002", 2)


def test_the_full_structure_check_compares_every_file_with_its_recorded_size(tmp_path):
    """The full structure check compares every file of the step with its recorded size: a data file
    that grew (bytes appended after its chunks) is not the file the step wrote."""
    save_steps(tmp_path, {1: {"t": torch.ones(64)}})
    storage = PosixStorage(str(tmp_path))
    manifest = read_manifest(storage, "step-00000001", 1)
    check_structure(storage, "step-00000001", manifest)
    name, size = next(iter(manifest.files.items()))
    with open(tmp_path / "step-00000001" / name, "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(CorruptCheckpointError, match=f"is {size + 8} bytes, the manifest "
                                                     f"recorded {size}"):
        check_structure(storage, "step-00000001", manifest)


def _two_incremental_steps(tmp_path, rank_tables: bool):
    """Steps 1 and 2 of an incremental chain, step 2 reusing step 1's chunks of a frozen
    tensor; returns the storage and step 2's manifest."""
    frozen = torch.randn(64, 64)
    save_steps(tmp_path, {1: {"frozen": frozen, "t": torch.zeros(4)},
                          2: {"frozen": frozen, "t": torch.ones(4)}},
               options=SaveOptions(chunk_bytes=4 << 10, write_threads=1, rank_tables=rank_tables,
                                   incremental=True, full_every=100))
    storage = PosixStorage(str(tmp_path))
    return storage, read_manifest(storage, "step-00000002", 2)


def test_the_full_structure_check_of_a_format2_step_sizes_the_files_it_reuses(tmp_path):
    """The full structure check of a format-2 step sizes the earlier steps' files it reuses (its
    ``refs``): one truncated below the bytes the step uses is refused."""
    storage, manifest = _two_incremental_steps(tmp_path, rank_tables=True)
    assert manifest.format_version == 2 and manifest.refs
    check_structure(storage, "step-00000002", manifest)
    (step, name), needed = next(iter(manifest.refs.items()))
    os.truncate(tmp_path / f"step-{step:08d}" / name, needed - 1)
    with pytest.raises(CorruptCheckpointError, match=f"shorter than the {needed} bytes step 2 "
                                                     "uses; the file is truncated"):
        check_structure(storage, "step-00000002", manifest)


def test_the_full_structure_check_of_a_format1_step_finds_a_reused_chunk_cut_short(tmp_path):
    """The full structure check of a format-1 incremental step finds a reused chunk cut short inside
    an earlier step's file, whose size only that earlier step records."""
    storage, manifest = _two_incremental_steps(tmp_path, rank_tables=False)
    reused = [c for c in manifest.tensors["frozen"].chunks if c.step == 1]
    assert manifest.format_version == 1 and reused
    check_structure(storage, "step-00000002", manifest)
    last = max(reused, key=lambda c: c.start)
    os.truncate(tmp_path / "step-00000001" / last.file, last.start + last.length - 1)
    with pytest.raises(CorruptCheckpointError, match="needs bytes .*; the file is truncated"):
        check_structure(storage, "step-00000002", manifest)


def test_the_full_structure_check_sizes_a_format2_steps_rank_tables(tmp_path):
    """The full structure check sizes a format-2 step's rank tables with its data files: a rank
    table cut short is refused."""
    save_steps(tmp_path, {1: {"t": torch.ones(64)}},
               options=SaveOptions(write_threads=1, rank_tables=True))
    storage = PosixStorage(str(tmp_path))
    manifest = read_manifest(storage, "step-00000001", 1)
    check_structure(storage, "step-00000001", manifest)
    name, size, _ = manifest.tables[0]
    os.truncate(tmp_path / "step-00000001" / name, size - 1)
    with pytest.raises(CorruptCheckpointError, match=f"{name} is {size - 1} bytes, the "
                                                     f"manifest recorded {size}"):
        check_structure(storage, "step-00000001", manifest)


def test_a_structure_level_restore_refuses_a_data_file_of_another_size(tmp_path):
    """A structure-level restore, which reads no digest, refuses a data file of another size than
    recorded (one replaced by a longer file whose chunk ranges still lie inside), and writes
    nothing."""
    save_steps(tmp_path, {1: {"t": torch.ones(64)}})
    data = next((tmp_path / "step-00000001").glob("data-*"))
    size = data.stat().st_size
    data.write_bytes(b"\xff" * (size + 8))  # another file: every chunk's bytes are wrong
    live = {"t": torch.zeros(64)}
    with CheckpointManager(tmp_path, read_only=True, metrics=False) as mgr:
        with pytest.raises(CorruptCheckpointError, match=f"is {size + 8} bytes, the manifest "
                                                         f"recorded {size}"):
            mgr.restore(live, step=1, verify="structure")
    assert not live["t"].any(), "a refused restore wrote"
