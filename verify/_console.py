"""What every ``ckpt`` subcommand shares: printing what a checkpoint holds safely, and
opening the PATH a user gives."""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from ckpt import inspect
from ckpt.errors import CheckpointNotFoundError
from ckpt.inspect import Checkpoints
from ckpt.tools import POINTER_NAME, read_pointer, step_dir

from .report import UsageError

# Control characters (but newline and tab), lone surrogates, zero-width characters and
# bidirectional overrides, as tensor keys, item names and file names read from a checkpoint
# may hold: printed escaped, so a hostile name can neither rewrite the terminal, hide in it,
# nor make the output encoder raise.
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e"
                          "\u2066-\u2069\ufeff\ud800-\udfff]")


def echo(text: str, file: Any = None) -> None:
    """print() of text for people or machines, unprintable characters escaped (``\\x1b``)."""
    print(_UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode(), text),
          file=file if file is not None else sys.stdout)


def open_path(path: str) -> Checkpoints:
    """:func:`ckpt.inspect.open`, following a framework integration's pointer (Lightning's
    ``last.ckpt``, HF's ``checkpoint-N/``, Accelerate's ``checkpoint_N/``) to its step."""
    if not path.strip():  # an unset shell variable: never the current directory by accident
        raise UsageError("PATH is empty: give a checkpoint root or directory")
    if "://" in path:
        return inspect.open(path)
    step = read_pointer(os.path.join(path, POINTER_NAME) if os.path.isdir(path) else path)
    if step is None:
        return inspect.open(path)
    root = os.path.dirname(os.path.abspath(path))
    sibling = os.path.join(os.path.dirname(root), f".{os.path.basename(root)}.ckpt")
    if not os.path.isdir(os.path.join(root, step_dir(step))) and os.path.isdir(sibling):
        root = sibling  # Lightning's plugin keeps the folder's steps in its hidden sibling
    target = os.path.join(root, step_dir(step))
    if not os.path.isdir(target):
        raise CheckpointNotFoundError(
            f"{path} points to step {step} of {root}, which is not committed (its save never "
            f"finished, or it was retired); `ckpt ls {root}` lists the steps there", path=path)
    echo(f"ckpt: {path} points to step {step}: reading {target}", file=sys.stderr)
    return inspect.open(target)
