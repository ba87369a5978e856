"""What a save hands the background writer, and what one rank wrote (its :class:`RankTable`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt._format.entries import Chunk
from ckpt._format.manifest import Manifest, chunk_doc


@dataclass
class StepPayload:
    """Everything the background writer needs, decoupled from the live training state.

    ``pieces`` maps each key this rank writes to (global offsets, staged local box).
    ``tensors`` (global dtype and shape of every tensor), ``items`` and ``aliases`` matter
    on the coordinator only. ``previous``: the base manifest of an incremental save.
    """

    step: int
    name: str
    pieces: dict[str, tuple[tuple[int, ...], torch.Tensor]]
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    items: dict[str, dict]
    aliases: dict[str, str]
    ready: object = None
    metadata: dict | None = None
    previous: Manifest | None = None
    rank: int = 0
    world_size: int = 1
    # Unique to this save attempt (shared by its ranks): names its staging location and files,
    # so a retried or concurrent attempt never overwrites another's objects.
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # Boxes this rank holds but another rank writes (a replicated tensor's copy): staged only
    # for the memory tier, which keeps everything a rank holds so that it restores alone.
    held: dict[str, tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=dict)
    # Format 2 (rank tables): each tensor's layout (ckpt._format.layout); None writes format 1.
    layouts: dict | None = None
    # Chunk digests already taken of the staged bytes (the memory tier's, as it copied them):
    # .get((key, byte start in the box, byte length)) -> digest or None. The writer takes
    # these instead of digesting the same bytes again.
    digests: Any = field(default_factory=dict)


@dataclass
class RankTable:
    """What one rank wrote: its files and the chunk records of its boxes (JSON-able)."""

    files: dict[str, int] = field(default_factory=dict)
    chunks: list[tuple[str, Chunk]] = field(default_factory=list)
    bytes_written: int = 0
    bytes_reused: int = 0

    def to_json(self) -> dict:
        return {"files": self.files, "written": self.bytes_written, "reused": self.bytes_reused,
                "chunks": [[k, chunk_doc(c)] for k, c in self.chunks]}

    @classmethod
    def from_json(cls, doc: dict) -> RankTable:
        chunks = [(k, Chunk(**{**c, "offsets": tuple(c["offsets"]), "shape": tuple(c["shape"])}))
                  for k, c in doc["chunks"]]
        return cls(doc["files"], chunks, doc["written"], doc["reused"])
