"""Loading a DCP checkpoint into a live state (any world size, any layout) or, without a
state, as full tensors.

A state's items map to the checkpoint's top-level keys by name, as ``dcp.save`` of a dict
of state dicts writes them (``{"model": ..., "optim": ...}``):

- a module: ``get_model_state_dict`` / ``set_model_state_dict`` (DTensor shards for FSDP2);
- an optimizer: ``get_optimizer_state_dict`` of the one module in the state whose
  parameters it holds (state by parameter name, as DCP's ``get_state_dict`` writes it);
- anything with ``state_dict``/``load_state_dict`` (:class:`ckpt.ModelOptimizer` too);
- a tensor (loaded in place) or a dict of tensors and values.

An item whose name is not a key of the checkpoint is looked for one level up: its state
dict's own keys at the top (TorchTitan saves the model's parameters there;
``{"train": ckpt.ModelOptimizer(model, opt)}`` finds ``model`` and ``optim``).
"""

from __future__ import annotations

import logging
import math
import os
import re
import warnings
from typing import Any, Callable, MutableMapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ckpt.errors import CheckpointError, CorruptCheckpointError, StateMismatchError

from .dcp_read import SafeLoadPlanner, open_reader

log = logging.getLogger("ckpt")


def load_into(state: MutableMapping[str, Any], path: str | os.PathLike, *,
              allow_pickle: bool = False, storage_options: dict | None = None) -> int:
    """Load the DCP checkpoint at ``path`` into ``state`` in place; returns the step its
    directory name carries (``step-1000`` -> 1000; else 0)."""
    where = os.fspath(path)
    reader = open_reader(where, storage_options)
    metadata = reader.read_metadata()
    target, finish = _targets(state, metadata, where)
    missing = sorted(set(flatten_state_dict(target)[0]) - set(metadata.state_dict_metadata))
    if missing:
        raise StateMismatchError(
            f"{where} (DCP) has no {_few(missing)}; it holds "
            f"{_few(sorted(metadata.state_dict_metadata))}. Name the state's items after the "
            "checkpoint's top-level keys", path=where)
    _run_load(target, reader, allow_pickle, where)
    for done in finish:
        done()
    total = sum(info.length for info in metadata.storage_data.values())
    log.info("ckpt.load DCP %s: read %d of its %d data bytes", where, reader.bytes_read, total)
    return step_of(where)


def step_of(path: str) -> int:
    """The step a DCP directory's name carries (TorchTitan's ``step-1000``), else 0."""
    match = re.search(r"(\d+)$", os.path.basename(path.rstrip("/")))
    return int(match.group(1)) if match else 0


def read_all(path: str | os.PathLike, *, allow_pickle: bool = False,
             storage_options: dict | None = None) -> dict[str, Any]:
    """The whole DCP checkpoint as saved: nested dicts/lists of full CPU tensors and values
    (the memory of the whole checkpoint; for ``ckpt import`` and ``ckpt.load(path)``)."""
    where = os.fspath(path)
    reader = open_reader(where, storage_options)
    metadata = reader.read_metadata()
    stored: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        stored[index.fqn] = stored.get(index.fqn, 0) + info.length
    flat: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            # what is allocated is bounded by what the (size-checked) files hold: a
            # metadata file claiming a huge tensor is refused, not allocated
            nbytes = math.prod(entry.size) * entry.properties.dtype.itemsize
            if nbytes > stored.get(fqn, 0):
                raise CorruptCheckpointError(
                    f"{where} (DCP): {fqn} claims {list(entry.size)} ({nbytes} bytes) but its "
                    f"stored chunks hold {stored.get(fqn, 0)} bytes", path=where)
            flat[fqn] = torch.empty(entry.size, dtype=entry.properties.dtype)
        else:
            flat[fqn] = None
    _run_load(flat, reader, allow_pickle, where, no_dist=True)
    mapping = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return unflatten_state_dict(flat, {k: mapping.get(k, (k,)) for k in flat})


def _run_load(target: dict, reader: Any, allow_pickle: bool, where: str,
              no_dist: bool | None = None) -> None:
    if no_dist is None:
        no_dist = not (dist.is_available() and dist.is_initialized())
    try:
        with warnings.catch_warnings():  # one process is what was asked for, not a guess
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(allow_pickle),
                     no_dist=no_dist)
    except CheckpointError:
        raise
    except dcp.api.CheckpointException as e:  # one rank's error, gathered on all
        for failure in e.failures.values():
            cause = failure[0] if isinstance(failure, tuple) else failure  # (error, traceback)
            if isinstance(cause, CheckpointError):
                raise cause from None
        raise CorruptCheckpointError(f"{where} (DCP) does not load: {e}", path=where) from None


def _targets(state: MutableMapping[str, Any], metadata: Metadata, where: str
             ) -> tuple[dict[str, Any], list[Callable[[], None]]]:
    """The dict DCP loads into and what to run afterwards to put it into ``state``."""
    top = {k.split(".", 1)[0] for k in metadata.state_dict_metadata}
    modules = [v for v in state.values() if isinstance(v, torch.nn.Module)]
    target: dict[str, Any] = {}
    finish: list[Callable[[], None]] = []
    for name, value in state.items():
        sd, done = _item(name, value, modules)
        if name in top:
            target[name] = sd
            if done is not None:
                finish.append(lambda done=done, name=name: done(target[name]))
            elif not isinstance(value, torch.Tensor):  # DCP replaced the value in `target`
                finish.append(lambda name=name: state.__setitem__(name, target[name]))
            continue
        if not isinstance(sd, dict) or not sd:
            raise StateMismatchError(f"{where} (DCP) has no key {name!r}; its top-level keys "
                                     f"are {_few(sorted(top))}", path=where)
        clash = sorted(set(sd) & set(target))
        if clash:
            raise StateMismatchError(f"{where} (DCP): item {name!r} and another item both "
                                     f"want the checkpoint's {_few(clash)}", path=where)
        target.update(sd)  # the item's keys sit at the checkpoint's top level

        def lifted(sd: dict = sd, done: Any = done) -> None:
            sd.update({k: target[k] for k in sd})
            if done is not None:
                done(sd)
        finish.append(lifted)
    return target, finish


def _item(name: str, value: Any, modules: list[torch.nn.Module]
          ) -> tuple[Any, Callable[[Any], None] | None]:
    """The state dict DCP fills for one item, and how it goes back into the item."""
    from torch.distributed.checkpoint import state_dict as sdm

    if isinstance(value, torch.nn.Module):
        return (sdm.get_model_state_dict(value),
                lambda sd: sdm.set_model_state_dict(value, sd))
    if isinstance(value, torch.optim.Optimizer):
        model = _owner(name, value, modules)
        return (sdm.get_optimizer_state_dict(model, value),
                lambda sd: sdm.set_optimizer_state_dict(model, value, sd))
    if isinstance(value, torch.Tensor) or not hasattr(value, "load_state_dict"):
        return value, None  # DCP loads tensors in place and replaces values in dicts
    return value.state_dict(), value.load_state_dict


def _owner(name: str, optimizer: torch.optim.Optimizer,
           modules: list[torch.nn.Module]) -> torch.nn.Module:
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    owners = [m for m in modules if held <= {id(p) for p in m.parameters()}]
    if len(owners) != 1:
        raise StateMismatchError(
            f"optimizer {name!r}: DCP stores its state by parameter name, and "
            f"{'no' if not owners else 'more than one'} module of the state holds its "
            "parameters; pass {'train': ckpt.ModelOptimizer(model, optimizer)} instead")
    return owners[0]


def _few(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
