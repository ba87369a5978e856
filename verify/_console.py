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

from .lightning_file import LightningFile, describe_foreign, locate, sibling_root
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


def open_path(path: str, *, files: bool = True) -> Checkpoints:
    """:func:`ckpt.inspect.open`, following a framework integration's pointer (Lightning's
    ``last.ckpt``, HF's ``checkpoint-N/``, Accelerate's ``checkpoint_N/``) to its step.
    ``files``: a Lightning ``.ckpt`` opens its step, another file is a UsageError saying
    what it is (False: a file is refused as not a directory, for ``gc``)."""
    return open_target(path, files=files)[0]


def open_target(path: str, *, files: bool = True) -> tuple[Checkpoints, LightningFile | None]:
    """:func:`open_path`, and the Lightning ``.ckpt`` file ``path`` names, if it does (then
    the checkpoints are its step's, in the folder's hidden sibling root)."""
    if not path.strip():  # an unset shell variable: never the current directory by accident
        raise UsageError("PATH is empty: give a checkpoint root or directory")
    if "://" in path:
        return inspect.open(path), None
    if files and os.path.isdir(path):
        sibling = sibling_of(path)
        if sibling is not None:
            echo(f"ckpt: {path} is a Lightning or HF folder: reading its steps in {sibling}",
                 file=sys.stderr)
            return inspect.open(sibling), None
    found = locate(path) if files and not os.path.isdir(path) else None
    if found is not None:
        return _open_step(path, found.root, found.step, "is the .ckpt file of step"), found
    step = read_pointer(os.path.join(path, POINTER_NAME) if os.path.isdir(path) else path)
    if step is None:
        if files and os.path.lexists(path) and not os.path.isdir(path):
            raise UsageError(f"{path} {describe_foreign(path)}")
        return inspect.open(path), None
    root = os.path.dirname(os.path.abspath(path))
    sibling = os.path.join(os.path.dirname(root), f".{os.path.basename(root)}.ckpt")
    if not os.path.isdir(os.path.join(root, step_dir(step))) and os.path.isdir(sibling):
        root = sibling  # Lightning's plugin keeps the folder's steps in its hidden sibling
    return _open_step(path, root, step, "points to step"), None


def sibling_of(folder: str) -> str | None:
    """The hidden sibling root ``.<name>.ckpt`` that holds the steps of ``folder``, a
    framework's checkpoint folder (Lightning's ``ckpts/``, HF's ``out/``) holding no steps
    or pointer itself; None otherwise."""
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    if POINTER_NAME in names or "manifest.json" in names or any(
            n.startswith("step-") for n in names):
        return None  # a pointer, a checkpoint directory or a root itself
    sibling = sibling_root(folder)
    return sibling if os.path.isdir(sibling) and not os.path.islink(sibling) else None


def _open_step(path: str, root: str, step: int, relation: str) -> Checkpoints:
    target = os.path.join(root, step_dir(step))
    if not os.path.isdir(target):
        # A .ckpt is renamed into place only once its step committed; a pointer before.
        why = ("its step was removed after the file was written, or the file was copied "
               "from another folder" if relation.startswith("is the .ckpt") else
               "its save never finished, or it was retired")
        raise CheckpointNotFoundError(
            f"{path} {relation} {step} of {root}, which is not committed ({why}; or the "
            f"folder was moved without {root}); `ckpt ls {root}` lists the steps there",
            path=path)
    echo(f"ckpt: {path} {relation} {step}: reading {target}", file=sys.stderr)
    return inspect.open(target)
