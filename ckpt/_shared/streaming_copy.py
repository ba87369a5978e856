"""A copy of host memory whose stores go around the caches (non-temporal stores).

A save's blocking copy writes bytes nobody reads again soon (a restore, much later). An
ordinary copy first reads every destination cache line from memory (to own it), then writes
it back: a copy of N bytes moves 3N over the memory bus, and the copy runs at the bus's
limit. Non-temporal stores write whole lines straight to memory: 2N. glibc's ``memmove``
uses them only for one copy larger than a threshold sized from the shared cache (192 MiB on
a 32 MiB-L3 machine), which a copy in cache-sized blocks (the digest reads each block back
while it is in the core's cache) never reaches, and neither torch, numpy nor ctypes offers
one. So this module holds the loop itself: 60 bytes of x86-64 code (SSE2, present on every
x86-64 processor), put in a page of its own that is made executable only after it is
written and never writable again (W^X), and called through ctypes, which releases the GIL
for the call like ``ctypes.memmove``.

Where the routine cannot be used (another architecture or OS, a system that refuses
executable mappings, ``CKPT_STREAMING_COPY=0`` in the environment, or a self-check that
fails), :func:`copy` is ``memmove``: the same bytes, one more pass over the bus.

Nothing reaches the routine but addresses and lengths from this process's own tensors and
mappings; its code is the constant below.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import sys
import threading
from typing import Callable

log = logging.getLogger(__name__)

# The routine, for the System V AMD64 calling convention (rdi: destination, rsi: source,
# rdx: bytes, a positive multiple of 64; the destination 16-byte aligned):
#         endbr64                                     a landing pad for an indirect call
#                                                     (a no-op without branch tracking)
#   loop: movdqu xmm0..xmm3, [rsi + 0/16/32/48]     four unaligned 16-byte loads
#         movntdq [rdi + 0/16/32/48], xmm0..xmm3    four non-temporal 16-byte stores
#         add rsi, 64 ; add rdi, 64 ; sub rdx, 64 ; jnz loop
#         sfence                                      the stores are visible before return
#         ret
_CODE = bytes.fromhex(
    "f30f1efa"
    "f30f6f06" "f30f6f4e10" "f30f6f5620" "f30f6f5e30"
    "660fe707" "660fe74f10" "660fe75720" "660fe75f30"
    "4883c640" "4883c740" "4883ea40" "75cc"
    "0faef8" "c3")
LINE = 64  # bytes per iteration of the loop
ALIGN = 16  # the destination alignment movntdq needs
# Below this a copy is a memmove: its few lines are cheapest through the cache, and the
# routine's fence is not worth paying for them.
SMALL = 4096

_memmove = ctypes.memmove
_lock = threading.Lock()
_routine: Callable[[int, int, int], None] | None = None
_loaded = False


def _new_lock() -> None:
    """In a forked child: a lock of its own (another thread of the parent may have held
    the parent's while it forked, and would never release the child's copy)."""
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock)


def _supported() -> bool:
    return (sys.platform.startswith("linux")
            and platform.machine().lower() in ("x86_64", "amd64")
            and ctypes.sizeof(ctypes.c_void_p) == 8  # not a 32-bit Python on that kernel
            and os.environ.get("CKPT_STREAMING_COPY", "1") != "0")


def _load() -> Callable[[int, int, int], None] | None:
    """The routine in an executable page of its own, checked on a test copy; None where it
    cannot be had."""
    if not _supported():
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    size = mmap.PAGESIZE
    page = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if page in (None, ctypes.c_void_p(-1).value):
        log.debug("streaming copy off: mmap failed (errno %d)", ctypes.get_errno())
        return None
    ctypes.memmove(page, _CODE, len(_CODE))
    if libc.mprotect(page, size, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
        # a system that forbids executable mappings made at run time (SELinux's execmem)
        log.debug("streaming copy off: mprotect failed (errno %d)", ctypes.get_errno())
        return None  # the page stays mapped: a page of memory, never used
    routine = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(page)
    if not _checks(routine):
        log.warning("streaming copy off: its test copy came out wrong; copies use memmove")
        return None
    return routine


def _checks(routine: Callable[[int, int, int], None]) -> bool:
    """A test copy of 3 lines into an aligned buffer: every byte, and nothing past the end."""
    n = 3 * LINE
    source = (ctypes.c_ubyte * n)(*(i * 7 % 251 for i in range(n)))
    target = (ctypes.c_ubyte * (n + 2 * LINE))()
    at = ctypes.addressof(target)
    at += -at % ALIGN
    routine(at, ctypes.addressof(source), n)
    out = (ctypes.c_ubyte * (n + LINE)).from_address(at)
    return bytes(out[:n]) == bytes(source) and not any(out[n:])


def native() -> bool:
    """Whether copies use the non-temporal routine (loaded on first use)."""
    return _get() is not None


def _get() -> Callable[[int, int, int], None] | None:
    global _routine, _loaded
    if not _loaded:
        with _lock:
            if not _loaded:
                _routine = _load()
                _loaded = True
    return _routine


def copy(destination: int, source: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``source`` to address ``destination`` (the two not
    overlapping) with non-temporal stores where they can be had: the unaligned head and the
    tail of less than a line through ``memmove``, the lines between with the routine."""
    routine = _routine if _loaded else _get()
    if routine is None or nbytes < SMALL:
        _memmove(destination, source, nbytes)
        return
    head = -destination % ALIGN
    if head:
        _memmove(destination, source, head)
    body = (nbytes - head) // LINE * LINE
    if body:  # (the loop runs at least once: never with 0)
        routine(destination + head, source + head, body)
    done = head + body
    if done < nbytes:
        _memmove(destination + done, source + done, nbytes - done)
