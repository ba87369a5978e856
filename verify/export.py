"""``ckpt export``: one step as a single consolidated file of full tensors, whatever world
size saved it, in safetensors or torch format.

Keys are the checkpoint's tensor keys (``model/embed.weight``), or with ``item`` the names
inside that item (``embed.weight``: a module's state_dict names, loadable with
``load_state_dict``). Every chunk read is checked against its digest.

Aliases (tied weights: two names, one storage) are resolved. safetensors refuses tensors
that share storage, so there each is stored once, under its stored name, and the alias is
recorded in the header's metadata as ``ckpt_aliases`` (a JSON object alias -> stored name).
The torch format holds both names, sharing one tensor (``torch.save`` keeps the sharing).

The safetensors file is written tensor by tensor (memory: the largest tensor); the torch
format goes through ``torch.save`` of a plain dict, so the whole step is in memory once.
Both are written to a temporary file next to the target and renamed into place.

Threat model: another local user who can write the target's folder (a shared output
folder) plants an entry where the temporary file will be, to block the export or to have
it write through a link. The temporary file gets an unguessable name and is created
exclusively, never through a link (:func:`ckpt.tools.create_beside`); the rename replaces
a link at the target, never follows it.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch

import ckpt
from ckpt.inspect import (SAFETENSORS_DTYPES, Checkpoints, Manifest, byte_view, item_tree,
                          tensor_leaves)
from ckpt.tools import create_beside

from .report import UsageError

FORMATS = ("safetensors", "torch")


@dataclass
class ExportResult:
    """What ``export_step`` wrote."""

    path: str
    format: str
    step: int
    tensors: int
    bytes: int
    aliases: dict[str, str] = field(default_factory=dict)
    item: str | None = None
    seconds: float = 0.0


def select(manifest: Manifest, item: str | None = None) -> dict[str, str]:
    """Output name -> tensor key (possibly an alias) of every tensor to export."""
    if item is None:
        return {k: k for k in [*manifest.tensors, *manifest.aliases]}
    saved = manifest.items.get(item)
    if saved is None:
        raise UsageError(f"step {manifest.step} has no item {item!r}; it has "
                         f"{sorted(manifest.items)}")
    if "per_rank" in saved:
        raise UsageError(f"item {item!r} was saved per rank; export it without --item")
    names = tensor_leaves(item_tree(saved))
    if not names:
        raise UsageError(f"item {item!r} holds no tensors")
    if list(names) == [""]:  # a top-level tensor item
        names = {item: names[""]}
    return names


def plan(manifest: Manifest, names: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Split output names into stored ones (name -> stored tensor key) and aliases
    (name -> the stored output name holding the same tensor)."""
    stored: dict[str, str] = {}
    by_key: dict[str, str] = {}
    aliased = []
    for name, key in names.items():
        if key in manifest.aliases:
            aliased.append(name)
        else:
            stored[name], by_key[key] = key, name
    aliases: dict[str, str] = {}
    for name in aliased:
        target = manifest.resolve(names[name])
        if target in by_key:
            aliases[name] = by_key[target]
        else:  # the alias is exported, its target is not: store it under the alias
            stored[name], by_key[target] = target, name
    return stored, aliases


def export_step(source: Checkpoints | ckpt.CheckpointManager, step: int, fmt: str, path: str,
                *, item: str | None = None, force: bool = False,
                threads: int = 4) -> ExportResult:
    """Write ``step`` to ``path`` as one ``fmt`` file. ``source``: checkpoints opened with
    :func:`ckpt.inspect.open` (a root or one checkpoint directory) or an open manager.

    Raises:
        UsageError: unknown format, ``path`` exists (without ``force``), a dtype safetensors
            cannot hold, an unknown ``item``.
        CheckpointNotFoundError: no such step.
        CorruptCheckpointError: the step is damaged (nothing is left at ``path``).
    """
    t0 = time.perf_counter()
    if fmt not in FORMATS:
        raise UsageError(f"format must be one of {FORMATS}, not {fmt!r}")
    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise UsageError(f"{path} is a directory: give the path of the file to write")
    if os.path.lexists(path):
        # --force replaces the file by a rename: never a device, a pipe or a link's target
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise UsageError(f"{path} exists and is not a regular file (a link, a device, a "
                             "pipe): give the path of a new file")
        if not force:
            raise UsageError(f"{path} exists; pass --force to overwrite it")
    if not os.path.isdir(os.path.dirname(path)):
        raise UsageError(f"{os.path.dirname(path)} is not a directory")
    cps = source if isinstance(source, Checkpoints) else ckpt.inspect.open(source)
    manifest = cps.manifest(step)
    cps.check_structure(step, manifest)
    stored, aliases = plan(manifest, select(manifest, item))
    if fmt == "safetensors":
        check_safetensors(manifest, stored, "; use --to torch")
    nbytes = sum(manifest.tensors[k].nbytes for k in stored.values())
    try:  # mode 0o666 less the umask, as open() creates a file
        fd, tmp = create_beside(path, 0o666, umask=True)
    except OSError as e:
        raise cannot_write(path, e) from e
    try:
        with os.fdopen(fd, "wb") as f, cf.ThreadPoolExecutor(threads) as pool:
            def read(key: str) -> torch.Tensor:
                return cps.read_tensor(step, key, manifest, pool)

            if fmt == "safetensors":
                metadata = {"format": "pt", "ckpt_step": str(step), "ckpt_root": cps.url,
                            "ckpt_aliases": json.dumps(aliases, sort_keys=True)}
                _write_safetensors(f, manifest, stored, metadata, read)
            else:
                tensors = {name: read(key) for name, key in sorted(stored.items())}
                tensors.update({name: tensors[target] for name, target in aliases.items()})
                torch.save(tensors, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return ExportResult(path, fmt, step, len(stored) + len(aliases), nbytes, aliases, item,
                        time.perf_counter() - t0)


def check_safetensors(manifest: Manifest, stored: dict[str, str], advice: str = "") -> None:
    """Raise UsageError unless safetensors can hold these tensors: their dtypes, and their
    names (``__metadata__`` is the header's own entry: a tensor of that name, which a state
    dict may hold, made an export that no safetensors reader could open)."""
    bad = {n: manifest.tensors[k].dtype for n, k in stored.items()
           if manifest.tensors[k].torch_dtype not in SAFETENSORS_DTYPES}
    if bad:
        raise UsageError(f"safetensors cannot hold the dtypes of {bad}{advice}")
    if "__metadata__" in stored:
        raise UsageError("safetensors reserves the name '__metadata__' for its header, and a "
                         f"tensor of step {manifest.step} has that name{advice}")


def cannot_write(path: str, error: OSError) -> UsageError:
    """The target's folder cannot be written (the temporary name next to it is a detail)."""
    return UsageError(f"cannot write {path}: {error.strerror} in {os.path.dirname(path)}; "
                      "choose a folder you can write to")


def _write_safetensors(f: BinaryIO, manifest: Manifest, stored: dict[str, str],
                       metadata: dict[str, str], read: Any) -> None:
    """The safetensors layout: 8-byte little-endian header length, the JSON header (padded
    with spaces to 8 bytes), then each tensor's bytes back to back in header order."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    order = sorted(stored)
    for name in order:
        entry = manifest.tensors[stored[name]]
        header[name] = {"dtype": SAFETENSORS_DTYPES[entry.torch_dtype],
                        "shape": list(entry.shape), "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    f.write(len(body).to_bytes(8, "little"))
    f.write(body)
    for name in order:
        f.write(byte_view(read(stored[name])))
