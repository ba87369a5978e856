"""Loading a committed step into live state, in place, on any world size, in bounded memory.

Order matters for "a failed load changes nothing":

1. The manifest is validated and compared with the live state (keys, shapes, dtypes,
   optimizer parameter groups, pickle) and every value is decoded before any byte is read.
2. Verify pass: every chunk this rank needs is read and checked against its digest. Nothing
   live changes. Each file's run of adjacent chunks is streamed through one small block
   buffer per reading thread (``Storage.stream_block``, 512 KiB on a file system: the block
   is still in the CPU cache when it is digested, so checking costs no copy through memory);
   where every read is a request (object stores), whole chunks go through two reused
   chunk buffers instead. Compressed chunks are decoded into a chunk buffer to be digested.
3. Apply pass: the same chunks are read again straight into the live tensors (CPU, contiguous,
   whole rows), or through a few reused bounce buffers (pinned, copied on a side stream, for
   CUDA tensors; also for non-contiguous tensors and chunks that only partly overlap a box).
   The verify pass has just brought the files into the page cache, so this second read is a
   memory copy while the step fits in free memory. Each reading thread opens each file once
   for the pass (``Storage.open_reader``), not once per chunk.
4. Objects get ``load_state_dict`` last.

The extra memory is a block and a few chunk-sized buffers per reading thread, whatever the
state's size (docs/design.md, "Loading", has the measurements behind this choice). Should the
apply pass fail all the same (a file removed or a read error between the passes), the error
names the tensors that hold the new values, those partly written and those untouched.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, MutableMapping

import torch

from storage_backends import Storage
from storage_backends.base import PathReader, Reader

from ckpt._save.engine import await_device_copies, byte_view
from ckpt.errors import (CorruptCheckpointError, PartialLoadError, StateMismatchError,
                     UnsupportedValueError)
from ckpt._format.manifest import Chunk, Manifest, paused_gc
from ckpt._step.integrity import Digest, check_structure, chunk_path, digest
from ckpt._shared.sharding import (Box, dtensor_type, local_piece, overlapping, prefetch, read_box,
                       source_rank, sub_slices)
from ckpt._shared.state import (FlatState, check_compatible, decode, flatten, holds_pickle, is_stateful,
                    item_tree, load_stateful, tensor_keys)


def _live_state(state: MutableMapping[str, Any], rank: int) -> FlatState:
    """Flatten what the live state holds now, for validation and as read destinations."""
    live = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) or is_stateful(v)}
    flat = flatten(live, allow_pickle=True, rank=rank, keep_vars=True)
    for k in state:
        if k not in live:
            flat.items[k] = {"kind": "value", "tree": None}
    return flat


def read_chunk(storage: Storage, location: str, key: str, chunk: Chunk,
               out: torch.Tensor, verify: bool = True, files: _Files | None = None) -> None:
    """Fill ``out`` (a contiguous CPU tensor of the chunk's shape) with the chunk's data
    (through ``files``' open readers when given)."""
    _read_into(storage, location, key, chunk, byte_view(out), out.dtype, verify, files)


def _read_into(storage: Storage, location: str, key: str, chunk: Chunk, view: memoryview,
               dtype: torch.dtype, verify: bool = True, files: _Files | None = None) -> None:
    """:func:`read_chunk` into ``view``, the bytes of the chunk's destination."""
    path = chunk_path(location, chunk)
    found = None  # the digest of what was read, when taken block by block as it landed
    try:
        if chunk.codec == "raw":
            reader = PathReader(storage, path) if files is None else files.get(path)
            block = getattr(storage, "stream_block", None)
            if verify and block:  # digest each block while it is still in the CPU's cache
                hashing = Digest()
                for at in range(0, len(view), block):
                    part = view[at:at + block]
                    reader.read_into(chunk.start + at, part)
                    hashing.update(part)
                found = hashing.hexdigest()
            else:
                reader.read_into(chunk.start, view)
        else:
            from ckpt._format.codec import decode_into  # compression is optional on the read path

            decode_into(chunk.codec, storage.read(path, chunk.start, chunk.length), view, dtype)
    except (EOFError, FileNotFoundError, ValueError) as e:
        raise _unreadable(storage, path, key, chunk, e) from e
    if verify and (found if found is not None else digest(view)) != chunk.digest:
        raise _mismatch(storage, path, key, chunk)


class _Files:
    """The files one pass reads, each opened once per reading thread (not once per chunk)
    and closed when the pass ends."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: list[Reader] = []

    def get(self, path: str) -> Reader:
        readers = getattr(self._local, "readers", None)
        if readers is None:
            readers = self._local.readers = {}
        reader = readers.get(path)
        if reader is None:
            reader = readers[path] = self.storage.open_reader(path)
            with self._lock:
                self._open.append(reader)
        return reader

    def close(self) -> None:
        with self._lock:
            for reader in self._open:
                reader.close()
            self._open.clear()


def _mismatch(storage: Storage, path: str, key: str, chunk: Chunk) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{storage.url}/{path}: digest mismatch in {key} at offsets {list(chunk.offsets)} "
        f"(bytes {chunk.start}..{chunk.start + chunk.length}): the data is corrupt",
        path=f"{storage.url}/{path}")


def _unreadable(storage: Storage, path: str, key: str, chunk: Chunk,
                error: Exception) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{storage.url}/{path}: cannot read {key} at {list(chunk.offsets)}: {error}",
        path=f"{storage.url}/{path}")


def _rows_of(dest_box: Box, chunk: Chunk) -> bool:
    """Whether the chunk is a run of whole rows of the destination box (one contiguous read)."""
    offsets, shape = dest_box
    if not shape:
        return True
    return (chunk.offsets[1:] == offsets[1:] and chunk.shape[1:] == shape[1:]
            and offsets[0] <= chunk.offsets[0]
            and chunk.offsets[0] + chunk.shape[0] <= offsets[0] + shape[0])


class _Scratch:
    """Host buffers reused by each reading thread (the load's bounded memory): one block
    buffer for streamed reads and chunk-sized ones for whole chunks.

    ``take`` hands out two buffers per thread in turn; a pinned one is reused only once the
    host-to-device copy recorded on it has finished, so one chunk's read overlaps the
    previous chunk's copy.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def take(self, chunk: Chunk, dtype: torch.dtype, pinned: bool = False) -> torch.Tensor:
        slots = getattr(self._local, "slots", None)
        if slots is None:
            slots = self._local.slots = {False: [[None, None], [None, None]],
                                         True: [[None, None], [None, None]]}
            self._local.turn = 0
        self._local.turn ^= 1
        slot = slots[pinned][self._local.turn]
        nbytes = chunk.numel * dtype.itemsize
        if slot[1] is not None:
            slot[1].synchronize()  # the copy out of this buffer must be done before reuse
            slot[1] = None
        if slot[0] is None or slot[0].numel() < nbytes:
            slot[0] = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
        return slot[0][:nbytes].view(dtype).view(chunk.shape)

    def block(self, nbytes: int) -> memoryview:
        """This thread's buffer for streamed reads (the verify pass)."""
        buf = getattr(self._local, "block", None)
        if buf is None or len(buf) != nbytes:
            buf = self._local.block = byte_view(torch.empty(nbytes, dtype=torch.uint8))
        return buf

    def copied(self, pinned: bool, event: Any) -> None:
        """The last buffer taken is being copied out until ``event`` completes."""
        self._local.slots[pinned][self._local.turn][1] = event


@dataclass
class _Read:
    """One chunk to read for one destination box."""

    key: str
    chunk: Chunk
    overlap: Box
    dest: torch.Tensor  # holds dest_box of the tensor: a live tensor, its local shard, or new
    dest_box: Box
    into: memoryview | None  # the bytes of dest the chunk is read straight into, or None


ReadJob = tuple[str, int, Callable[[], None]]  # (file path, start, read that fills dest)


def _reads_for(manifest: Manifest, key: str, dest: torch.Tensor, dest_box: Box) -> list[_Read]:
    whole = _direct_bytes(dest)  # once per tensor: the per-chunk part is a slice of it
    return [_Read(key, chunk, overlap, dest, dest_box, _direct(whole, dest, dest_box, chunk))
            for chunk, overlap in overlapping(manifest.tensors[key], dest_box)]


def _direct_bytes(dest: torch.Tensor) -> memoryview | None:
    """The bytes of ``dest`` when chunks can be read straight into it, or None (bounce)."""
    if (dest.device.type != "cpu" or not dest.is_contiguous() or dest.is_conj()
            or dest.is_neg()):
        return None
    return byte_view(dest)


def _direct(whole: memoryview | None, dest: torch.Tensor, dest_box: Box,
            chunk: Chunk) -> memoryview | None:
    """The part of ``whole`` (the bytes of ``dest``, which holds ``dest_box``) that
    ``chunk`` fills when it is a run of whole rows of it, or None (bounce)."""
    if whole is None or not _rows_of(dest_box, chunk):
        return None
    start = (chunk.offsets[0] - dest_box[0][0]) * math.prod(dest.shape[1:]) if dest.dim() else 0
    size = dest.element_size()
    return whole[start * size:(start + chunk.numel) * size]


class _Applier:
    """The apply pass: fills destinations, keeps count of what changed for error messages."""

    def __init__(self, storage: Storage, location: str, scratch: _Scratch, verify: bool,
                 files: _Files) -> None:
        self.storage, self.location, self.scratch, self.files = storage, location, scratch, files
        self.verify = verify  # one-pass load: check each chunk where it landed
        self._lock = threading.Lock()
        self._streams: dict[torch.device, Any] = {}
        self.started: set[str] = set()
        self.finished: dict[str, int] = {}

    def stream(self, device: torch.device) -> Any:
        with self._lock:
            s = self._streams.get(device)
            if s is None:
                s = self._streams[device] = torch.cuda.Stream(device=device)
                # what training queued on the tensors runs before the copies overwrite them
                s.wait_stream(torch.cuda.current_stream(device))
            return s

    def __call__(self, r: _Read) -> None:
        with self._lock:
            self.started.add(r.key)
        if r.into is not None:
            _read_into(self.storage, self.location, r.key, r.chunk, r.into, r.dest.dtype,
                       self.verify, self.files)
        else:
            cuda = r.dest.device.type == "cuda"
            tmp = self.scratch.take(r.chunk, r.dest.dtype, pinned=cuda)
            read_chunk(self.storage, self.location, r.key, r.chunk, tmp, self.verify, self.files)
            src = tmp[sub_slices((r.chunk.offsets, r.chunk.shape), r.overlap)]
            dst = r.dest[sub_slices(r.dest_box, r.overlap)]
            if cuda:
                stream = self.stream(r.dest.device)
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                self.scratch.copied(True, event)
            else:
                dst.copy_(src)
        with self._lock:
            self.finished[r.key] = self.finished.get(r.key, 0) + 1

    def wait(self) -> None:
        """Every host-to-device copy issued has completed."""
        for s in self._streams.values():
            s.synchronize()


def _verify_jobs(storage: Storage, location: str, reads: list[_Read],
                 scratch: _Scratch) -> list[ReadJob]:
    """The verify pass's reads: one per run of adjacent stored-raw chunks of a file where the
    storage streams (see the module docstring), one per chunk otherwise."""
    jobs: list[ReadJob] = []
    runs: dict[str, list[list[_Read]]] = {}
    block = getattr(storage, "stream_block", None)  # duck-typed sources may lack it
    for r in sorted(reads, key=lambda r: (chunk_path(location, r.chunk), r.chunk.start)):
        path = chunk_path(location, r.chunk)
        if block is None or r.chunk.codec != "raw":
            jobs.append((path, r.chunk.start, lambda r=r: read_chunk(
                storage, location, r.key, r.chunk, scratch.take(r.chunk, r.dest.dtype))))
            continue
        file_runs = runs.setdefault(path, [])
        last = file_runs[-1][-1].chunk if file_runs else None
        if last is not None and last.start + last.length == r.chunk.start:
            file_runs[-1].append(r)
        else:
            file_runs.append([r])
    for path, file_runs in runs.items():
        jobs += [(path, run[0].chunk.start,
                  lambda path=path, run=run: _verify_run(storage, path, run, scratch.block(block)))
                 for run in file_runs]
    return jobs


def _verify_run(storage: Storage, path: str, run: list[_Read], buffer: memoryview) -> None:
    """Digest a run of adjacent raw chunks of one file, streamed through ``buffer`` (a block
    may end one chunk and begin the next)."""
    pos = run[0].chunk.start
    end = run[-1].chunk.start + run[-1].chunk.length
    i, hashing = 0, Digest()

    def check_complete() -> None:  # every chunk that ends at `pos` is whole: check it
        nonlocal i, hashing
        while i < len(run) and run[i].chunk.start + run[i].chunk.length == pos:
            if hashing.hexdigest() != run[i].chunk.digest:
                raise _mismatch(storage, path, run[i].key, run[i].chunk)
            i, hashing = i + 1, Digest()

    blocks = storage.read_blocks(path, pos, end - pos, buffer)
    try:
        check_complete()
        for part in blocks:
            while part:
                chunk = run[i].chunk
                n = min(len(part), chunk.start + chunk.length - pos)
                hashing.update(part[:n])
                part, pos = part[n:], pos + n
                check_complete()
    except CorruptCheckpointError:
        raise
    except (EOFError, FileNotFoundError, ValueError) as e:
        at = run[min(i, len(run) - 1)]
        raise _unreadable(storage, path, at.key, at.chunk, e) from e
    finally:
        blocks.close()


def box_reads(storage: Storage, location: str, manifest: Manifest, key: str,
              dest: torch.Tensor, dest_box: Box, verify: bool = True) -> list[ReadJob]:
    """The reads that fill CPU ``dest``, which holds ``dest_box`` of ``key``: one per
    overlapping chunk, tagged with its file and offset so a caller can order them."""
    def one(r: _Read) -> None:
        if r.into is not None:
            _read_into(storage, location, key, r.chunk, r.into, dest.dtype, verify)
            return
        tmp = torch.empty(r.chunk.shape, dtype=dest.dtype)
        read_chunk(storage, location, key, r.chunk, tmp, verify)
        dest[sub_slices(dest_box, r.overlap)].copy_(
            tmp[sub_slices((r.chunk.offsets, r.chunk.shape), r.overlap)])

    return [(chunk_path(location, r.chunk), r.chunk.start, lambda r=r: one(r))
            for r in _reads_for(manifest, key, dest, dest_box)]


def run_reads(jobs: list[ReadJob], pool: cf.ThreadPoolExecutor | None) -> None:
    """Run reads file by file, each file's in offset order (sequential reads, which the
    kernel's readahead serves best), files in parallel on ``pool``.

    After a failure no further read starts, and the error is raised only once every read
    already running has returned, so nothing changes behind the caller's back.
    """
    by_file: dict[str, list[ReadJob]] = {}
    for job in jobs:
        by_file.setdefault(job[0], []).append(job)
    stop = threading.Event()

    def read_file(file_jobs: list[ReadJob]) -> None:
        for _, _, read in sorted(file_jobs, key=lambda j: j[1]):
            if stop.is_set():
                return
            try:
                read()
            except BaseException:
                stop.set()
                raise

    if pool is None or len(by_file) < 2:
        for file_jobs in by_file.values():
            read_file(file_jobs)
        return
    futures = [pool.submit(read_file, f) for f in by_file.values()]
    cf.wait(futures)
    for future in futures:
        future.result()


def needed_tensors(storage: Storage, location: str, manifest: Manifest,
                   trees: dict[str, Any], allow_pickle: bool) -> set[str]:
    """The stored tensors that the item ``trees`` to be loaded refer to (aliases resolved);
    refuses pickled values unless ``allow_pickle``, before any tensor is read."""
    if not allow_pickle and any(holds_pickle(tree) for tree in trees.values()):
        raise UnsupportedValueError(
            f"{storage.url}/{location} holds pickled values; load it with allow_pickle=True "
            "only if you trust where it came from (nothing was loaded)", path=location)
    return {manifest.resolve(k) for tree in trees.values() for k in tensor_keys(tree)}


def load_step(storage: Storage, location: str, manifest: Manifest,
              state: MutableMapping[str, Any], *, rank: int = 0, allow_pickle: bool = False,
              verify: bool = True, pool: cf.ThreadPoolExecutor | None = None,
              in_place: bool = False) -> frozenset[str]:
    """Load ``manifest``'s step into this rank's ``state`` (see the module docstring);
    returns the keys of the live tensors it wrote.

    By default (and always with ``verify``) a chunk that fails its digest changes nothing:
    every chunk is verified before the first live byte is written. ``in_place`` skips the
    verify pass (one read instead of two; each block is digested where it lands): a digest
    mismatch then leaves tensors partly overwritten, and the :class:`PartialLoadError` says
    which. Without ``verify`` nothing is checked against digests. Everything that can be
    checked without the data (manifest, files, keys, shapes, dtypes, parameter groups,
    pickle, value tags) is checked before the first byte is read.

    Every live tensor is written by a load that succeeds (a step that lacks one does not
    fit the state: StateMismatchError before the first read), so loading a good step
    repairs whatever a failed one-pass load of another step left partly overwritten.

    Raises:
        CorruptCheckpointError: a chunk is unreadable or fails its digest (nothing changed,
            unless the message says which tensors were written).
        StateMismatchError: the checkpoint does not fit ``state`` (nothing changed, unless
            the message says otherwise).
    """
    # A load builds many small objects and no cycles: without the pause, a full collection
    # (scanning every object of the process) often runs inside it, typically in the first
    # restore of a freshly started worker (~80 ms here for a state of 256 tensors).
    with paused_gc():
        return _load_step(storage, location, manifest, state, rank, allow_pickle, verify, pool,
                          in_place)


def _load_step(storage: Storage, location: str, manifest: Manifest,
               state: MutableMapping[str, Any], rank: int, allow_pickle: bool, verify: bool,
               pool: cf.ThreadPoolExecutor | None, in_place: bool) -> frozenset[str]:
    src = source_rank(rank, manifest.world_size)
    live = _live_state(state, src)
    spec = {k: (e.shape, e.torch_dtype) for k, e in manifest.tensors.items()}
    check_compatible(live, manifest.items, spec, manifest.aliases, src)
    # Items saved but absent from `state` are left alone: a caller may restore a subset.
    wanted = {name: item_tree(manifest.items[name], src) for name in state
              if name in manifest.items}
    _check_optimizers(state, wanted)
    needed = needed_tensors(storage, location, manifest, wanted, allow_pickle)
    loaded: dict[str, torch.Tensor] = {}
    pending: list[tuple[str, torch.Tensor, Box]] = []  # (key, destination, its box)
    written: list[str] = []  # live tensors the apply pass writes into
    for key in sorted(needed):
        entry = manifest.tensors[key]
        target = live.tensors.get(key)
        if (target is not None and tuple(target.shape) == entry.shape
                and target.dtype == entry.torch_dtype):
            _, offsets, local = local_piece(target)
            pending.append((key, local, (offsets, tuple(local.shape))))
            loaded[key] = live.originals[key]  # load_state_dict's copy_ onto itself skips
            written.append(key)
        else:
            box = read_box(entry, target)
            buf = torch.empty(box[1], dtype=entry.torch_dtype)
            pending.append((key, buf, box))
            loaded[key] = buf if target is None else _like(target, buf)
    prefetch(manifest, [(key, box) for key, _, box in pending])  # format 2: tables at once
    reads = [r for key, dest, box in pending for r in _reads_for(manifest, key, dest, box)]
    check_structure(storage, location, manifest, [r.chunk for r in reads])  # only these files
    for alias, target in manifest.aliases.items():
        if target in loaded:
            loaded[alias] = loaded[target]
    try:
        values = {name: decode(tree, loaded, allow_pickle=allow_pickle)
                  for name, tree in wanted.items()}
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{storage.url}/{location}: a saved value cannot be "
                                     f"decoded ({e!r}); nothing was loaded", path=location) from e
    scratch = _Scratch()
    if _tiny(storage, reads):
        pool = None
    if verify and not in_place:
        run_reads(_verify_jobs(storage, location, reads, scratch), pool)
    # A save's copies of parameters may still be waiting for the next optimizer step: the
    # writes below (and load_state_dict's) must come after them on the GPU.
    await_device_copies()
    files = _Files(storage)
    apply = _Applier(storage, location, scratch, verify=verify and in_place, files=files)
    for device in {r.dest.device for r in reads if r.dest.device.type == "cuda"}:
        apply.stream(device)  # here: training's stream is the current one of this thread only
    try:
        try:
            run_reads([(chunk_path(location, r.chunk), r.chunk.start, lambda r=r: apply(r))
                       for r in reads], pool)
        finally:
            apply.wait()
            files.close()
    except Exception as e:
        if any(k in apply.started for k in written):
            raise _partial(e, manifest.step, written, reads, apply) from e
        raise  # no live tensor was touched
    for name, value in values.items():
        kind = manifest.items[name]["kind"]
        try:
            if kind in ("module", "stateful"):
                load_stateful(state[name], value)
            elif kind == "tensor":
                with torch.no_grad():
                    state[name].copy_(value)
            else:
                state[name] = value
        except (RuntimeError, ValueError, KeyError, TypeError, OverflowError) as e:
            names = list(values)
            done = names[:names.index(name)]
            raise StateMismatchError(
                f"'{name}'.load_state_dict refused the checkpoint: {e}. The live tensors "
                f"already hold step {manifest.step}'s values; items loaded before it: "
                f"{done or 'none'}; '{name}' and the items after it were not loaded") from e
    return frozenset(written)


#: Below this many bytes per chunk on average, a file system's reads run on the calling
#: thread: the per-chunk Python then outweighs the copy and digest, which are all that
#: threads could overlap, and two threads only contend for the GIL (benchmarks/
#: bench_load_fixed.py: 10,000 tensors of 1 KiB load ~12% faster on one thread).
TINY_CHUNK_BYTES = 64 << 10


def _tiny(storage: Storage, reads: list[_Read]) -> bool:
    """Whether ``reads`` are too small for threads to pay off (object stores excepted: each
    read there is a request, and threads overlap the requests' latency)."""
    return (getattr(storage, "stream_block", None) is not None
            and sum(r.chunk.length for r in reads) < TINY_CHUNK_BYTES * len(reads))


def _partial(error: Exception, step: int, written: list[str], reads: list[_Read],
             apply: _Applier) -> PartialLoadError:
    """The apply pass failed: say exactly which live tensors changed."""
    total = collections.Counter(r.key for r in reads)
    full = [k for k in written if apply.finished.get(k, 0) == total[k]]
    part = [k for k in written if k in apply.started and k not in full]
    untouched = [k for k in written if k not in apply.started]
    return PartialLoadError(
        f"{error}; loading step {step} stopped part-way, so the live state is mixed: "
        f"{len(full)} tensors hold step {step}'s values ({few_keys(full)}), {len(part)} are "
        f"partly overwritten ({few_keys(part)}), {len(untouched)} are unchanged "
        f"({few_keys(untouched)}). "
        "Load a good step again before training on", path=getattr(error, "path", None),
        changed=frozenset(full + part), corrupt=isinstance(error, CorruptCheckpointError))


def few_keys(keys: list[str], n: int = 6) -> str:
    """The first ``n`` keys for a message, and how many more there are."""
    return ", ".join(keys[:n]) + (f", +{len(keys) - n} more" if len(keys) > n else "") or "none"


def _like(target: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's box, on the CPU) in the form of ``target``: a DTensor with the
    same mesh and placements for a DTensor, else the plain buffer (load_state_dict moves it)."""
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(target, dtensor):
        return dtensor.from_local(local.to(target.to_local().device), target.device_mesh,
                                  target.placements, run_check=False, shape=target.shape,
                                  stride=target.stride())
    return local


def _check_optimizers(state: MutableMapping[str, Any], wanted: dict[str, Any]) -> None:
    """An optimizer refuses param groups of other sizes; find that before anything changes."""
    for name, tree in wanted.items():
        obj = state[name]
        if not isinstance(obj, torch.optim.Optimizer) or not isinstance(tree, dict):
            continue
        saved = [len(g.get("params", [])) for g in tree.get("param_groups", [])
                 if isinstance(g, dict)]
        live = [len(g["params"]) for g in obj.param_groups]
        if saved != live:
            raise StateMismatchError(
                f"'{name}': the checkpoint's optimizer has parameter groups of sizes {saved}, "
                f"this optimizer {live}; nothing was loaded. Build it with the saved groups "
                f"(the same parameters, in the same order) to resume, or restore without "
                f"'{name}' to start the optimizer afresh")
