"""Staging a save's tensors in host memory: reused (pinned) buffers and the device-to-host copies.

:meth:`Stager.stage` runs on the caller's thread. CUDA tensors are copied on a side stream per
device with non-blocking copies, so the training loop goes on while they land; the returned
fence tells the writer when the bytes are there to read.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from ckpt._shared.buffers import plain_address, register_copier
from ckpt._shared.copy_threads import HelperThreads, run_jobs
from ckpt._shared.streaming_copy import copy as stream_copy

# A CPU tensor's copy into its buffer is cut into pieces of this many bytes, shared by the
# threads; pieces under PARALLEL bytes (small tensors), mostly Python, are the calling
# thread's alone.
PIECE = 4 << 20
PARALLEL = 256 << 10


class Destination(Protocol):
    """Where a save's CPU tensors are copied instead of into this stager's buffers (the
    memory tier's shared pages, ``ckpt/_memory/slabs.py``): ``views`` by key, ``fill``,
    which copies tensors into their views (on ``threads`` threads, digesting as it goes),
    and ``known_digests()``: those digests by (key, byte start, byte length) of a chunk."""

    views: Mapping[str, torch.Tensor]

    def fill(self, tensors: Mapping[str, torch.Tensor], threads: int = 1) -> None: ...

    def known_digests(self) -> Any: ...


def _optimizer_storages(optimizers: Sequence[torch.optim.Optimizer]) -> set[int]:
    """Storage addresses of every CUDA tensor that only these optimizers' step changes."""
    out = set()
    for opt in optimizers:
        for group in opt.param_groups:
            out.update(_storage_ptr(p) for p in group["params"] if p.is_cuda)
        for per_param in opt.state.values():
            out.update(_storage_ptr(v) for v in per_param.values()
                       if isinstance(v, torch.Tensor) and v.is_cuda)
    return out


def _storage_ptr(t: torch.Tensor) -> int:
    """Where a tensor's memory starts (a DTensor's: its local shard's)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.untyped_storage().data_ptr()


def _wait_before_step(stager_ref: Callable[[], Stager | None]) -> Callable:
    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        stager = stager_ref()
        if stager is not None:
            stager.await_copies()
    return hook


class _Ready:
    """The end of a save's device-to-host copies: one event per device copied from."""

    def __init__(self, events: list) -> None:
        self.events = events

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()


def _record(stream: Any) -> Any:
    event = torch.cuda.Event()
    event.record(stream)
    return event


class Stager:
    """Host buffers reused across saves (one set: at most one save is in flight).

    CUDA tensors are copied on a side stream into pinned buffers. Training's stream waits
    only for the copies of tensors a forward pass may change (batch-norm statistics and
    anything else not guarded); the copies of tensors that only ``optimizer.step()`` changes
    (the parameters and the state of the optimizers passed as ``guards``) run during the
    next forward and backward, and each guard's step pre-hook makes its stream wait for them.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._streams: dict[torch.device, Any] = {}  # one side stream per device
        # per device: the event the guarded optimizers' next step waits for
        self._pending: dict[torch.device, Any] = {}
        self._hooked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._workers = HelperThreads("ckpt-stage")  # the host copies' helper threads
        register_copier(self)  # a load into these tensors waits for the copies first

    def release_buffers(self) -> None:
        """Let the host buffers go (no save may be in flight), and the helper threads."""
        self._buffers.clear()
        self._workers.close()

    def stage(self, tensors: dict[str, torch.Tensor], copy: bool,
              guards: Sequence[torch.optim.Optimizer] = (),
              into: Destination | None = None
              ) -> tuple[dict[str, torch.Tensor], _Ready | None]:
        """Host-memory, contiguous copies of ``tensors``, and what to ``synchronize()`` on
        before reading them (CUDA) or None.

        With ``copy=False`` (a synchronous save: training waits anyway) CPU tensors that are
        already contiguous are used as they are. ``into``: destinations of some keys (the
        memory tier's shared pages, ``ckpt/_memory/slabs.py``): CPU tensors are copied
        there (``into.fill``, on as many threads as torch computes with, as its own copy
        does), with or without ``copy``, and keep no buffer here; a CUDA tensor still goes
        to its pinned buffer (the memory tier copies it over once it has landed).
        """
        staged: dict[str, torch.Tensor] = {}
        cuda_sources: list = []
        host: list = []  # (buffer, CPU tensor) to copy
        guarded = _optimizer_storages(guards) if guards else set()
        deferred: list = []
        views = into.views if into is not None else {}
        shared = {key: t for key, t in tensors.items() if key in views and t.is_cpu}
        if shared:
            into.fill(shared, threads=torch.get_num_threads())
            if len(shared) == len(tensors):  # all in shared memory (the memory tier's CPU state)
                self._buffers.clear()
                return {key: views[key] for key in tensors}, self._copy_from_cuda([], [], ())
        for key, t in tensors.items():
            if key in shared:
                self._buffers.pop(key, None)
                staged[key] = views[key]
                continue
            if not copy and t.device.type == "cpu":
                # resolve_*: a lazy conjugate/negative view has no plain bytes of its own
                staged[key] = t.resolve_conj().resolve_neg().contiguous()
                continue
            buf = self._buffers.get(key)
            pin = t.device.type == "cuda"
            if (buf is None or buf.shape != t.shape or buf.dtype != t.dtype
                    or (pin and not buf.is_pinned())):
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
                self._buffers[key] = buf
            if t.device.type == "cuda":
                later = t.numel() and _storage_ptr(t) in guarded
                (deferred if later else cuda_sources).append((buf, t))
            else:
                host.append((buf, t))
            staged[key] = buf
        self._copy_on_host(host)
        for key in list(self._buffers):
            if key not in tensors:
                del self._buffers[key]
        return staged, self._copy_from_cuda(cuda_sources, deferred, guards)

    def _copy_on_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each CPU tensor into its buffer: with non-temporal stores
        (``ckpt/_shared/streaming_copy.py``: the buffers are read again only by the writer,
        later) in pieces of :data:`PIECE` bytes shared by as many threads as torch computes
        with, as its own copy does; a tensor whose bytes cannot be read as they are (not
        contiguous, a lazy conjugate) by torch."""
        jobs, small = [], []
        for buf, t in pairs:
            nbytes = buf.numel() * buf.element_size()
            source = plain_address(t, nbytes)
            if source is None:
                buf.copy_(t)
                continue
            target = buf.data_ptr()
            for at in range(0, nbytes, PIECE):
                n = min(PIECE, nbytes - at)
                (jobs if n >= PARALLEL else small).append((target + at, source + at, n))
        run_jobs(jobs, small, _copy_job, torch.get_num_threads(), self._workers)

    def _copy_from_cuda(self, first: list, deferred: list,
                        guards: Sequence[torch.optim.Optimizer]) -> _Ready | None:
        """Issue the copies of ``first`` (awaited by training's stream at once) and of
        ``deferred`` (awaited by the guards' next step), per device on its side stream."""
        self._pending = {}
        if not first and not deferred:
            return None
        events = []
        for device in dict.fromkeys(t.device for _, t in first + deferred):
            now = [(b, t) for b, t in first if t.device == device]
            later = [(b, t) for b, t in deferred if t.device == device]
            events.append(self._copy_on(device, now, later))
        if deferred:
            for optimizer in guards:
                if optimizer not in self._hooked:
                    self._hooked[optimizer] = optimizer.register_step_pre_hook(
                        _wait_before_step(weakref.ref(self)))
        return _Ready(events)

    def _copy_on(self, device: torch.device, now: list, later: list) -> Any:
        # A copy runs on the current stream of its tensor's device: the side stream and the
        # training stream are those of the tensors' device, not of the current device (a
        # model put on cuda:1 without torch.cuda.set_device).
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        main = torch.cuda.current_stream(device)
        stream.wait_stream(main)  # copy what training has computed so far
        with torch.cuda.stream(stream):
            for buf, t in now:
                buf.copy_(t, non_blocking=True)
                t.record_stream(stream)  # keep t's memory alive until the copy ran
            if now:
                # training's later in-place updates of these (a forward pass) wait for them
                main.wait_event(_record(stream))
            for buf, t in later:
                buf.copy_(t, non_blocking=True)
                t.record_stream(stream)
        event = _record(stream)
        if later:
            self._pending[device] = event
        return event

    def await_copies(self) -> None:
        """Training's streams wait (on the GPU) for the copies the guards' step waits for;
        the CPU does not."""
        for device, event in self._pending.items():
            torch.cuda.current_stream(device).wait_event(event)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def _copy_job(job: tuple[int, int, int]) -> None:
    stream_copy(*job)

