"""Loading a committed step into live state, in place, on any world size, in bounded memory.

Order matters for "a failed load changes nothing":

1. The manifest is validated and compared with the live state (keys, shapes, dtypes,
   optimizer parameter groups, pickle) and every value is decoded before any byte is read.
2. First pass: every chunk this rank needs is read and checked against its digest; nothing
   live changes. A chunk whose destination is a new buffer (a value the caller's state holds
   no tensor for, or one of another shape or dtype, handed over by ``load_state_dict`` at
   the end) is read once, straight into that buffer, each block digested as it lands. A
   chunk for a live tensor is read into staging memory where :mod:`ckpt._load.staging`
   uses it (object stores, within a memory budget); otherwise each file's run of adjacent
   chunks is streamed through one small block buffer per reading thread
   (``Storage.stream_block``, 512 KiB on a file system: the block is still in the CPU cache
   when it is digested, so checking costs no copy through memory); where every read is a
   request, whole chunks go through two reused chunk buffers instead. Compressed chunks are
   decoded into a chunk buffer to be digested.
3. Apply pass: staged chunks are copied into their live tensors; the others are read again
   straight into the live tensors (CPU, contiguous, whole rows), or through a few reused
   bounce buffers (pinned, copied on a side stream, for CUDA tensors; also for
   non-contiguous tensors and chunks that only partly overlap a box). The first pass has
   just brought the files into the page cache, so this second read is a memory copy while
   the step fits in free memory; a memory copy is bound by the CPU, so where there are more
   cores than files each file's chunks are cut into contiguous runs read in parallel. Each
   reading thread opens each file once for the pass (``Storage.open_reader``), not once
   per chunk.
4. Objects get ``load_state_dict`` last.

Under a process group (a restore from the root), the chunks several ranks need are read by
one of them and sent to the others (:mod:`ckpt._load.cooperative`): the same passes, each
rank reading its share.

The extra memory is a block and a few chunk-sized buffers per reading thread, whatever the
state's size, plus the staged chunks where staging is used (docs/design.md, "Loading", has
the measurements behind these choices). Should the apply pass fail all the same (a file
removed or a read error between the passes), the error names the tensors that hold the new
values, those partly written and those untouched.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
from typing import Any, MutableMapping

import torch

from storage_backends import Storage, reads_are_requests

from ckpt._format.gcpause import paused_gc
from ckpt._format.manifest import Manifest
from ckpt._load.chunk_read import OpenFiles
from ckpt._load.cooperative import Cooperation, GroupFailed, Shares
from ckpt._load.read_plan import ChunkRead, needed_tensors, reads_for
from ckpt._load.read_run import Applier, Scratch, run_reads, verify_jobs
from ckpt._load.staging import Stage, plan_staging
from ckpt._shared.buffers import await_device_copies
from ckpt._shared.sharding import Box, dtensor_type, local_piece, prefetch, read_box, source_rank
from ckpt._shared.state import (FlatState, check_compatible, decode, flatten, is_stateful,
                                item_tree, load_stateful)
from ckpt._step.headers import check_headers
from ckpt._step.integrity import check_structure, chunk_path
from ckpt.errors import CorruptCheckpointError, PartialLoadError, StateMismatchError

log = logging.getLogger("ckpt")


def _live_state(state: MutableMapping[str, Any], rank: int) -> FlatState:
    """Flatten what the live state holds now, for validation and as read destinations."""
    live = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) or is_stateful(v)}
    flat = flatten(live, allow_pickle=True, rank=rank, keep_vars=True)
    for k in state:
        if k not in live:
            flat.items[k] = {"kind": "value", "tree": None}
    return flat


def load_step(storage: Storage, location: str, manifest: Manifest,
              state: MutableMapping[str, Any], *, rank: int = 0, allow_pickle: bool = False,
              verify: bool = True, pool: cf.ThreadPoolExecutor | None = None,
              in_place: bool = False, coop: Cooperation | None = None) -> frozenset[str]:
    """Load ``manifest``'s step into this rank's ``state`` (see the module docstring);
    returns the keys of the live tensors it wrote.

    By default (and always with ``verify``) a chunk that fails its digest changes nothing:
    every chunk is verified before the first live byte is written. ``in_place`` skips the
    verify pass (one read instead of two; each block is digested where it lands): a digest
    mismatch then leaves tensors partly overwritten, and the :class:`PartialLoadError` says
    which. Without ``verify`` nothing is checked against digests. Everything that can be
    checked without the data (manifest, files, keys, shapes, dtypes, parameter groups,
    pickle, value tags) is checked before the first byte is read.

    ``coop`` (every rank of its group calls this together): the chunks several ranks need
    are read once, by one of them, and sent to the others (:mod:`ckpt._load.cooperative`),
    with the same guarantees; plain reads where the group cannot.

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
                          in_place, coop)


def _load_step(storage: Storage, location: str, manifest: Manifest,
               state: MutableMapping[str, Any], rank: int, allow_pickle: bool, verify: bool,
               pool: cf.ThreadPoolExecutor | None, in_place: bool,
               coop: Cooperation | None) -> frozenset[str]:
    try:
        reads, values, written = _plan(storage, location, manifest, state, rank, allow_pickle)
    except BaseException as e:
        if coop is not None:  # the other ranks wait for this rank's list of reads
            coop.abandon(e)
        raise
    scratch = Scratch()
    if _tiny(storage, reads):
        pool = None
    shares = None
    try:
        # A file system's root is read through the host's page cache, shared by its ranks.
        cached = not reads_are_requests(storage)
        shares = coop.enter(storage.url, location, manifest, reads,
                            cached=cached) if coop else None
        if shares is not None:
            _read_shared(storage, location, manifest, reads, shares, scratch, pool, verify,
                         in_place, written)
            _apply_items(state, manifest, values)
            return frozenset(written)
    except GroupFailed as e:
        log.warning("ckpt.restore: reading the replicated chunks once for all ranks failed "
                    "(%s); every rank reads what it needs from %s instead", e, storage.url)
    # Plain reads: after a failed exchange, only of the chunks it did not bring (those it
    # did are in place and checked); a failure says which live tensors it had changed.
    plain = reads if shares is None else shares.unsettled(reads)
    try:
        _check_files(storage, location, manifest, plain)
        if verify and not in_place:
            later, staged = _read_before_apply(storage, location, plain, written, scratch, pool)
            _apply_pass(storage, location, manifest, later, scratch, pool, False, written,
                        staged, cached=cached)
        else:
            _apply_pass(storage, location, manifest, plain, scratch, pool, verify and in_place,
                        written, cached=getattr(storage, "reads_from_memory", False))
    except Exception as e:
        if shares is not None and not isinstance(e, PartialLoadError) and any(
                k in shares.started for k in written):
            raise _partial(e, manifest.step, written, reads, shares) from e
        raise
    _apply_items(state, manifest, values)
    return frozenset(written)


def _plan(storage: Storage, location: str, manifest: Manifest, state: MutableMapping[str, Any],
          rank: int, allow_pickle: bool
          ) -> tuple[list[ChunkRead], dict[str, Any], list[str]]:
    """Everything checked before the first byte of data is read: (the reads, the decoded
    values to hand to the live objects, the keys of the live tensors read into in place)."""
    src = source_rank(rank, manifest.world_size)
    live = _live_state(state, src)
    spec = {k: (e.shape, e.torch_dtype) for k, e in manifest.tensors.items()}
    check_compatible(live, manifest.items, spec, manifest.aliases, src)
    # Items saved but absent from `state` are left alone: a caller may restore a subset.
    wanted = {name: item_tree(manifest.items[name], src) for name in state
              if name in manifest.items}
    _check_optimizers(state, wanted)
    needed = needed_tensors(storage, location, manifest, wanted, allow_pickle)
    pending, loaded, written = _destinations(manifest, live, needed)
    prefetch(manifest, [(key, box) for key, _, box in pending])  # format 2: tables at once
    reads = [r for key, dest, box in pending for r in reads_for(manifest, key, dest, box)]
    for alias, target in manifest.aliases.items():
        if target in loaded:
            loaded[alias] = loaded[target]
    try:
        values = {name: decode(tree, loaded, allow_pickle=allow_pickle)
                  for name, tree in wanted.items()}
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{storage.url}/{location}: a saved value cannot be "
                                     f"decoded ({e!r}); nothing was loaded", path=location) from e
    return reads, values, written


def _check_files(storage: Storage, location: str, manifest: Manifest,
                 reads: list[ChunkRead]) -> None:
    """The files ``reads`` read (only these: under a process group each rank checks
    what it reads from the root, not N ranks every file) hold their chunks: sizes and
    headers agree with the manifest. On an object store, where each is a request, the
    headers are read while the sizes are asked for (a size's error, the plainer, wins)."""
    chunks, pairs = [r.chunk for r in reads], [(r.key, r.chunk) for r in reads]
    if not reads_are_requests(storage):  # a file system: no round trips
        check_structure(storage, location, manifest, chunks)
        check_headers(storage, location, manifest, pairs)
        return
    with cf.ThreadPoolExecutor(1, thread_name_prefix="ckpt-check") as pool:
        headers = pool.submit(check_headers, storage, location, manifest, pairs)
        check_structure(storage, location, manifest, chunks)
        headers.result()


def _read_shared(storage: Storage, location: str, manifest: Manifest, reads: list[ChunkRead],
                 shares: Shares, scratch: Scratch, pool: cf.ThreadPoolExecutor | None,
                 verify: bool, in_place: bool, written: list[str]) -> None:
    """The passes of a cooperative load: two-pass loads verify each rank's share first
    (raising on every rank, nothing changed, when a chunk fails), then the exchange fills
    every destination; a failure there says which live tensors changed. The files this
    rank reads are checked first, the outcome agreed before any rank reads."""
    def check_own_files() -> None:
        _check_files(storage, location, manifest, shares.owned_reads())

    first_pass = check_own_files
    if verify and not in_place:
        shares.verify(storage, location, scratch, pool, before=check_own_files)
        first_pass = None
    await_device_copies()  # (as in _apply_pass)
    try:
        shares.exchange(storage, location, pool, landing=verify and in_place, check=verify,
                        before=first_pass)
    except GroupFailed:
        raise
    except Exception as e:
        if any(k in shares.started for k in written):
            raise _partial(e, manifest.step, written, reads, shares) from e
        raise


def _destinations(manifest: Manifest, live: FlatState, needed: set[str]
                  ) -> tuple[list[tuple[str, torch.Tensor, Box]], dict[str, torch.Tensor],
                             list[str]]:
    """Where each needed tensor is read to: (key, destination, its box) per tensor, the
    tensor each key decodes to, and the keys of the live tensors read into in place.

    A live tensor of the saved shape and dtype is its own destination (this rank's shard of
    a DTensor); any other gets a new CPU buffer that ``load_state_dict`` copies from."""
    loaded: dict[str, torch.Tensor] = {}
    pending: list[tuple[str, torch.Tensor, Box]] = []
    written: list[str] = []
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
    return pending, loaded, written


def _read_before_apply(storage: Storage, location: str, reads: list[ChunkRead],
                       written: list[str], scratch: Scratch,
                       pool: cf.ThreadPoolExecutor | None
                       ) -> tuple[list[ChunkRead], dict[int, torch.Tensor]]:
    """The first pass of an atomic load: every chunk read and checked, nothing live changed.

    Chunks for new buffers are read once, straight into them, each block digested as it
    lands; chunks for live tensors into staging memory where :mod:`ckpt._load.staging` uses
    it, else streamed through a block (the verify pass) to be read again into place.
    Returns (the reads left for the apply pass, the staged chunks by ``id`` of their read).
    """
    live_keys = set(written)
    staged, twice = plan_staging(storage, [r for r in reads if r.key in live_keys])
    fresh = [r for r in reads if r.key not in live_keys]
    if fresh or staged:
        log.debug("ckpt.load: %d chunks read once into new buffers, %d into staging, %d "
                  "verified then read again into place", len(fresh), len(staged), len(twice))
    files = OpenFiles(storage)
    into_new = Applier(storage, location, scratch, verify=True, files=files)
    stage = Stage(storage, location, files)
    jobs = [(chunk_path(location, r.chunk), r.chunk.start, lambda r=r: into_new(r))
            for r in fresh]
    jobs += [(chunk_path(location, r.chunk), r.chunk.start, lambda r=r: stage(r))
             for r in staged]
    jobs += verify_jobs(storage, location, twice, scratch)
    try:
        run_reads(jobs, pool, cached=getattr(storage, "reads_from_memory", False))
    finally:
        files.close()
    return twice + staged, stage.buffers


def _apply_pass(storage: Storage, location: str, manifest: Manifest, reads: list[ChunkRead],
                scratch: Scratch, pool: cf.ThreadPoolExecutor | None, verify: bool,
                written: list[str], staged: dict[int, torch.Tensor] | None = None,
                cached: bool = False) -> None:
    """Read every chunk into its destination (a staged one is copied from memory); on
    failure, say which live tensors changed. ``cached``: the bytes are in memory (the verify
    pass has just read the files through the page cache, or the storage is this node's
    memory tier): a file's reads are spread over the cores (see :func:`run_reads`)."""
    # A save's copies of parameters may still be waiting for the next optimizer step: the
    # writes below (and load_state_dict's) must come after them on the GPU.
    await_device_copies()
    files = OpenFiles(storage)
    apply = Applier(storage, location, scratch, verify=verify, files=files, staged=staged)
    for device in {r.dest.device for r in reads if r.dest.device.type == "cuda"}:
        apply.stream(device)  # here: training's stream is the current one of this thread only
    try:
        try:
            run_reads([(chunk_path(location, r.chunk), r.chunk.start, lambda r=r: apply(r))
                       for r in reads], pool, cached=cached)
        finally:
            apply.wait()
            files.close()
    except Exception as e:
        if any(k in apply.started for k in written):
            raise _partial(e, manifest.step, written, reads, apply) from e
        raise  # no live tensor was touched


def _apply_items(state: MutableMapping[str, Any], manifest: Manifest,
                 values: dict[str, Any]) -> None:
    """Hand each decoded item to its live object (``load_state_dict``), in order."""
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


#: Below this many bytes per chunk on average, a file system's reads run on the calling
#: thread: the per-chunk Python then outweighs the copy and digest, which are all that
#: threads could overlap, and two threads only contend for the GIL (benchmarks/
#: bench_load_fixed.py: 10,000 tensors of 1 KiB load ~12% faster on one thread).
TINY_CHUNK_BYTES = 64 << 10


def _tiny(storage: Storage, reads: list[ChunkRead]) -> bool:
    """Whether ``reads`` are too small for threads to pay off (object stores excepted: each
    read there is a request, and threads overlap the requests' latency)."""
    return (not reads_are_requests(storage)
            and sum(r.chunk.length for r in reads) < TINY_CHUNK_BYTES * len(reads))


def _partial(error: Exception, step: int, written: list[str], reads: list[ChunkRead],
             apply: Applier | Shares) -> PartialLoadError:
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
