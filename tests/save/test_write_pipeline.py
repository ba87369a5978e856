"""Compressed saves: chunks are compressed on the pool while earlier files are written,
and the files are the same bytes as those of the one-thread path."""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
from pathlib import Path

import pytest
import torch

import ckpt
import ckpt._save.rank_write as rank_write
from ckpt import SaveOptions
from ckpt._save.payload import StepPayload
from ckpt._save.rank_write import write_rank
from ckpt._shared.buffers import byte_view
from ckpt._format.digest import digest
from storage_backends import PosixStorage

pytest.importorskip("zstandard")  # optional (GPU images lack it): every test here compresses
import numpy as np  # noqa: E402
import zstandard  # noqa: E402
from ckpt._format.codec import decode_into, encode  # noqa: E402

OPTIONS = SaveOptions(chunk_bytes=4096, write_threads=2, compression="zstd")


def weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "bf16": (torch.randn(96, 64, generator=gen) * 0.02).to(torch.bfloat16),
        "fp32": torch.randn(80, 32, generator=gen) * 0.02,
        "ints": torch.arange(3000, dtype=torch.int64) % 7,  # plain zstd (not grouped)
        "noise": torch.randint(0, 256, (5000,), generator=gen, dtype=torch.uint8),  # stays raw
        "empty": torch.zeros(0, 3),
    }


def payload(state: dict[str, torch.Tensor]) -> StepPayload:
    return StepPayload(
        step=1, name="step-00000001", token="fixedtoken01",
        pieces={k: ((0,) * t.dim(), t) for k, t in state.items()},
        tensors={k: (str(t.dtype).removeprefix("torch."), tuple(t.shape))
                 for k, t in state.items()},
        items={}, aliases={})


def written(root: Path, pool: cf.ThreadPoolExecutor | None):
    storage = PosixStorage(root)
    staging = storage.begin("step-00000001", "fixedtoken01")
    table = write_rank(storage, staging, payload(weights()), OPTIONS, pool)
    files = {name: (root / staging / name).read_bytes() for name in table.files}
    return table, files


def test_the_pipeline_writes_the_bytes_of_the_one_thread_path(tmp_path):
    with cf.ThreadPoolExecutor(2) as pool:
        table, files = written(tmp_path / "pooled", pool)
    serial_table, serial_files = written(tmp_path / "serial", None)
    assert files == serial_files
    assert json.dumps(table.to_json(), sort_keys=True) == json.dumps(
        serial_table.to_json(), sort_keys=True)
    assert len(files) == 2 * 4  # four files per writer thread
    state = weights()
    codecs = set()
    for key, chunk in table.chunks:
        stored = files[chunk.file][chunk.start:chunk.start + chunk.length]
        expected = state[key][chunk.offsets[0]:chunk.offsets[0] + chunk.shape[0]] if (
            state[key].dim()) else state[key]
        out = torch.empty_like(expected)
        if chunk.codec == "raw":
            byte_view(out)[:] = stored
        else:
            decode_into(chunk.codec, stored, byte_view(out), out.dtype)
        assert torch.equal(out, expected), (key, chunk.offsets)
        assert chunk.digest == digest(byte_view(expected.contiguous()))
        codecs.add(chunk.codec)
    assert codecs == {"raw", "zstd", "zstd-grouped"}


class _HeldWrites(PosixStorage):
    """Every data file's write waits until ``go`` is set (at most 20 s)."""

    def __init__(self, root, go: threading.Event) -> None:
        super().__init__(root)
        self.go = go
        self.released: list[bool] = []

    def write(self, path, buffers):
        if "data-" in path:
            self.released.append(self.go.wait(20))
        return super().write(path, buffers)


def test_compression_goes_on_while_every_writer_is_busy(tmp_path, monkeypatch):
    """Both writer threads are stuck writing (files 0 and 1); compressing file 2 must still
    start. (Were each thread to compress a file and then write it, nothing would.)"""
    file_of: dict[tuple[str, int], int] = {}
    chunk_of: dict[int, tuple[str, int]] = {}
    real_plan, real_assign = rank_write._plan, rank_write.assign_files
    real_encode = rank_write._encoder()

    def plan(payload, options):
        reused, to_write = real_plan(payload, options)
        chunk_of.update({id(data): (c.key, c.index) for c, data, _ in to_write})
        return reused, to_write

    def assign(chunks, n):
        groups = real_assign(chunks, n)
        file_of.update({(c.key, c.index): i for i, g in enumerate(groups) for c in g})
        return groups

    go = threading.Event()

    def encode(data, *args):
        if file_of[chunk_of[id(data)]] >= 2:
            go.set()
        return real_encode(data, *args)

    monkeypatch.setattr(rank_write, "_plan", plan)
    monkeypatch.setattr(rank_write, "assign_files", assign)
    monkeypatch.setattr(rank_write, "_encoder", lambda: encode)
    storage = _HeldWrites(tmp_path, go)
    with cf.ThreadPoolExecutor(2) as pool:
        staging = storage.begin("step-00000001", "fixedtoken01")
        write_rank(storage, staging, payload(weights()), OPTIONS, pool)
    assert len(storage.released) == 8 and all(storage.released)


class _FailsThirdFile(PosixStorage):
    def __init__(self, root) -> None:
        super().__init__(root)
        self.files = 0
        self.mutex = threading.Lock()

    def write(self, path, buffers):
        if "data-" in path:
            with self.mutex:
                self.files += 1
                if self.files == 3:
                    raise OSError(28, "No space left on device (injected)")
        return super().write(path, buffers)


def test_a_failed_write_fails_the_compressed_save_and_commits_nothing(tmp_path):
    storage = _FailsThirdFile(tmp_path)
    with ckpt.CheckpointManager(storage, async_save=False, options=OPTIONS,
                                schedule=ckpt.Schedule(handle_sigterm=False), metrics=False) as mgr:
        with pytest.raises(ckpt.CheckpointError, match="injected"):
            mgr.save(1, weights())
        assert mgr.steps() == []
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_level_1_on_grouped_floats_uses_the_cut_down_match_finder():
    """Weights compress through the cheap match finder: an ordinary zstd frame of the grouped
    bytes, smaller than zstd's own level 1 makes of them (the speed is benchmarked)."""
    import numpy as np
    import zstandard

    from ckpt._format.codec import encode

    w = (torch.randn(256, 1024, generator=torch.Generator().manual_seed(1)) * 0.02)
    for t in (w.to(torch.bfloat16), w):
        grouped = np.frombuffer(byte_view(t), np.uint8).reshape(-1, t.element_size()).T.tobytes()
        codec, stored = encode(byte_view(t), t.dtype, 1)
        assert codec == "zstd-grouped"
        assert zstandard.ZstdDecompressor().decompress(stored) == grouped
        assert len(stored) < len(zstandard.ZstdCompressor(level=1).compress(grouped))


# -------------------------------------------------------------- the zstd codec


def _unsized_frame(data: bytes) -> bytes:
    """A zstd frame whose header does not record its content size (a streaming writer's)."""
    return zstandard.ZstdCompressor(write_content_size=False).compress(data)


def test_a_chunks_zstd_frame_is_checked_against_the_chunks_size_before_it_is_expanded():
    """A chunk's zstd frame is checked against the chunk's size before it is expanded (a frame of
    another size, or of none recorded, is refused), and any damage is a ValueError, which the reader
    reports as corruption."""
    out = memoryview(bytearray(16))
    with pytest.raises(ValueError, match="zstd frame says 32 bytes, the chunk holds 16"):
        decode_into("zstd", zstandard.ZstdCompressor().compress(bytes(32)), out, torch.uint8)
    with pytest.raises(ValueError, match="zstd frame says -1 bytes"):  # (size unrecorded)
        decode_into("zstd", _unsized_frame(bytes(16)), out, torch.uint8)
    with pytest.raises(ValueError, match="zstd: "):
        decode_into("zstd", b"not a zstd frame", out, torch.uint8)
    decode_into("zstd", zstandard.ZstdCompressor().compress(b"x" * 16), out, torch.uint8)
    assert bytes(out) == b"x" * 16


def test_complex_chunks_group_the_bytes_of_each_real_and_imaginary_part():
    """Complex chunks group the bytes of each real and imaginary part (the width of the float, not
    of the complex item): the stored layout is part of the format."""
    values = torch.arange(64, dtype=torch.float32).reshape(32, 2)
    data = memoryview(torch.view_as_complex(values).numpy().tobytes())
    codec, stored = encode(data, torch.complex64)
    assert codec == "zstd-grouped"
    raw = zstandard.ZstdDecompressor().decompress(bytes(stored))
    assert raw == np.frombuffer(data, np.uint8).reshape(-1, 4).T.tobytes()
