"""Data files in the safetensors layout: 8-byte little-endian header length, a JSON header
(padded with spaces so the data starts 64-byte aligned), then the pieces back to back.
Uncompressed pieces carry their real dtype and shape, so the safetensors library can open
the file; compressed pieces are stored as ``U8`` byte strings.
The manifest, not this header, says where to read; a restore and ``ckpt verify`` check that
the header agrees with it (ckpt/_step/headers.py).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                     ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        SAFETENSORS_DTYPES[getattr(torch, _name)] = _code


@dataclass
class Piece:
    """One named byte string of a data file, with the dtype/shape safetensors should show."""

    name: str
    data: memoryview
    dtype: torch.dtype
    shape: tuple[int, ...]
    stored_raw: bool = True

    def header_entry(self, start: int) -> dict:
        code = SAFETENSORS_DTYPES.get(self.dtype) if self.stored_raw else None
        shape = list(self.shape) if code else [len(self.data)]
        return {"dtype": code or "U8", "shape": shape,
                "data_offsets": [start, start + len(self.data)]}


ALIGN = 64  # where the data (and each piece whose predecessors are whole cache lines) starts


def encode_header(pieces: list[Piece]) -> bytes:
    """The header bytes (length prefix included), padded with spaces so the data starts
    64-byte aligned: a chunk whose bytes lie at another offset modulo 64 than its destination
    in memory is copied by the kernel at ~20% more CPU per byte (benchmarks/
    bench_memory_tier.py; docs/design.md, "Memory tier across nodes")."""
    entries, offset = {}, 0
    for p in pieces:
        entries[p.name] = p.header_entry(offset)
        offset += len(p.data)
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-(len(body) + 8) % ALIGN)
    return struct.pack("<Q", len(body)) + body
