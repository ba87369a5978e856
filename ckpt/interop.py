"""Checkpoints of other tools, in and out: a PyTorch DCP directory taken in as a ckpt step
(``ckpt import``) and a ckpt step written as a DCP directory (``ckpt export --to dcp``); a
model, whole or sharded, initialised from a Hugging Face folder (:func:`load_hf`, or
``ckpt.load({"model": model}, HF_DIR)``) and a folder taken in as a step
(``ckpt import --from hf``).

Loading a DCP directory straight into a live state is ``ckpt.load(state, DCP_DIR)``.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from typing import Any

from storage_backends.files import mkdir_beside

import ckpt.api
from ckpt._interop.detect import is_dcp, is_step_dir
from ckpt._interop.hf_in import HfLoad, load_hf
from ckpt._manager.manager import CheckpointManager
from ckpt.errors import CheckpointError, CheckpointNotFoundError

__all__ = ["HfLoad", "InteropResult", "export_dcp", "import_dcp", "import_hf", "is_dcp", "load_hf"]


@dataclass
class InteropResult:
    """What an import or an export wrote."""

    source: str
    target: str
    step: int
    tensors: int
    bytes: int
    seconds: float


def import_dcp(source: str | os.PathLike, root: str | os.PathLike, *, step: int | None = None,
               item: str | None = None, allow_pickle: bool = False,
               storage_options: dict | None = None) -> InteropResult:
    """Write the DCP checkpoint ``source`` as step ``step`` of the ckpt root ``root`` (its
    chunks digested, so ``ckpt verify`` and a restore's fallback work from then on).

    ``step`` defaults to the number ``source``'s name ends with (``step-1000``), else 0.
    The step's items are the checkpoint's top-level keys; ``item`` puts them all under one
    item instead (``item="train"`` for ``{"train": ckpt.ModelOptimizer(model, opt)}``).
    Memory: the whole checkpoint, once (run it as one process).

    Raises:
        CheckpointNotFoundError: ``source`` is not a DCP checkpoint directory.
        CorruptCheckpointError: its metadata is invalid or a data file is truncated.
        StepOrderError: ``root`` holds ``step`` or a newer one already.
    """
    from ckpt._interop import dcp_load

    t0 = time.perf_counter()
    src = os.fspath(source)
    if not is_dcp(src, storage_options):
        raise CheckpointNotFoundError(f"{src} is not a DCP checkpoint (no .metadata in it)",
                                      path=src)
    state = dcp_load.read_all(src, allow_pickle=allow_pickle, storage_options=storage_options)
    if step is None:
        step = dcp_load.step_of(src)
    if item is not None:
        state = {item: state}
    tensors = _tensors(state)
    state = {name: _as_item(value) for name, value in state.items()}
    with CheckpointManager(os.fspath(root), async_save=False,
                           storage_options=storage_options) as mgr:
        mgr.save(step, state, force=True, metadata={"imported_from": src, "format": "dcp"})
    return InteropResult(src, os.fspath(root), step, len(tensors),
                         sum(t.numel() * t.element_size() for t in tensors),
                         time.perf_counter() - t0)


def import_hf(source: str | os.PathLike, root: str | os.PathLike, *, step: int = 0,
              item: str = "model", storage_options: dict | None = None) -> InteropResult:
    """Write the Hugging Face folder ``source`` (safetensors shards and their index) as step
    ``step`` of ``root``, its tensors one module item ``item`` named as in the folder (it
    loads into the model with ``ckpt.load({"model": model}, root)``). The output embedding
    ``save_pretrained`` leaves out when tied (``config.json``'s ``tie_word_embeddings``) is
    recorded as an alias of the input embedding. Memory: the whole folder, once."""
    from ckpt._interop.hf_in import read_hf, tied_names

    t0 = time.perf_counter()
    src = os.fspath(source)
    tensors = read_hf(src)
    # a tied name is saved as an alias of its source (the model's state_dict has both)
    named = dict(tensors)
    named.update({name: tensors[source] for name, source in tied_names(src, list(tensors)).items()})
    with CheckpointManager(os.fspath(root), async_save=False,
                           storage_options=storage_options) as mgr:
        mgr.save(step, {item: _as_item(named)}, force=True,
                 metadata={"imported_from": src, "format": "hf"})
    return InteropResult(src, os.fspath(root), step, len(tensors),
                         sum(t.numel() * t.element_size() for t in tensors.values()),
                         time.perf_counter() - t0)


def export_dcp(path: str | os.PathLike, target: str | os.PathLike, *,
               step: int | None = None, item: str | None = None, force: bool = False,
               allow_pickle: bool = False, storage_options: dict | None = None
               ) -> InteropResult:
    """Write a ckpt step (``path``: a root, with ``step`` or its newest good step, or one
    checkpoint directory) as the DCP directory ``target`` of full tensors, which
    ``torch.distributed.checkpoint.load`` reshards onto any world size. Called on every rank
    of a process group (torchrun), each rank writes its share of the tensors into a file of
    its own (``target`` on a file system all ranks see); else one process writes one file.
    ``item`` exports
    that item's contents as the top-level keys (``item="train"`` of a
    ``ckpt.ModelOptimizer`` gives ``{"model": ..., "optim": ...}``, as ``get_state_dict``).

    The directory is written next to ``target`` under a temporary name and renamed into
    place. ``force`` replaces an earlier DCP export (or an empty folder, a file, a link) at
    ``target``, never another folder: one holding anything else (a mistyped ``.``, the
    root being exported, a folder holding it) is a ``FileExistsError`` and stays as it
    was. Memory: the whole step, once (on every rank).
    """
    t0 = time.perf_counter()
    out = os.path.abspath(os.fspath(target))
    if os.path.lexists(out) and not force:
        raise FileExistsError(f"{out} exists; pass force=True (--force) to replace it")
    check_replaceable(out)
    single = is_step_dir(path, storage_options)
    saved = ckpt.api.load(path, step=None if single else step, allow_pickle=allow_pickle,
                          storage_options=storage_options)
    number = _step_number(path, None if single else step, storage_options)
    if item is not None:
        if item not in saved:
            raise CheckpointError(f"the step has no item {item!r}; it has {sorted(saved)}")
        saved = saved[item]
        if not isinstance(saved, dict):
            saved = {item: saved}
    tensors = _tensors(saved)
    _write_dcp(saved, out)
    return InteropResult(os.fspath(path), out, number, len(tensors),
                         sum(t.numel() * t.element_size() for t in tensors),
                         time.perf_counter() - t0)


class _Saved:
    """A state dict saved as a stateful item: it loads into whatever ``load_state_dict``
    takes it (an optimizer by parameter name, a ``ckpt.ModelOptimizer``)."""

    def __init__(self, sd: dict) -> None:
        self.sd = sd

    def state_dict(self) -> dict:
        return self.sd

    def load_state_dict(self, sd: dict) -> None:  # never called: import only saves
        self.sd = sd


def _as_item(value: Any) -> Any:
    """How a DCP top-level value is saved: a flat dict of tensors (a model's state dict) as
    a module item, so it loads into an ``nn.Module``; another dict as a stateful item;
    tensors and plain values as they are."""
    import torch

    if not isinstance(value, dict):
        return value
    if value and all(isinstance(v, torch.Tensor) for v in value.values()):
        module = torch.nn.Module()
        module.state_dict = lambda *args, keep_vars=False, **kwargs: value  # type: ignore
        return module
    return _Saved(value)


def _write_dcp(saved: dict, out: str) -> None:
    """``dcp.save`` under a temporary name, then renamed to ``out``. Under a process group
    every rank calls it with the same ``saved`` and ``out`` (a file system they all see):
    DCP writes each tensor once, spread over the ranks' files, and rank 0 renames."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    group = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if group else 0
    tmp, failed = None, None
    if rank == 0:
        # An unguessable name, and mkdir creates it or fails (a planted link included): no
        # other user of the folder can block the export or have DCP write through a link.
        try:
            tmp = mkdir_beside(out)
        except OSError as e:
            if not group:
                raise
            failed = f"{type(e).__name__}: {e}"
    if group:  # every rank writes its files into rank 0's folder, or learns it failed
        shared = [tmp, failed]
        dist.broadcast_object_list(shared, src=0)
        tmp, failed = shared
        if tmp is None:
            raise OSError(f"rank 0 could not make the export's folder beside {out}: {failed}")
    error: BaseException | None = None
    try:
        with warnings.catch_warnings():  # one process is the intent, not a guess
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.save(saved, checkpoint_id=tmp, no_dist=not group)  # errors gathered by DCP
        if group:
            dist.barrier()  # every rank's files are written before the rename
        if rank == 0:
            try:
                if os.path.lexists(out):
                    if os.path.isdir(out) and not os.path.islink(out):
                        check_replaceable(out)  # again: it may have changed meanwhile
                        shutil.rmtree(out)
                    else:
                        os.unlink(out)
                os.replace(tmp, out)
            except OSError as e:
                error = e
        if group:  # the other ranks learn whether rank 0's rename worked
            outcome = [None if error is None else f"{type(error).__name__}: {error}"]
            dist.broadcast_object_list(outcome, src=0)
            if outcome[0] is not None and error is None:
                raise OSError(f"rank 0 could not move the export into {out}: {outcome[0]}")
        if error is not None:
            raise error
    finally:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)


# What a DCP export holds: its metadata and one data file per rank and writer.
_DCP_FILE = re.compile(r"^(\.metadata|__\d+_\d+\.distcp)$")


def check_replaceable(target: str) -> None:
    """Raise ``FileExistsError`` unless ``target`` may be replaced by an export: missing, a
    file or a link (replaced, never followed), an empty folder or an earlier DCP export
    (its ``.metadata`` and ``__R_W.distcp`` files only), which is deleted first."""
    if os.path.islink(target) or not os.path.isdir(target):
        return
    entries = list(os.scandir(target))
    odd = [e.name for e in entries if not (_DCP_FILE.match(e.name)
                                          and e.is_file(follow_symlinks=False))]
    if entries and (odd or not any(e.name == ".metadata" for e in entries)):
        shown = ", ".join(sorted(odd)[:3]) + (", ..." if len(odd) > 3 else "")
        raise FileExistsError(
            f"{target} is not a DCP export (it holds {shown or 'no .metadata'}): replacing "
            "it would delete it whole; give a new folder")


def _step_number(path: str | os.PathLike, step: int | None, storage_options: dict | None
                 ) -> int:
    if step is not None:
        return step
    from ckpt.inspect import open as open_checkpoints

    return open_checkpoints(os.fspath(path), storage_options=storage_options).steps()[-1]


def _tensors(tree: Any) -> list:
    import torch

    found: list = []
    seen: set[int] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            if id(node) not in seen:
                seen.add(id(node))
                found.append(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return found
