"""What every ``ckpt`` subcommand shares: printing what a checkpoint holds safely, and
opening the PATH a user gives."""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from ckpt import inspect
from ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckpt.inspect import Checkpoints
from ckpt.tools import POINTER_NAME, read_pointer, step_dir

from .lightning_file import (LightningFile, describe_foreign, is_reservation, locate,
                             sibling_root)
from .report import UsageError

# Control characters (but newline and tab), lone surrogates, zero-width characters and
# bidirectional overrides, as tensor keys, item names and file names read from a checkpoint
# may hold: printed escaped, so a hostile name can neither rewrite the terminal, hide in it,
# nor make the output encoder raise.
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e"
                          "\u2066-\u2069\ufeff\ud800-\udfff]")


class FileStepGoneError(CorruptCheckpointError):
    """A Lightning ``.ckpt`` names a step that its sibling root, which exists, does not
    hold: the file is there but its state is gone, which is damage (status 1), as ``verify
    --all`` reports it. (A missing root is an environment error, status 2.)"""

    def __init__(self, message: str, *, path: str | None = None,
                 found: LightningFile | None = None) -> None:
        super().__init__(message, path=path)
        self.found = found


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
        if os.path.isdir(found.root) and not os.path.isdir(
                os.path.join(found.root, step_dir(found.step))):
            raise FileStepGoneError(gone_step(found, found.root), path=found.path, found=found)
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


def gone_step(found: LightningFile, root: str) -> str:
    """Why the ``.ckpt`` ``found``, whose step ``root`` does not hold, fails its check."""
    if is_reservation(found.path):
        return (f"{os.path.basename(found.path)} holds the place of step {found.step}'s "
                "file, whose write in the background did not finish (the run was stopped "
                "during it): loading it falls back to an earlier step, and the next save "
                "into this folder removes it")
    return (f"{os.path.basename(found.path)} names step {found.step}, which {root} does not "
            "hold: loading the file falls back to an earlier step. Its step was removed after "
            "the file was written (its step folder deleted, the root restored from an older "
            "copy), or the file was copied here from another folder; delete the file, or put "
            "its step back")


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
    if not os.path.isdir(root):  # an environment error (status 2): the root is elsewhere
        raise CheckpointNotFoundError(
            f"{path} {relation} {step} of {root}, which does not exist (the folder was moved "
            f"or copied without it, or it was deleted)", path=path)
    if not os.path.isdir(target):
        # A pointer is written before its step commits (a .ckpt only after: open_target).
        raise CheckpointNotFoundError(
            f"{path} {relation} {step} of {root}, which is not committed (its save never "
            f"finished, or it was retired); `ckpt ls {root}` lists the steps there", path=path)
    echo(f"ckpt: {path} {relation} {step}: reading {target}", file=sys.stderr)
    return inspect.open(target)
