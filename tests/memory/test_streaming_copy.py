"""The memory tier's copy with non-temporal stores (ckpt/_shared/streaming_copy.py) writes
exactly the source's bytes, whatever the alignment of either end and the length, and nothing
around them; on x86-64 Linux it is on; where it is switched off or its self-check fails, a
copy is a memmove and still exact."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys

import pytest

from ckpt._shared import streaming_copy
from ckpt._shared.buffers import read_view

X86_LINUX = sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64")
GUARD = 256  # bytes before and after the destination that must stay as they were


def copied(length: int, source_shift: int, dest_shift: int) -> tuple[bytes, bytes, bytes]:
    """(source bytes, destination bytes after the copy, the guard bytes around them)."""
    pattern = bytes((i * 131 + 7) % 256 for i in range(251))  # a prime period: no alignment
    source_buf = ctypes.create_string_buffer(pattern * ((length + 64) // 251 + 1))
    target = (ctypes.c_ubyte * (length + 2 * GUARD + 128))()
    ctypes.memset(target, 0xA5, len(target))
    base = ctypes.addressof(target) + GUARD
    base += -base % 64 + dest_shift  # a known alignment, then shifted
    src = ctypes.addressof(source_buf) + source_shift
    streaming_copy.copy(base, src, length)
    out = ctypes.string_at(base, length)
    around = ctypes.string_at(base - GUARD, GUARD) + ctypes.string_at(base + length, GUARD)
    return ctypes.string_at(src, length), out, around


@pytest.mark.parametrize("length", [0, 1, 63, 64, 4095, 4096, 4097, 4096 + 63, 65536,
                                    (512 << 10) + 17, 3 << 20])
@pytest.mark.parametrize("dest_shift", [0, 1, 8, 15, 16, 33, 63])
def test_every_byte_lands_and_nothing_around_it(length, dest_shift):
    for source_shift in (0, 3):
        source, out, around = copied(length, source_shift, dest_shift)
        assert out == source
        assert around == b"\xa5" * (2 * GUARD)


@pytest.mark.skipif(not X86_LINUX, reason="the non-temporal routine is x86-64 Linux only")
def test_the_non_temporal_routine_is_used_on_x86_64_linux():
    """It loads and passes its self-check here (a wrong byte in it would leave every copy
    to memmove without a word but a log line), unless this system refuses executable
    mappings made at run time (SELinux's execmem, MemoryDenyWriteExecute)."""
    if not streaming_copy.native() and not _executable_pages_allowed():
        pytest.skip("this system refuses executable mappings made at run time")
    assert streaming_copy.native()


def _executable_pages_allowed() -> bool:
    import mmap

    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    return page not in (None, ctypes.c_void_p(-1).value) and libc.mprotect(
        page, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) == 0


def test_a_routine_that_fails_its_check_is_not_used(monkeypatch, caplog):
    """A routine that copies nothing (only ``ret``) fails the self-check: not loaded,
    a warning, and copies stay exact through memmove."""
    monkeypatch.setattr(streaming_copy, "_CODE", bytes.fromhex("c3"))
    if not X86_LINUX:
        pytest.skip("the routine is loaded on x86-64 Linux only")
    with caplog.at_level("WARNING"):
        assert streaming_copy._load() is None
    assert "test copy came out wrong" in caplog.text


def test_switched_off_by_the_environment_copies_with_memmove():
    code = ("import ctypes\n"
            "from ckpt._shared import streaming_copy as s\n"
            "src = (ctypes.c_ubyte * 10000)(*(i % 251 for i in range(10000)))\n"
            "dst = (ctypes.c_ubyte * 10000)()\n"
            "s.copy(ctypes.addressof(dst), ctypes.addressof(src), 10000)\n"
            "assert bytes(dst) == bytes(src)\n"
            "print(s.native())\n")
    env = dict(os.environ, CKPT_STREAMING_COPY="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_read_view_is_the_memory_at_the_address():
    buf = (ctypes.c_ubyte * 100)(*range(100))
    view = read_view(ctypes.addressof(buf) + 10, 20)
    assert bytes(view) == bytes(range(10, 30))
    assert view.readonly
