"""Data files start their data 64-byte aligned (ckpt/_format/datafile.py): a chunk read straight into
a tensor (64-byte aligned by torch's allocator) from a file offset that differs from it modulo
64 costs the kernel's copy about 20% more CPU per byte (benchmarks/bench_memory_tier.py)."""

from __future__ import annotations

import safetensors.torch
import torch

import ckpt
from ckpt._format.names import step_dir
from ckpt._format.datafile import Piece


def test_every_chunk_of_cache_line_sized_tensors_starts_64_byte_aligned(tmp_path):
    # Key names of many lengths: an 8-byte padded header would put the data at offsets
    # 8 (mod 64) apart from one save to another, so some of these would miss.
    for n in range(1, 9):
        state = {f"{'k' * n}{i}": torch.rand(2, 16 * (i + 1)) for i in range(n)}
        root = tmp_path / f"r{n}"
        with ckpt.CheckpointManager(str(root), async_save=False) as mgr:
            mgr.save(1, state)
            manifest = mgr.manifest(1)
        starts = {c.start for e in manifest.tensors.values() for c in e.chunks}
        assert starts and all(s % 64 == 0 for s in starts), sorted(s % 64 for s in starts)
        for name in manifest.files:  # still a safetensors file, padding and all
            loaded = safetensors.torch.load_file(str(root / step_dir(1) / name))
            assert all(torch.equal(loaded[k], state[k.split("#")[0]]) for k in loaded)


def test_an_odd_sized_tensor_does_not_misalign_the_chunks_after_it(tmp_path):
    # Saved in this order, "a" (12 bytes) would put every later piece at 12 (mod 64).
    state = {"a": torch.rand(3), "b": torch.rand(4, 16), "c": torch.rand(8, 32), "d": torch.rand(5)}
    with ckpt.CheckpointManager(str(tmp_path), async_save=False,
                                options=ckpt.SaveOptions(write_threads=1)) as mgr:
        mgr.save(1, state)
        manifest = mgr.manifest(1)
        restored = {k: torch.zeros_like(v) for k, v in state.items()}
        mgr.restore(restored)
    assert len(manifest.files) == 1
    for key in ("b", "c"):
        assert all(c.start % 64 == 0 for c in manifest.tensors[key].chunks), key
    assert all(torch.equal(restored[k], state[k]) for k in state)


def test_a_compressed_piece_is_labelled_as_the_bytes_it_holds():
    """A compressed piece is labelled in the safetensors header as the bytes it holds (U8 of its
    stored length), a raw one as its tensor: safetensors readers read the file as it is."""
    piece = Piece("t", memoryview(b"abc"), torch.float32, (4,), stored_raw=False)
    assert piece.header_entry(64) == {"dtype": "U8", "shape": [3], "data_offsets": [64, 67]}
    raw = Piece("t", memoryview(bytes(16)), torch.float32, (4,))
    assert raw.header_entry(0) == {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
