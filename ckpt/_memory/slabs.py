"""Slabs: a save staged straight into the segment's shared memory, so that publishing it is
the copy itself.

A slab is one data file of a step in the memory tier (``ckpt/_memory/tier.py``), in the
safetensors layout the loader reads (``ckpt/_format/datafile.py``), kept mapped in this
process (``MAP_SHARED``) from its creation on. A save's blocking copy writes every CPU tensor
of the state straight into the mapped pages (``Stager.stage(into=...)``), where the root's
writer reads them too; the memory publish that follows only digests the pages, writes the
step's small documents and commits (a rename). A slab is created in this user's private
segment (0600, ``O_CREAT|O_EXCL|O_NOFOLLOW``), its pages reserved with ``fallocate`` (a full
``/dev/shm`` is an error then, never a ``SIGBUS`` in the middle of a copy) and mapped with
``MAP_POPULATE``: the first saves pay for the pages, later ones reuse them.

The resident copies: ``keep`` committed steps, each in its own slab, and one spare slab that
the next save is staged into (it is the host staging buffer: no other copy of the CPU state
is kept). A step's slab becomes the spare again only once the step has been retired: the
directory is first renamed aside (the step stops existing in one rename), then its slab
moved out of it. So the ``keep`` newest committed steps are never written to, whatever
happens to a save in flight; a crash leaves the spare and a half-published step under
staging names (``.tmp-``), which the next owner of the segment removes.

A slab is recycled only when it is still the file this process made (same inode, same size:
only this user, or root, can touch the segment) and no replication is reading the retired
step; anything else is deleted, and a new slab made when the next save needs one.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import mmap
import os
import secrets
import shutil
import stat
import time
from typing import Any, Callable

import torch

from ckpt._format.datafile import ALIGN, Piece, encode_header
from ckpt._format.digest import digest
from ckpt._format.entries import Chunk
from ckpt._memory.private import STAGING
from ckpt._save.chunking import ChunkPlan, chunk_tensor
from ckpt._save.payload import RankTable

SPARE = f"{STAGING}slab-"  # a spare slab's name in the segment: removed after a crash
ASIDE = f"{STAGING}retired-"  # a retired step's directory while its slab is taken back


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one staged box lies in a slab: its bytes from ``start``, cut into ``chunks``
    (each with its box in the global tensor and its byte range in the box)."""

    offsets: tuple[int, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    chunks: tuple[ChunkPlan, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan(boxes: list[tuple[str, tuple[int, ...], torch.Tensor]],
         chunk_bytes: int) -> tuple[bytes, dict[str, Placement]]:
    """The header and the placement of each box (key, global offsets, local tensor) in a
    slab. Each box is contiguous in the file (so it is one tensor view of the mapping) and
    cut into the writer's chunks; boxes whose size is a whole number of cache lines come
    first, so that each of them starts 64-byte aligned (``ckpt/_format/datafile.py``)."""
    order = sorted(boxes, key=lambda b: b[2].numel() * b[2].element_size() % ALIGN != 0)
    pieces, cuts = [], []
    for key, offsets, t in order:
        shape = tuple(t.shape)
        chunks = []
        for c in chunk_tensor(key, shape, t.element_size(), chunk_bytes):
            box = tuple(o + b for o, b in zip(offsets, c.offsets))
            chunks.append(dataclasses.replace(c, offsets=box))
            # the header needs each piece's length, not its bytes
            pieces.append(Piece(f"{key}#{list(box)}", _Length(c.byte_length),  # type: ignore
                                t.dtype, c.shape))
        cuts.append((key, offsets, t.dtype, shape, chunks))
    header = encode_header(pieces)
    placements, at = {}, len(header)
    for key, offsets, dtype, shape, chunks in cuts:
        placements[key] = Placement(offsets, dtype, shape, at, tuple(chunks))
        at += math.prod(shape) * dtype.itemsize
    return header, placements


class _Length:
    """Stands for a piece's bytes in :func:`encode_header`, which needs only their length."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class Slab:
    """One mapped data file of the segment and the views of the boxes staged in it."""

    def __init__(self, path: str, header: bytes, placements: dict[str, Placement],
                 size: int, mapping: mmap.mmap, inode: tuple[int, int]) -> None:
        self.path, self.header, self.placements = path, header, placements
        self.size, self.mapping, self.inode = size, mapping, inode
        self.views = {key: _view(mapping, p) for key, p in placements.items()}

    def table(self, file: str) -> RankTable:
        """The chunk records of this slab as the data file ``file`` of a step, every chunk's
        digest read from the shared pages (what a restore will check them against)."""
        table = RankTable()
        data = memoryview(self.mapping)
        try:
            for key, p in self.placements.items():
                for c in p.chunks:
                    begin = p.start + c.byte_start
                    d = digest(data[begin:begin + c.byte_length])
                    table.chunks.append((key, Chunk(c.offsets, c.shape, file, begin,
                                                    c.byte_length, d, "raw")))
        finally:
            data.release()
        table.files[file] = self.size
        table.bytes_written = self.size
        return table


def _view(mapping: mmap.mmap, p: Placement) -> torch.Tensor:
    """The box ``p`` as a tensor over the shared pages (no copy)."""
    if p.nbytes == 0:
        return torch.empty(p.shape, dtype=p.dtype)
    raw = torch.frombuffer(mapping, dtype=torch.uint8, count=p.nbytes, offset=p.start)
    return raw.view(p.dtype).view(p.shape)


class SlabPool:
    """The slabs of one segment: those inside its newest steps (found again by inode when a
    step is retired) and at most one spare, waiting under a :data:`SPARE` name.

    Args:
        segment: the segment directory (this user's, checked by its owner).
        slabs: how many placed slabs are remembered (the tier's ``keep`` plus the one being
            published); an older one is no longer recycled, only deleted with its step.
        reading: ``reading(step_path)``: whether something (replication) may still read a
            committed step's files; such a step's slab is never recycled.
    """

    def __init__(self, segment: str, slabs: int,
                 reading: Callable[[str], bool] = lambda path: False) -> None:
        self.segment, self.slabs, self.reading = segment, slabs, reading
        self.spare: Slab | None = None
        self.placed: collections.OrderedDict[tuple[int, int], Slab] = collections.OrderedDict()

    def acquire(self, boxes: list[tuple[str, tuple[int, ...], torch.Tensor]],
                chunk_bytes: int, check_space: Callable[[int], None]) -> Slab:
        """A slab laid out for ``boxes``: the spare if it has the same layout, else a new one
        (after ``check_space(bytes)`` says it fits). Runs on the caller's thread, before the
        copy."""
        header, placements = plan(boxes, chunk_bytes)
        size = len(header) + sum(p.nbytes for p in placements.values())
        slab, self.spare = self.spare, None
        if slab is not None:
            if slab.header == header and self._intact(slab):
                return slab
            _unlink(slab.path)  # another layout (or damaged): its pages go
        check_space(size)
        return self._create(header, placements, size)

    def _create(self, header: bytes, placements: dict[str, Placement], size: int) -> Slab:
        path = self._spare_path()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            if size:
                # Pages reserved now: a full /dev/shm fails here (ENOSPC), never as a SIGBUS
                # on a write through the mapping.
                os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            mapping[:len(header)] = header
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        return Slab(path, header, placements, size, mapping, (st.st_dev, st.st_ino))

    def _spare_path(self) -> str:
        return os.path.join(self.segment, f"{SPARE}{secrets.token_hex(8)}")

    def _intact(self, slab: Slab) -> bool:
        """Whether the file at ``slab.path`` is still the one mapped, whole: writing through
        a mapping past a truncated file's end would end the process (SIGBUS)."""
        try:
            st = os.lstat(slab.path)
        except OSError:
            return False
        return (stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == slab.inode
                and st.st_size == slab.size and st.st_uid == os.geteuid())

    def place(self, slab: Slab, directory: str, name: str) -> None:
        """Move a staged slab into a step's staging ``directory`` as its data file ``name``."""
        target = os.path.join(directory, name)
        os.rename(slab.path, target)
        slab.path = target
        self.placed[slab.inode] = slab
        while len(self.placed) > self.slabs:
            self.placed.popitem(last=False)

    def release(self, slab: Slab) -> None:
        """A slab staged for a save that will not be published (a prepare, a failure): the
        spare again if it is still whole, else its file goes."""
        self.placed.pop(slab.inode, None)
        try:
            if self._intact(slab):
                self._keep(slab)
                return
        except OSError:
            pass
        _unlink(slab.path)

    def reclaim(self, step_path: str, readers_path: str | None = None) -> None:
        """Retire the committed step at ``step_path``: rename it aside (it stops existing),
        take its slab back as the spare when it may be reused, delete the rest.
        ``readers_path``: the path replication knows the step by (default ``step_path``)."""
        aside = os.path.join(os.path.dirname(step_path),
                             f"{ASIDE}{os.path.basename(step_path)}-{time.time_ns()}")
        try:
            os.rename(step_path, aside)
        except FileNotFoundError:
            return
        try:
            reusable = not self.reading(readers_path or step_path)
            for name in os.listdir(aside):
                path = os.path.join(aside, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                slab = self.placed.pop((st.st_dev, st.st_ino), None)
                if slab is not None and reusable:
                    slab.path = path
                    if self._intact(slab):
                        self._keep(slab)
        finally:
            shutil.rmtree(aside, ignore_errors=True)

    def _keep(self, slab: Slab) -> None:
        """Make ``slab`` the spare (one is enough: one save is staged at a time)."""
        if self.spare is not None and self.spare is not slab:
            _unlink(self.spare.path)
        path = self._spare_path()
        os.rename(slab.path, path)
        slab.path = path
        self.spare = slab

    def close(self) -> None:
        """Forget every slab (a mapping goes with the last view of it)."""
        if self.spare is not None:
            _unlink(self.spare.path)
        self.spare = None
        self.placed.clear()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        pass


def staged_elsewhere(slab: Slab, pieces: dict[str, tuple[Any, torch.Tensor]]) -> list:
    """The boxes whose bytes were staged outside the slab (a CUDA tensor's pinned buffer),
    as (slab view, staged tensor): the writer copies them in before digesting."""
    return [(slab.views[key], t) for key, (_, t) in pieces.items()
            if key in slab.views and t is not slab.views[key]]
