"""Slabs: a save staged straight into the segment's shared memory, so that publishing it is
the copy itself.

A slab is one data file of a step in the memory tier (``ckpt/_memory/tier.py``), in the
safetensors layout the loader reads (``ckpt/_format/datafile.py``), kept mapped in this
process (``MAP_SHARED``) from its creation on. A save's blocking copy writes every CPU tensor
of the state straight into the mapped pages (``Stager.stage(into=...)``, :meth:`Slab.fill`),
where the root's writer reads them too. Each chunk is digested as it is copied: a block of
:data:`BLOCK` bytes of the tensor is digested (which brings it into the core's cache), then
copied from the cache into the shared pages with non-temporal stores
(``ckpt/_shared/streaming_copy.py``), which write the destination's lines without reading
them first: the save moves the state's bytes over the memory bus twice (read, write), where a
plain copy then a digest would move them three or four times. The copy is exact, so the
digest is that of the bytes written (a tensor changed by another thread during the copy,
which a save forbids, gives a step that fails its digests at restore, never one restored
wrong). The chunks of a few hundred KiB or more are shared by as many threads as torch
computes with, as torch's own copy does (each block is one digest call and one copy, both
outside the GIL); smaller chunks, whose cost is mostly Python, are the calling thread's
alone.
The memory publish that follows writes the step's small documents and commits (a rename);
the root's writer takes the same digests (``StepPayload.digests``) instead of computing
them again. A slab is created in this user's private segment (0600,
``O_CREAT|O_EXCL|O_NOFOLLOW``), its pages reserved with ``fallocate`` (a full ``/dev/shm``
is an error then, never a ``SIGBUS`` in the middle of a copy) and mapped with
``MAP_POPULATE``: the first saves pay for the pages; later ones reuse the spare's mapping,
pages and layout as they are (the layout is planned again only when the state's tensors
change).

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
import errno
import math
import mmap
import os
import secrets
import shutil
import stat
import time
import weakref
from typing import Any, Callable, Mapping

import numpy as np
import torch

from ckpt._format.datafile import ALIGN, Piece, encode_header
from ckpt._format.digest import Digest, digest
from ckpt._format.entries import Chunk
from ckpt._memory.private import STAGING
from ckpt._save.chunking import ChunkPlan, chunk_tensor
from ckpt._save.payload import RankTable
from ckpt._shared.buffers import plain_address, read_view
from ckpt._shared.copy_threads import HelperThreads, Workers, run_jobs
from ckpt._shared.streaming_copy import SMALL, copy
from ckpt.errors import CheckpointError

SPARE = f"{STAGING}slab-"  # a spare slab's name in the segment: removed after a crash
ASIDE = f"{STAGING}retired-"  # a retired step's directory while its slab is taken back
# Bytes copied, then digested, at a time. The copy's loads bring the block into the core's
# caches while its non-temporal stores write the slab, so the memory bus carries the reads
# and the writes at once; the digest then reads the block from the caches (digesting first,
# then copying, reads memory and writes it one after the other: 256 MiB in blocks of 1 MiB
# on two threads took 16.4 ms that way round against 19.9 ms, torch's copy_ 20.1 ms). Each
# block costs two calls that take the GIL again (the threads hand it to each other; on a VM
# whose cores idled, each handoff may wait for a core to wake). Measured on this machine
# (256 MiB, two threads, 11 interleaved repetitions, wall time against torch's copy_ into
# warm buffers), right after computing / after 0.3 s idle: 256 tensors of 1 MiB (one block
# each, whatever the block size) 0.89x / 1.21x; 4 tensors in chunks of 8 MiB: blocks of
# 512 KiB 0.96x / 1.22x, 1 MiB 0.96x / 1.12x, 2 MiB 0.97x / 0.98x.
BLOCK = 1 << 20
# Chunks of at least this many bytes are shared by the threads; smaller ones cost mostly
# Python, which holds the GIL, and are the calling thread's alone.
PARALLEL = 256 << 10
# A chunk's size class in a slab's fill plan (Slab.fill_plan).
LARGE, TINY, MEDIUM = "large", "tiny", "medium"


def _size_class(nbytes: int) -> str:
    return LARGE if nbytes >= PARALLEL else TINY if nbytes < SMALL else MEDIUM

# Slab mappings are not inherited by a forked child (MADV_DONTFORK: a DataLoader worker would
# keep a deleted slab's pages allocated in /dev/shm while it lives; its inherited descriptors
# are let go of too, ckpt/_memory/private.py). The child's copies of the mmap objects are kept
# alive there for good: freeing one would unmap an address range the child may use by then.
_MAPPINGS: weakref.WeakSet = weakref.WeakSet()
_INHERITED: list = []
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _INHERITED.extend(_MAPPINGS))


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
    """One mapped data file of the segment and the views of the boxes staged in it.

    ``digests``: (key, chunk index) -> the digest of that chunk's bytes in the shared pages,
    taken when :meth:`fill` wrote them during the current save (reset by
    :meth:`SlabPool.acquire`); :meth:`table` digests any other chunk from the pages."""

    def __init__(self, path: str, header: bytes, placements: dict[str, Placement],
                 size: int, mapping: mmap.mmap, inode: tuple[int, int]) -> None:
        self.path, self.header, self.placements = path, header, placements
        self.size, self.mapping, self.inode = size, mapping, inode
        self.signature: tuple = ()  # the boxes its layout was planned for (SlabPool.acquire)
        self.views = {key: _view(mapping, p) for key, p in placements.items()}
        self.pages = np.frombuffer(mapping, dtype=np.uint8)  # the whole file, no copy
        self.bytes = memoryview(mapping)  # the same, sliced for the digests
        self.address = self.pages.ctypes.data
        self.digests: dict[tuple[str, int], str] = {}
        self._chunk_index: dict[str, dict[tuple[int, int], int]] | None = None
        self._chunk_places: list | None = None
        self._fill_plan: dict | None = None
        self.workers: Workers = lambda n: None
        # The memory tier's template of a step's tensors member for this layout, with what
        # it was made for (ckpt/_memory/tier.py).
        self.manifest_template: Any = None

    def fill(self, tensors: Mapping[str, torch.Tensor], threads: int = 1) -> None:
        """Copy each tensor into its view, digesting each chunk as it goes, block by block
        (:data:`BLOCK`: copied, then digested from the tensor while the block is still in
        the caches), the chunks of :data:`PARALLEL` bytes or more on ``threads`` threads
        (this one and the pool's, at training's priority on purpose: this is the blocking
        copy, which training waits for, unlike the writer's niced threads), smaller ones on
        this thread alone. A chunk under ``streaming_copy.SMALL`` bytes is copied through
        the cache and digested from the pages it was copied to, which costs less than a view
        of the tensor; those are copied, then digested, in two plain loops (an optimizer's
        thousands of small tensors: the work per chunk is a call or two). A tensor whose
        bytes cannot be read as they are (not contiguous, a lazy conjugate) is copied by
        torch first, its chunks then digested from the pages."""
        large, small, tiny, from_pages = [], [], [], []
        fill_plan, base = self.fill_plan(), self.address
        for key, t in tensors.items():
            nbytes, chunks = fill_plan[key]
            source = plain_address(t, nbytes)
            if source is None:
                if nbytes:
                    self.views[key].copy_(t)
                from_pages.extend(((key, i), start, length) for i, start, _, length, _ in chunks)
                continue
            for i, start, offset, length, size in chunks:
                if size is TINY:
                    tiny.append((base + start, source + offset, length))
                    from_pages.append(((key, i), start, length))
                else:
                    (large if size is LARGE else small).append(
                        (key, i, start, length, source + offset))
        run_jobs(large, small, self._fill_chunk, threads, self.workers)
        for target, source, length in tiny:
            copy(target, source, length)
        pages = self.bytes
        self.digests.update([(name, digest(pages[start:start + length]))
                             for name, start, length in from_pages])

    def fill_plan(self) -> dict[str, tuple[int, list[tuple[int, int, int, int, str]]]]:
        """key -> (its box's bytes, for each chunk (index, byte start in the file, byte
        start in the box, byte length, its size class: :data:`LARGE`, :data:`TINY` or
        neither)) (made once per slab: a layout does not change)."""
        if self._fill_plan is None:
            self._fill_plan = {
                key: (p.nbytes, [(i, p.start + c.byte_start, c.byte_start, c.byte_length,
                                  _size_class(c.byte_length)) for i, c in enumerate(p.chunks)])
                for key, p in self.placements.items()}
        return self._fill_plan

    def _fill_chunk(self, job: tuple) -> None:
        key, index, start, length, source = job
        if length <= BLOCK:  # one block: no running state to keep
            copy(self.address + start, source, length)
            self.digests[(key, index)] = digest(read_view(source, length))
            return
        h, end, read = Digest(), start + length, read_view(source, length)
        for at in range(start, end, BLOCK):
            n = min(BLOCK, end - at)
            copy(self.address + at, source + (at - start), n)
            h.update(read[at - start:at - start + n])
        self.digests[(key, index)] = h.hexdigest()

    def chunk_index(self) -> dict[str, dict[tuple[int, int], int]]:
        """key -> (byte start in the box, byte length) -> chunk index, for every box of the
        layout (made once per slab: a layout does not change)."""
        if self._chunk_index is None:
            self._chunk_index = {
                key: {(c.byte_start, c.byte_length): i for i, c in enumerate(p.chunks)}
                for key, p in self.placements.items()}
        return self._chunk_index

    def chunk_places(self) -> list[tuple[str, int, tuple, tuple, int, int]]:
        """(key, chunk index, offsets, shape, byte start in the file, byte length) of every
        chunk of the layout, in order (made once per slab: a layout does not change)."""
        if self._chunk_places is None:
            self._chunk_places = [
                (key, i, c.offsets, c.shape, p.start + c.byte_start, c.byte_length)
                for key, p in self.placements.items() for i, c in enumerate(p.chunks)]
        return self._chunk_places

    def known_digests(self) -> "ChunkDigests":
        """The digests :meth:`fill` took, by byte range of each box (what the root's writer
        looks chunks up by): a live view, so chunks filled later (a CUDA tensor's, on the
        writer thread before the root's write) are found too."""
        return ChunkDigests(self)

    def table(self, file: str) -> RankTable:
        """The chunk records of this slab as the data file ``file`` of a step, every chunk's
        digest that of the shared pages (what a restore will check them against): taken as
        :meth:`fill` wrote them, else read from the pages now."""
        table = RankTable()
        append = table.chunks.append
        for (key, i, offsets, shape, begin, length), d in zip(self.chunk_places(),
                                                              self.chunk_digests()):
            append((key, Chunk(offsets, shape, file, begin, length, d, "raw")))
        table.files[file] = self.size
        table.bytes_written = self.size
        return table

    def chunk_digests(self) -> list[str]:
        """The digest of every chunk, in :meth:`chunk_places` order: taken as :meth:`fill`
        wrote it, else read from the pages now."""
        digests, out = self.digests, []
        for key, i, _, _, begin, length in self.chunk_places():
            d = digests.get((key, i))
            out.append(digest(self.pages[begin:begin + length]) if d is None else d)
        return out


class ChunkDigests:
    """A slab's known digests by (key, byte start in the box, byte length) (see
    ``StepPayload.digests``)."""

    def __init__(self, slab: Slab) -> None:
        self.digests = slab.digests  # this save's (the next save of the slab gets a new one)
        self.index = slab.chunk_index()

    def get(self, chunk: tuple[str, int, int]) -> str | None:
        key, start, length = chunk
        i = self.index.get(key, {}).get((start, length))
        return None if i is None else self.digests.get((key, i))


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
        self._workers = HelperThreads("ckpt-fill")  # the fill's helper threads

    def acquire(self, boxes: list[tuple[str, tuple[int, ...], torch.Tensor]],
                chunk_bytes: int, check_space: Callable[[int], None]) -> Slab:
        """A slab laid out for ``boxes``: the spare if it has the same layout, else a new one
        (after ``check_space(bytes)`` says it fits). Runs on the caller's thread, before the
        copy. The spare's layout is planned again only when the boxes' keys, offsets, shapes
        or dtypes (or the chunk size) changed since it was planned."""
        signature = (chunk_bytes, tuple([(key, offsets, t.shape, t.dtype)
                                         for key, offsets, t in boxes]))
        slab, self.spare = self.spare, None
        planned = None
        if slab is not None and slab.signature != signature:
            planned = plan(boxes, chunk_bytes)
            if slab.header == planned[0]:  # the same layout, asked for in other words
                slab.signature = signature
        if slab is not None:
            if slab.signature == signature and self._intact(slab):
                slab.digests = {}  # those of this save: fill takes them
                return slab
            _unlink(slab.path)  # another layout (or damaged): its pages go
        header, placements = planned or plan(boxes, chunk_bytes)
        size = len(header) + sum(p.nbytes for p in placements.values())
        check_space(size)
        slab = self._create(header, placements, size)
        slab.signature = signature
        return slab

    def _create(self, header: bytes, placements: dict[str, Placement], size: int) -> Slab:
        path = self._spare_path()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            # Pages reserved now: a full /dev/shm fails here, never as a SIGBUS on a write
            # through the mapping. (A slab holds its header at least: size > 0.)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    raise
                raise CheckpointError(
                    f"{self.segment}: no room for the {size} bytes of this step in the memory "
                    f"tier ({e.strerror}; /dev/shm is shared with every process of the node); "
                    "enlarge /dev/shm (docker: --shm-size), lower MemoryTierOptions(keep=) or "
                    "pass memory_tier=False", path=self.segment) from e
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            if hasattr(mmap, "MADV_DONTFORK"):
                mapping.madvise(mmap.MADV_DONTFORK)
            _MAPPINGS.add(mapping)
            mapping[:len(header)] = header
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        slab = Slab(path, header, placements, size, mapping, (st.st_dev, st.st_ino))
        slab.workers = self._workers
        return slab

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
        self._workers.close()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        pass


def staged_elsewhere(slab: Slab, pieces: dict[str, tuple[Any, torch.Tensor]]
                     ) -> dict[str, torch.Tensor]:
    """The boxes whose bytes were staged outside the slab (a CUDA tensor's pinned buffer),
    by key: the writer copies them in (:meth:`Slab.fill`) once they have landed."""
    return {key: t for key, (_, t) in pieces.items()
            if key in slab.views and t is not slab.views[key]}
