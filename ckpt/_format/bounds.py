"""Limits on what a manifest or rank table may claim, and checks of its single values.

Validation raises :class:`Invalid`; the reader that knows the file turns it into a
``CorruptCheckpointError`` naming the file.
"""

from __future__ import annotations

import re
from typing import Any

MAX_MANIFEST_BYTES = 1 << 30
MAX_TABLE_BYTES = 1 << 30
MAX_BYTES = 1 << 50  # 1 PiB: anything larger in a manifest is corruption, not a model
MAX_DIMS = 64
MAX_DEPTH = 200  # nesting of item trees and metadata (restore decodes them recursively)
# zstd's densest frame (RLE blocks: 4 bytes per 128 KiB) expands at most about 32768x; a
# compressed chunk that claims more is corrupt, whatever its frame header says, and must not
# make a reader allocate its claimed size.
MAX_ZSTD_RATIO = 1 << 15
MAX_TILING_CORNERS = 1 << 22  # bound of the tiling check's work (see tiling.check_tiling)

# Patterns end in \Z, not $ (which also matches before a final newline).
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}\Z")
_DIGEST = re.compile(r"[0-9a-f]{16}\Z")


class Invalid(Exception):
    """A value read from a manifest or rank table breaks the format."""


def check(cond: bool, message: str) -> None:
    """Raise Invalid(message) unless ``cond``."""
    if not cond:
        raise Invalid(message)


def bounded_int(value: Any, what: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
    """A validated integer in [lo, hi] (a bool is not one)."""
    if type(value) is int and lo <= value <= hi:
        return value
    raise Invalid(f"{what} must be an integer in [{lo}, {hi}]")


def dims(value: Any, what: str, of: str | None = None) -> tuple[int, ...]:
    """A validated box shape or offsets; messages name ``what`` (``of`` key ``of``), built
    only on failure."""
    if isinstance(value, list) and len(value) <= MAX_DIMS:
        for v in value:  # a loop, not all(<generator>): this runs for every chunk
            if type(v) is not int or not 0 <= v <= MAX_BYTES:
                break
        else:
            return tuple(value)
        raise Invalid(f"{_named(what, of)} must be a list of integers in [0, {MAX_BYTES}]")
    raise Invalid(f"{_named(what, of)} must be a list of at most {MAX_DIMS} ints")


def _named(what: str, of: str | None) -> str:
    return what if of is None else f"{what} of {of!r}"


def file_name(value: Any, what: str = "file") -> str:
    """A validated plain file name: no directories, no '..', bounded length."""
    if isinstance(value, str) and _FILE_NAME.match(value) and ".." not in value:
        return value
    raise Invalid(f"{what} {value!r} is not a plain file name")


def is_digest(value: Any) -> bool:
    """A digest as the format writes it: 16 lowercase hex digits."""
    return isinstance(value, str) and _DIGEST.match(value) is not None


def is_decimal(value: Any) -> bool:
    """A string of ASCII digits, as ckpt writes a number used as a key (a step of ``refs``,
    a rank of ``per_rank``). str.isdigit() also accepts other scripts' digits and
    superscripts, which int() reads as another number or refuses with a ValueError."""
    return isinstance(value, str) and value.isascii() and value.isdigit()
