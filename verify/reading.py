"""Reading chunks and whole tensors for verify, diff and export, with every failure that
damaged data can cause reported as :class:`ckpt.CorruptCheckpointError` naming the file.

``ckpt.reader.read_chunk`` turns short reads, missing files and digest mismatches into that
error, but lets a zstd decoding failure through as ``zstandard.ZstdError`` (and a flipped
bit in a frame's content size can make zstandard attempt a huge allocation: MemoryError).
Here those become corruption reports too, so a damaged compressed chunk fails a check
instead of crashing the command.
"""

from __future__ import annotations

import concurrent.futures as cf

import torch

import ckpt
from ckpt.format import Chunk, Manifest
from ckpt.integrity import chunk_path
from ckpt.reader import read_chunk
from storage_backends import Storage


def read_checked(storage: Storage, location: str, key: str, chunk: Chunk,
                 out: torch.Tensor) -> None:
    """Fill ``out`` with the chunk's data and check its digest.

    Raises:
        CorruptCheckpointError: the chunk cannot be read, decoded, or fails its digest.
        PermissionError: the file cannot be opened (not the checkpoint's fault).
    """
    try:
        read_chunk(storage, location, key, chunk, out, verify=True)
    except (ckpt.CheckpointError, PermissionError):
        raise
    except Exception as e:
        if chunk.codec == "raw" and not isinstance(e, OSError):
            raise  # not a decoding failure: a bug, show it
        url = f"{storage.url}/{chunk_path(location, chunk)}"
        raise ckpt.CorruptCheckpointError(
            f"{url}: cannot read {key} at offsets {list(chunk.offsets)} (bytes {chunk.start}.."
            f"{chunk.start + chunk.length}, {chunk.codec}): {type(e).__name__}: {e}",
            path=url) from e


def read_tensor(storage: Storage, location: str, manifest: Manifest, key: str,
                pool: cf.ThreadPoolExecutor | None = None) -> torch.Tensor:
    """The whole tensor ``key``, gathered from every chunk (any world size saved it)."""
    entry = manifest.tensors[key]
    out = torch.empty(entry.shape, dtype=entry.torch_dtype)

    def one(chunk: Chunk) -> None:
        if chunk.numel == 0:
            return
        if not entry.shape or all(o == 0 and s == full for o, s, full in
                                  zip(chunk.offsets[1:], chunk.shape[1:], entry.shape[1:])):
            row = chunk.numel // chunk.shape[0] if entry.shape else 0
            start = chunk.offsets[0] * row if entry.shape else 0
            read_checked(storage, location, key, chunk,
                         out.view(-1)[start:start + chunk.numel].view(chunk.shape))
            return
        tmp = torch.empty(chunk.shape, dtype=out.dtype)
        read_checked(storage, location, key, chunk, tmp)
        out[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.shape))] = tmp

    if pool is None:
        for chunk in entry.chunks:
            one(chunk)
    else:
        for future in [pool.submit(one, c) for c in entry.chunks]:
            future.result()
    return out
