"""What tools built on ckpt use beyond the training API: the ``ckpt`` command (verify/), the
trainer and its framework integrations (trainer/), and a user's own scripts.

Step names and listings of a root, pointer files (the step a framework's checkpoint path
stands for), the best step by a saved metric, the retention policy and the collection of a
root, the collection of memory-tier segments without a live owner, and the bounded metrics
server and link-safe textfile writer the manager exports its metrics with, the bounded HTTP
server it and the live heal server are built on (:class:`BoundedServer`, :class:`DeadlineHandler`), and small files
written and opened safely in directories other users may write to (:func:`atomic_write`,
:func:`create_beside`, :func:`open_regular`), and the exit from a signal handler that a
finalizer cannot swallow (:func:`exit_now`). Reading a step's contents is
:mod:`ckpt.inspect`.
"""

from __future__ import annotations

import os
from typing import Any

from storage_backends import Storage, open_storage
from storage_backends.files import (SpecialFileError, atomic_write, create_beside, fsync_dir,
                                    mkdir_beside, name_beside, open_regular)

from ckpt._format.names import step_dir
from ckpt._manager.metrics import default_labels, serve_metrics, write_textfile
from ckpt._memory.tier import gc_segments
from ckpt._retention.apply import recorded_policy
from ckpt._retention.gc import GcResult, collect_root
from ckpt._retention.policy import KeepBest, RetentionPolicy
from ckpt._retention.policy import METRICS_KEY
from ckpt._shared.bounded_server import BoundedServer, DeadlineHandler
from ckpt._shared.signals import exit_now
from ckpt._step.integrity import read_manifest
from ckpt._step.listing import committed_steps
from ckpt._step.pointer import POINTER_NAME, read_pointer, write_pointer

__all__ = [
    "BoundedServer",
    "DeadlineHandler",
    "GcResult",
    "KeepBest",
    "POINTER_NAME",
    "RetentionPolicy",
    "SpecialFileError",
    "atomic_write",
    "best_step",
    "collect_root",
    "committed_steps",
    "create_beside",
    "default_labels",
    "exit_now",
    "fsync_dir",
    "gc_segments",
    "mkdir_beside",
    "name_beside",
    "open_regular",
    "read_pointer",
    "recorded_policy",
    "serve_metrics",
    "step_dir",
    "write_pointer",
    "write_textfile",
]


def best_step(root: str | os.PathLike | Storage | Any, metric: str, *, mode: str = "min",
              storage_options: dict | None = None) -> int | None:
    """The committed step of ``root`` with the best value of ``metric``, as saved with
    ``mgr.save(step, state, metrics={metric: value})``; None when no step has a finite value.

    ``root`` is a path or URL, a :class:`storage_backends.Storage` or an open
    :class:`ckpt.CheckpointManager` (its root; after an asynchronous save, ``mgr.wait()``
    first). ``mode``: ``"min"`` (lower is better) or ``"max"``. On a tie the newer step
    wins, as for ``RetentionPolicy(keep_best=...)``. Load it with
    ``mgr.restore(state, step=ckpt.tools.best_step(mgr, "val_loss"))``.
    """
    rule = KeepBest(1, metric, mode)  # validates metric and mode
    storage = getattr(root, "storage", root)
    if not isinstance(storage, Storage):
        storage = open_storage(os.fspath(root), create=False, storage_options=storage_options)
    values = {}
    for step in committed_steps(storage):
        saved = read_manifest(storage, step_dir(step), step).metadata.get(METRICS_KEY)
        if isinstance(saved, dict):
            values[step] = saved.get(metric)
    best = rule.select(values)
    return best.pop() if best else None
