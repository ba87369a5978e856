"""Byte views and addresses of host tensors, and the fence that holds writes behind saves'
device copies."""

from __future__ import annotations

import ctypes
import weakref
from typing import Protocol

import torch


class DeviceCopier(Protocol):
    """Something that issues device-to-host copies which training's streams may have to await."""

    def await_copies(self) -> None: ...


# Every live copier (a save's Stager registers itself): a load about to overwrite tensors
# must first let their pending copies out of them finish.
_COPIERS: weakref.WeakSet = weakref.WeakSet()


def register_copier(copier: DeviceCopier) -> None:
    """Let :func:`await_device_copies` wait for ``copier``'s copies (held weakly)."""
    _COPIERS.add(copier)


def await_device_copies() -> None:
    """Make training's streams wait for every save's device-to-host copies still in flight
    that only an optimizer step waits for: for code about to change those tensors in place
    otherwise (a load into them, before the next step)."""
    for copier in list(_COPIERS):
        copier.await_copies()


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def plain_address(t: torch.Tensor, nbytes: int) -> int | None:
    """Where the ``nbytes`` bytes of a contiguous CPU tensor start in memory, or None when
    they cannot be read as they are (not contiguous, a lazy conjugate or negative, another
    size: torch has to copy such a tensor)."""
    if (not t.is_cpu or t.layout != torch.strided or not t.is_contiguous() or t.is_conj()
            or t.is_neg() or t.is_quantized or t.nbytes != nbytes):
        return None
    try:
        return t.data_ptr()
    except RuntimeError:  # a tensor without storage of its own (a wrapper subclass)
        return None


_memory_at = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_at.restype = ctypes.py_object
_memory_at.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
_READ = 0x100  # PyBUF_READ


def read_view(address: int, nbytes: int) -> memoryview:
    """A read-only view of ``nbytes`` bytes of this process's memory at ``address`` (no copy;
    it does not keep what owns them alive: use it while the owner lives)."""
    return _memory_at(address, nbytes, _READ)
