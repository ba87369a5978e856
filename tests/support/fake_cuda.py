"""A CPU stand-in for CUDA's streams and events, to check ckpt's stream ordering without a GPU.

``FakeCuda`` tensors are CPU tensors that say they live on a CUDA device; ``install`` swaps
``torch.cuda``'s Stream, Event, current_stream and stream context (and pinned allocation)
for fakes that follow CUDA's rules where ckpt relies on them:

- a copy from or to a device tensor is queued on the *current stream of that tensor's
  device* (not on the current device's stream);
- an event covers what its stream queued before it was recorded;
- a copy into or out of host memory is in flight until an event that covers it (or its
  stream) is synchronized on the host;
- the current device and each device's current stream are the calling thread's (a new
  thread starts on the default streams).

Nothing runs asynchronously: the copies happen at once, and the fakes only keep the books
that tests query (``Sim.covered``, ``Sim.host_in_flight``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any

import numpy as np
import torch


class FakeStream:
    def __init__(self, sim: Sim, device: torch.device, name: str) -> None:
        self.sim, self.device, self.name = sim, device, name
        # ("copy", device storage address, host byte range, "d2h"/"h2d"), ("record", event),
        # ("wait_event", event), ("wait_stream", stream, how many of its ops it waits for)
        self.ops: list[tuple] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.ops.append(("wait_stream", other, len(other.ops)))

    def wait_event(self, event: FakeEvent) -> None:
        self.ops.append(("wait_event", event))

    def synchronize(self) -> None:
        self.sim.done.update((self, i) for i in range(len(self.ops)))

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class FakeEvent:
    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.stream: FakeStream | None = None
        self.at = 0  # how many of its stream's ops it covers

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.sim.current[self.sim.device]
        self.stream, self.at = stream, len(stream.ops)
        stream.ops.append(("record", self))

    def synchronize(self) -> None:
        self.sim.done.update((self.stream, i) for i in range(self.at))

    def covers(self, stream: FakeStream, index: int) -> bool:
        return self.stream is stream and index < self.at


class Sim:
    """The books: streams per device, the current device, which queued ops the host saw end."""

    def __init__(self, devices: int = 2) -> None:
        self.defaults = [FakeStream(self, torch.device("cuda", i), f"default:{i}")
                         for i in range(devices)]
        self._thread = threading.local()  # CUDA's current device and streams are per thread
        self.devices: dict[int, torch.device] = {}  # storage address -> fake device
        self.pinned: set[int] = set()
        self.done: set[tuple[FakeStream, int]] = set()
        self.recorded_uses: list[tuple[int, FakeStream]] = []  # (storage address, stream)
        self.side: list[FakeStream] = []  # streams made with torch.cuda.Stream()

    @property
    def device(self) -> int:
        """This thread's current device's index."""
        return getattr(self._thread, "device", 0)

    @device.setter
    def device(self, index: int) -> None:
        self._thread.device = index

    @property
    def current(self) -> dict[int, FakeStream]:
        """This thread's current stream of each device (a new thread: the default ones)."""
        if not hasattr(self._thread, "current"):
            self._thread.current = dict(enumerate(self.defaults))
        return self._thread.current

    def tensor(self, t: torch.Tensor, device: int = 0) -> FakeCuda:
        t = t.clone()
        self.devices[t.untyped_storage().data_ptr()] = torch.device("cuda", device)
        return t.as_subclass(FakeCuda)

    def copy(self, gpu: FakeCuda, host: torch.Tensor, direction: str) -> None:
        stream = self.current[gpu.device.index]
        stream.ops.append(("copy", gpu.untyped_storage().data_ptr(), _host_range(host),
                           direction))

    def copies(self, direction: str = "d2h") -> list[tuple[FakeStream, int, int]]:
        """Every copy queued: (stream, index in its ops, device storage address)."""
        return [(s, i, op[1]) for s in self._streams() for i, op in enumerate(s.ops)
                if op[0] == "copy" and op[3] == direction]

    def covered(self, stream: FakeStream, index: int, waiter: FakeStream,
                before: int | None = None) -> bool:
        """Whether ``waiter``'s ops (its first ``before``) come after op ``index`` of
        ``stream``: the same stream, a wait for an event that covers it, or a wait for a
        stream whose ops up to then come after it."""
        ops = waiter.ops if before is None else waiter.ops[:before]
        if stream is waiter:
            return index < len(ops)
        return any((op[0] == "wait_event" and op[1].covers(stream, index))
                   or (op[0] == "wait_stream" and self.covered(stream, index, op[1], op[2]))
                   for op in ops)

    def host_in_flight(self, start: int, end: int) -> list:
        """The copies touching host bytes [start, end) that the host has not seen end."""
        return [(s, i) for s in self._streams() for i, op in enumerate(s.ops)
                if op[0] == "copy" and (s, i) not in self.done
                and op[2][0] < end and start < op[2][1]]

    def _streams(self) -> list[FakeStream]:
        found = list(self.defaults)
        for s in [*self.current.values(), *self.side]:
            if s not in found:
                found.append(s)
        return found


def _host_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def memory_range(view: memoryview) -> tuple[int, int]:
    """The addresses of a writable buffer's bytes."""
    start = np.frombuffer(view, np.uint8).ctypes.data
    return start, start + len(view)


SIM: Sim | None = None


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on the CUDA device its storage was registered with."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return SIM.devices[self.untyped_storage().data_ptr()]

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def record_stream(self, stream: Any) -> None:  # type: ignore[override]
        SIM.recorded_uses.append((self.untyped_storage().data_ptr(), stream))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            if isinstance(src, FakeCuda) and not isinstance(dst, FakeCuda):
                SIM.copy(src, dst, "d2h")
            elif isinstance(dst, FakeCuda) and not isinstance(src, FakeCuda):
                SIM.copy(dst, src, "h2d")
        return super().__torch_function__(func, types, args, kwargs or {})


def install(monkeypatch: Any, devices: int = 2) -> Sim:
    """Replace torch.cuda's streams and events (and pinned allocation) with the fakes, for
    one test: ckpt's registry of live stagers and the stager of ckpt.save/async_save too, so
    no fake stream or event outlives the test."""
    import weakref

    import ckpt.api
    import ckpt._save.staging
    import ckpt._shared.buffers

    sim = Sim(devices)
    monkeypatch.setattr(sys.modules[__name__], "SIM", sim)
    monkeypatch.setattr(ckpt._shared.buffers, "_COPIERS", weakref.WeakSet())
    monkeypatch.setattr(ckpt.api._ONE_SHOT, "_stager", ckpt._save.staging.Stager())
    real_empty = torch.empty

    def index(device: Any) -> int:
        if device is None:
            return sim.device
        return torch.device(device).index if not isinstance(device, int) else device

    def new_stream(device: Any = None, priority: int = 0) -> FakeStream:
        s = FakeStream(sim, torch.device("cuda", index(device)), f"side{len(sim.side)}")
        sim.side.append(s)
        return s

    @contextlib.contextmanager
    def stream(s: FakeStream):
        i, before_device = s.device.index, sim.device
        before = sim.current[i]
        sim.current[i], sim.device = s, i
        try:
            yield
        finally:
            sim.current[i], sim.device = before, before_device

    def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        t = real_empty(*args, **kwargs)
        if pin_memory:
            sim.pinned.add(t.untyped_storage().data_ptr())
        return t

    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent(sim))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: sim.current[index(device)])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "is_pinned",
                        lambda self: self.untyped_storage().data_ptr() in sim.pinned)
    return sim
