"""``ckpt export ROOT --to hf DIR``: one step's model as a Hugging Face folder that
``from_pretrained`` loads.

The folder holds ``model-0000N-of-0000M.safetensors`` shards (filled in state_dict order up to
``max_shard_bytes``), ``model.safetensors.index.json`` (``total_size`` and the weight map,
file names only: no absolute path anywhere) and ``config.json`` when the step was saved with
the model's config in its metadata (``trainer.integrations`` save it under ``hf_config``).
Tied weights are written once, under their first name; ``from_pretrained`` ties the others
again (as it does for folders that ``save_pretrained`` wrote). Every chunk read is checked
against its digest. The folder is written next to the target and renamed into place.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field

import torch

import ckpt
import ckpt.inspect
from ckpt.inspect import Checkpoints, Manifest, item_tree, tensor_leaves
from ckpt.tools import mkdir_beside

from .export import _write_safetensors, cannot_write, check_safetensors, plan, select
from .report import UsageError, count, size

CONFIG_KEY = "hf_config"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 10**9  # what save_pretrained uses ("5GB")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30}


@dataclass
class HfExportResult:
    """What :func:`export_hf` wrote: counts that match the folder's files."""

    path: str
    step: int
    item: str
    tensors: int
    bytes: int
    shards: list[str]
    config: bool
    tied: dict[str, str] = field(default_factory=dict)
    format: str = "hf"
    seconds: float = 0.0


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5000000000; plain digits are bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS or int(m.group(1)) < 1:
        raise UsageError(f"{text!r} is not a size (examples: 5GB, 500MB, 1048576)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def _model_item(manifest: Manifest, item: str | None) -> str:
    if item is not None:
        return item
    modules = [n for n, it in manifest.items.items() if it.get("kind") == "module"]
    if "model" in manifest.items:
        return "model"
    if len(modules) == 1:
        return modules[0]
    with_tensors = sorted(n for n, it in manifest.items.items() if "per_rank" not in it
                          and tensor_leaves(item_tree(it)))
    raise UsageError(f"step {manifest.step} has no item 'model' and "
                     f"{count(len(modules), 'module')} "
                     f"({modules}); name the model with --item (items holding tensors: "
                     f"{', '.join(with_tensors) or 'none'}; a Lightning step keeps the "
                     "LightningModule's weights in 'state_dict')")


def export_hf(source: Checkpoints | ckpt.CheckpointManager, step: int, path: str, *,
              item: str | None = None, force: bool = False,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, threads: int = 4) -> HfExportResult:
    """Write ``step``'s model (``item``, default ``"model"``) to the folder ``path``.
    ``source``: checkpoints opened with :func:`ckpt.inspect.open` or an open manager.

    Raises:
        UsageError: ``path`` exists (without ``force``; with it, it must be a folder, whose
            files of the same names are replaced), an unknown item, a dtype safetensors
            cannot hold.
        CorruptCheckpointError: the step is damaged (nothing is left at ``path``).
    """
    t0 = time.perf_counter()
    path = os.path.abspath(path)
    if os.path.lexists(path) and not (force and os.path.isdir(path)
                                      and not os.path.islink(path)):
        raise UsageError(f"{path} exists; pass --force to replace the files of an export there"
                         if not force else f"{path} exists and is not a folder")
    if not os.path.isdir(os.path.dirname(path)):
        raise UsageError(f"{os.path.dirname(path)} is not a directory")
    cps = source if isinstance(source, Checkpoints) else ckpt.inspect.open(source)
    manifest = cps.manifest(step)
    cps.check_structure(step, manifest)
    item = _model_item(manifest, item)
    stored, tied = plan(manifest, select(manifest, item))
    check_safetensors(manifest, stored)
    shards = _shard(manifest, stored, max_shard_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = sum(manifest.tensors[k].nbytes for k in stored.values())
    config = manifest.metadata.get(CONFIG_KEY)
    # An unguessable name, and mkdir creates it or fails (a planted link included): no
    # other user of the folder can block the export or have it write through a link.
    try:
        tmp = mkdir_beside(path)
    except OSError as e:
        raise cannot_write(path, e) from e
    try:
        with cf.ThreadPoolExecutor(threads) as pool:
            def read(key: str) -> torch.Tensor:
                return cps.read_tensor(step, key, manifest, pool)

            for name, shard in zip(names, shards):
                with open(os.path.join(tmp, name), "wb") as f:
                    _write_safetensors(f, manifest, shard, {"format": "pt"}, read)
                    f.flush()
                    os.fsync(f.fileno())
        index = {"metadata": {"total_size": total, "ckpt_step": step, "ckpt_tied": tied},
                 "weight_map": {n: names[i] for i, shard in enumerate(shards) for n in shard}}
        _write_json(os.path.join(tmp, INDEX_NAME), index)
        if isinstance(config, dict):
            _write_json(os.path.join(tmp, "config.json"), config)
        _publish(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with contextlib.suppress(OSError):
        os.rmdir(tmp)  # --force: the folder its files were moved out of
    return HfExportResult(path, step, item, len(stored), total, names, isinstance(config, dict),
                          tied, seconds=time.perf_counter() - t0)


def _shard(manifest: Manifest, stored: dict[str, str], limit: int) -> list[dict[str, str]]:
    """Greedy, in state_dict order: a shard closes when the next tensor would pass ``limit``
    (a tensor larger than ``limit`` gets a shard of its own)."""
    shards: list[dict[str, str]] = [{}]
    filled = 0
    for name, key in stored.items():
        n = manifest.tensors[key].nbytes
        if shards[-1] and filled + n > limit:
            shards.append({})
            filled = 0
        shards[-1][name] = key
        filled += n
    return shards


def _write_json(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _publish(tmp: str, path: str) -> None:
    """Rename the finished folder into place (or, with --force, its files into the folder)."""
    if not os.path.exists(path):
        os.replace(tmp, path)
        return
    for name in os.listdir(tmp):
        os.replace(os.path.join(tmp, name), os.path.join(path, name))


def render_hf_export(e: HfExportResult) -> str:
    """``ckpt export --to hf`` for a terminal."""
    text = (f"wrote {e.path}: step {e.step} ('{e.item}') as a Hugging Face folder, "
            f"{count(e.tensors, 'tensor')} in {count(len(e.shards), 'shard')} ({size(e.bytes)}) "
            f"+ {INDEX_NAME}"
            + (" + config.json" if e.config else
               "; no config.json was saved with this step: copy the model's config.json there")
            + f", in {e.seconds:.2f}s")
    if e.tied:
        text += f"\n{count(len(e.tied), 'tied weight')} written once (from_pretrained ties " \
            "them): " + \
            ", ".join(f"{k} -> {v}" for k, v in sorted(e.tied.items()))
    return text
