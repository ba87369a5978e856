"""PyTorch Lightning: ``L.Trainer(plugins=[CkptCheckpointIO()])`` writes through ckpt.

Every checkpoint Lightning asks for (``ModelCheckpoint``, ``trainer.save_checkpoint``) becomes
a ckpt step ``step-<global_step>`` in the checkpoint's directory, written in the background
(digested, atomic, under the root's writer lock); the ``.ckpt`` path itself becomes a small
pointer to that step, so ``save_top_k``, ``save_last=True`` and ``fit(ckpt_path="last")``
keep working. A top-k file and ``last.ckpt`` of the same step share one step on disk. Loading
a pointer whose step is corrupt or was never committed falls back, with a warning, to the
newest good step before it. A ``.ckpt`` that is not a pointer (written by Lightning's own
IO) is loaded with ``torch.load`` as Lightning would.

Under DDP, Lightning saves from rank 0 only: rank 0 writes alone (its own one-rank group),
every rank reads.

``MyModule.load_from_checkpoint("ckpts/last.ckpt")`` reads the file with ``torch.load``,
which a pointer is not: use :func:`load_from_checkpoint` (``Trainer.fit/validate/test/
predict(ckpt_path=...)`` read through the plugin and need nothing).
"""

from __future__ import annotations

import io
import logging
import os
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

import ckpt
from ckpt.tools import read_pointer, write_pointer

from ._steps import StepStore, load_newest_good, pickle_allowed

log = logging.getLogger("ckpt")


def _same_folder_link(full: str) -> str:
    """``save_last="link"`` makes ``last.ckpt`` a link to the top-k file beside it: the
    file it names when that is in the same folder (pointers themselves are never links);
    ``full`` otherwise."""
    if not os.path.islink(full):
        return full
    target = os.path.realpath(full)
    if os.path.dirname(target) != os.path.realpath(os.path.dirname(full)):
        return full
    return os.path.join(os.path.dirname(full), os.path.basename(target))


class CkptCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through a :class:`ckpt.CheckpointManager`.

    Args:
        manager_options: passed to the manager (``async_save``, ``options=ckpt.SaveOptions(
            compression=..., incremental=..., allow_pickle=...)``, ``metrics``...). The save
            schedule and retention are Lightning's (``ModelCheckpoint``), so ``every_steps``,
            ``keep_last`` and ``keep_every`` are refused. SIGTERM is Lightning's too
            (``trainer.received_sigterm``, ``on_exception``; its teardown finishes the write
            in flight): ``schedule`` defaults to ``ckpt.Schedule(handle_sigterm=False)`` here.

    Example::

        trainer = L.Trainer(plugins=[CkptCheckpointIO()],
                            callbacks=[ModelCheckpoint(dirpath="ckpts", every_n_train_steps=100,
                                                       save_top_k=2, save_last=True)])
        trainer.fit(model, ckpt_path="last")
    """

    def __init__(self, **manager_options: Any) -> None:
        StepStore.check_options(manager_options)
        self.manager_options = {"schedule": ckpt.Schedule(handle_sigterm=False),
                                **manager_options}
        self._store: StepStore | None = None

    def _open(self, root: str) -> StepStore:
        if self._store is not None and self._store.root != root:
            self._store.close()
            self._store = None
        if self._store is None:
            self._store = StepStore(root, self.manager_options)
        return self._store

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any = None) -> None:
        """Submit ``checkpoint`` as step ``global_step``; returns once it is copied to host
        memory (with ``async_save``, the default), then points ``path`` at it."""
        if storage_options is not None:
            raise TypeError("CkptCheckpointIO takes no storage_options; pass manager options "
                            "to CkptCheckpointIO(...) instead")
        full = os.path.abspath(os.fspath(path))
        store = self._open(os.path.dirname(full))
        step = int(checkpoint.get("global_step", 0))
        store.save(step, dict(checkpoint))
        write_pointer(full, step)
        store.retire(self._orphans(store))

    def load_checkpoint(self, path: Any, map_location: Any = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint ``path`` points at (or the newest good one before it)."""
        full = _same_folder_link(os.path.abspath(os.fspath(path)))
        step = read_pointer(full)
        if step is None:
            if not os.path.exists(full):
                raise FileNotFoundError(f"Checkpoint file not found: {full}")
            log.info("ckpt: %s is not a ckpt pointer; loading it with torch.load", full)
            return TorchCheckpointIO().load_checkpoint(full, weights_only=weights_only)
        if self._store is not None:
            self._store.mgr.wait()  # a save of this process may still be writing that step
        found = load_newest_good(os.path.dirname(full), step,
                                 allow_pickle=pickle_allowed(self.manager_options),
                                 map_location=map_location)
        if found is None:
            raise FileNotFoundError(f"{full} points at step {step}, but no step at or before "
                                    f"it was committed under {os.path.dirname(full)}")
        loaded_step, checkpoint = found
        if loaded_step != step:
            log.warning("ckpt: %s names step %d, which cannot be loaded; resuming from step %d",
                        full, step, loaded_step)
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer; its step goes once no other pointer names it."""
        full = os.path.abspath(os.fspath(path))
        if read_pointer(full) is None:
            if os.path.isfile(full) and not os.path.islink(full):
                os.remove(full)  # a checkpoint of Lightning's own format, in the same folder
            return
        os.remove(full)
        if self._store is not None and self._store.root == os.path.dirname(full):
            self._store.retire(self._orphans(self._store))

    def _orphans(self, store: StepStore) -> set[int]:
        """Committed steps of ``store`` that no pointer in its folder names any more."""
        named = set()
        for entry in os.scandir(store.root):
            if entry.name.endswith(".ckpt") and entry.is_file(follow_symlinks=False):
                step = read_pointer(entry.path)
                if step is not None:
                    named.add(step)
        return set(store.mgr.steps()) - named

    def teardown(self) -> None:
        """Finish the save in flight (raising its error), delete dropped steps, unlock."""
        if self._store is not None:
            store, self._store = self._store, None
            store.close()


def load_from_checkpoint(cls: type, path: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(path, map_location, **kwargs)`` where ``path`` is a pointer
    written by :class:`CkptCheckpointIO` (or a ``.ckpt`` of Lightning's own format).

    ``cls`` is a LightningModule or LightningDataModule class. Example::

        model = load_from_checkpoint(MyModule, "ckpts/last.ckpt", map_location="cpu")
    """
    if read_pointer(_same_folder_link(os.path.abspath(os.fspath(path)))) is None:
        return cls.load_from_checkpoint(path, map_location=map_location, **kwargs)
    checkpoint = CkptCheckpointIO().load_checkpoint(path, map_location=map_location)
    buffer = io.BytesIO()  # Lightning's loader reads a file object with torch.load
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return cls.load_from_checkpoint(buffer, map_location=map_location, **kwargs)
