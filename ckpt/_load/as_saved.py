"""Loading a committed step without a template: the nested structure as it was saved.

What ``torch.load`` gives for a ``torch.save``d dict: each top-level item comes back as the
value its ``state_dict()`` returned (a module's or optimizer's state dict, a scheduler's,
an RNG state), a top-level tensor as a tensor, and plain values as plain values. Tensors are
read into fresh CPU buffers, every chunk checked against its digest, then moved with
``map_location``. Tied tensors (one storage under two names) come back as one tensor object.
A DTensor comes back whole (its global tensor), whatever world size saved it.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any

import torch

from storage_backends import Storage

from ckpt._format.manifest import Manifest
from ckpt._load.read_plan import box_reads, needed_tensors
from ckpt._load.read_run import run_reads
from ckpt._step.headers import check_headers
from ckpt._step.integrity import check_structure
from ckpt._shared.sharding import overlapping, prefetch, source_rank
from ckpt._shared.state import decode, item_tree

MapLocation = str | torch.device | None


def read_structure(storage: Storage, location: str, manifest: Manifest, *, rank: int = 0,
                   allow_pickle: bool = False, verify: bool = True,
                   pool: cf.ThreadPoolExecutor | None = None,
                   map_location: MapLocation = None,
                   skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The step at ``location`` as a dict of its items (see the module docstring).

    Per-rank items (RNG state, :class:`ckpt.PerRank`) give saved rank ``rank``'s value (rank
    ``rank % saved_world`` on another world size). Items named in ``skip`` are left out.

    Raises:
        UnsupportedValueError: the step holds pickled values and ``allow_pickle`` is False
            (checked before any tensor is read).
        CorruptCheckpointError: a chunk is missing, truncated or fails its digest.
    """
    if map_location is not None:  # a device this process cannot use: say so before reading
        try:
            torch.empty(0, device=map_location)
        except (RuntimeError, AssertionError) as e:
            raise ValueError(f"map_location={map_location!r} cannot be used here ({e}); "
                             "nothing was read: pass map_location='cpu' or leave it out "
                             "(tensors come back on the CPU)") from e
    src = source_rank(rank, manifest.world_size)
    trees = {name: item_tree(item, src) for name, item in manifest.items.items()
             if name not in skip}
    needed = needed_tensors(storage, location, manifest, trees, allow_pickle)
    loaded: dict[str, torch.Tensor] = {}
    jobs = []
    whole = [(k, ((0,) * len(manifest.tensors[k].shape), manifest.tensors[k].shape))
             for k in sorted(needed)]
    prefetch(manifest, whole)  # format 2: every table those tensors need, at once
    pairs = [(k, c) for k, box in whole for c, _ in overlapping(manifest.tensors[k], box)]
    check_structure(storage, location, manifest, [c for _, c in pairs])
    check_headers(storage, location, manifest, pairs)
    for key in sorted(needed):
        entry = manifest.tensors[key]
        loaded[key] = torch.empty(entry.shape, dtype=entry.torch_dtype)
        jobs += box_reads(storage, location, manifest, key, loaded[key],
                          ((0,) * len(entry.shape), entry.shape), verify)
    run_reads(jobs, pool)
    if map_location is not None:
        loaded = {k: t.to(map_location) for k, t in loaded.items()}
    for alias, target in manifest.aliases.items():
        if target in loaded:
            loaded[alias] = loaded[target]  # the same object: ties survive the load
    return {name: decode(tree, loaded, allow_pickle=allow_pickle) for name, tree in trees.items()}
