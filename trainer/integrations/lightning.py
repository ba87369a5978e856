"""PyTorch Lightning: ``L.Trainer(plugins=[CkptCheckpointIO()])`` writes through ckpt.

Every checkpoint Lightning asks for (``ModelCheckpoint``, ``trainer.save_checkpoint``) becomes
a ckpt step ``step-<global_step>`` (digested, atomic, under the root's writer lock), and the
``.ckpt`` path itself becomes a small pointer to that step, so ``save_top_k``, ``save_last``
(also ``"link"``) and ``fit(ckpt_path="last")`` keep working. The steps of a folder ``ckpts``
live in its hidden sibling ``.ckpts.ckpt``: ``ckpts`` lists exactly the files Lightning's own
IO leaves there. A top-k file and ``last.ckpt`` of the same step share one step on disk.
Loading a pointer whose step is corrupt or was never committed falls back, with a warning, to
the newest good step before it. A ``.ckpt`` that is not a pointer (written by Lightning's own
IO) is loaded with ``torch.load`` as Lightning would.

A save returns once its step is committed, and leaves no thread or lock behind, as Lightning's
own IO (``trainer.save_checkpoint`` outside ``fit`` included). With ``async_save=True`` it
returns once the state is copied to host memory and the write goes on, holding the lock, until
the next save, a load, or ``teardown`` (the end of ``fit``/``validate``/``test``).

Under DDP, Lightning saves from rank 0 only: rank 0 writes alone (its own one-rank group),
every rank reads. Paths are local: an fsspec URL (``memory://``, ``s3://``...) is refused with
a ``ValueError`` (use Lightning's own IO there).

``torch.load``/``pl_load`` of a pointer raise ``pickle.UnpicklingError`` (it is JSON): load with
:func:`load_from_checkpoint`, ``ckpt.load`` or ``CkptCheckpointIO().load_checkpoint(path)``.
"""

from __future__ import annotations

import io
import logging
import os
import re
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

import ckpt
from ckpt.tools import read_pointer, write_pointer

from ._steps import StepStore, check_own_root, load_newest_good, pickle_allowed, solo_group

log = logging.getLogger("ckpt")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def root_for(folder: str) -> str:
    """ckpt's root for the checkpoints of ``folder``: its hidden sibling ``.<name>.ckpt`` (a
    folder that already holds steps, as written by earlier versions, is its own root)."""
    folder = os.path.abspath(folder)
    parent, name = os.path.split(folder.rstrip(os.sep)) if folder != os.sep else ("/", "")
    sibling = os.path.join(parent, f".{name or 'root'}.ckpt")
    if not os.path.lexists(sibling) and os.path.isdir(folder) and any(
            n.startswith("step-") for n in os.listdir(folder)):
        return folder
    check_own_root(sibling, f"the checkpoints in {folder}", "point ModelCheckpoint(dirpath=...) "
                   "at a folder in a directory only you can write")
    return sibling


def _local(path: Any) -> str:
    """``path`` as an absolute local path; an fsspec URL is refused."""
    text = os.fspath(path)
    if isinstance(text, str) and _URL.match(text) and not text.startswith("file://"):
        raise ValueError(
            f"CkptCheckpointIO writes to local folders only, not {text!r}: point "
            "ModelCheckpoint(dirpath=...) at a local folder, or leave CkptCheckpointIO out to "
            "use Lightning's own IO for this URL")
    if isinstance(text, str) and text.startswith("file://"):
        text = text[len("file://"):]
    return os.path.abspath(text)


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


def _named_steps(folder: str) -> set[int]:
    """The steps the pointers in ``folder`` name (links are not followed)."""
    named = set()
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return named
    for entry in entries:
        if entry.name.endswith(".ckpt") and entry.is_file(follow_symlinks=False):
            step = read_pointer(entry.path)
            if step is not None:
                named.add(step)
    return named


class CkptCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through a :class:`ckpt.CheckpointManager`.

    Args:
        manager_options: passed to the manager (``async_save=True``, ``options=ckpt.
            SaveOptions(compression=..., incremental=..., allow_pickle=...)``, ``metrics``...).
            Saves are synchronous unless ``async_save=True``. The save schedule and retention
            are Lightning's (``ModelCheckpoint``), so ``every_steps``, ``keep_last`` and
            ``keep_every`` are refused. SIGTERM is Lightning's too (``trainer.received_sigterm``,
            ``on_exception``): ``schedule`` defaults to ``ckpt.Schedule(handle_sigterm=False)``.

    Example::

        trainer = L.Trainer(plugins=[CkptCheckpointIO()],
                            callbacks=[ModelCheckpoint(dirpath="ckpts", every_n_train_steps=100,
                                                       save_top_k=2, save_last=True)])
        trainer.fit(model, ckpt_path="last")
    """

    def __init__(self, **manager_options: Any) -> None:
        StepStore.check_options(manager_options)
        self.manager_options = {"schedule": ckpt.Schedule(handle_sigterm=False),
                                "async_save": False, **manager_options}
        self._store: StepStore | None = None  # an asynchronous write in flight
        self._group: Any = None  # rank 0's one-rank group under DDP, made once
        self._last: tuple[str, int, frozenset] | None = None

    def _open(self, root: str) -> StepStore:
        self._finish()
        if self._group is None:
            self._group = solo_group() or False
        return StepStore(root, self.manager_options, group=self._group or None)

    def _finish(self) -> None:
        """Finish the asynchronous write in flight (raising its error), release the lock."""
        if self._store is not None:
            store, self._store = self._store, None
            store.close()

    def _done(self, store: StepStore) -> None:
        """A save or removal is submitted: close the store now, or at the write's end."""
        if self.manager_options["async_save"]:
            self._store = store
        else:
            store.close()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any = None) -> None:
        """Save ``checkpoint`` as step ``global_step`` and point ``path`` at it; returns once
        the step is committed (with ``async_save=True``: once copied to host memory)."""
        if storage_options is not None:
            raise TypeError("CkptCheckpointIO takes no storage_options; pass manager options "
                            "to CkptCheckpointIO(...) instead")
        full = _local(path)
        folder = os.path.dirname(full)
        root = root_for(folder)
        step = int(checkpoint.get("global_step", 0))
        key = (root, step, frozenset(checkpoint))
        os.makedirs(folder, exist_ok=True)
        if key == self._last and step in self._steps(root):
            # the same step under a second name (top-k and last.ckpt): one step on disk
            write_pointer(full, step)
            return
        store = self._open(root)
        try:
            # as Lightning's own IO writes over a file: a resume from an older checkpoint
            # saves its steps again
            store.save(step, dict(checkpoint), overwrite=True)
            self._last = key
            write_pointer(full, step)
            store.retire(set(store.mgr.steps()) - _named_steps(folder) - {step})
        except BaseException:
            store.close()
            raise
        self._done(store)

    def _steps(self, root: str) -> list[int]:
        """The steps committed under ``root`` or being written by this plugin."""
        if self._store is not None and self._store.root == root:
            steps = self._store.mgr.steps()
            return steps + [self._last[1]] if self._last and self._last[0] == root else steps
        if not os.path.isdir(root):
            return []
        with ckpt.CheckpointManager(root, read_only=True, metrics=False,
                                    schedule=ckpt.Schedule(handle_sigterm=False)) as ro:
            return ro.steps()

    def load_checkpoint(self, path: Any, map_location: Any = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint ``path`` points at (or the newest good one before it)."""
        full = _same_folder_link(_local(path))
        step = read_pointer(full)
        if step is None:
            if not os.path.exists(full):  # Lightning's message, naming the path as given
                raise FileNotFoundError(f"Checkpoint file not found: {path}")
            log.info("ckpt: %s is not a ckpt pointer; loading it with torch.load", full)
            return TorchCheckpointIO().load_checkpoint(full, weights_only=weights_only)
        self._finish()  # a save of this process may still be writing that step
        root = root_for(os.path.dirname(full))
        found = load_newest_good(root, step, allow_pickle=pickle_allowed(self.manager_options),
                                 map_location=map_location) if os.path.isdir(root) else None
        if found is None:
            raise FileNotFoundError(f"{full} points at step {step}, but no step at or before "
                                    f"it was committed under {root}")
        loaded_step, checkpoint = found
        if loaded_step != step:
            log.warning("ckpt: %s names step %d, which cannot be loaded; resuming from step %d",
                        full, step, loaded_step)
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the file (a link itself, never what it names); a step goes once no pointer
        names it."""
        full = _local(path)
        if os.path.islink(full):
            os.remove(full)  # save_last="link": the link goes, the file it names stays
            return
        if read_pointer(full) is None:
            if os.path.isfile(full):
                os.remove(full)  # a checkpoint of Lightning's own format, in the same folder
            return
        os.remove(full)
        folder = os.path.dirname(full)
        root = root_for(folder)
        doomed = set(self._steps(root)) - _named_steps(folder)
        if doomed:
            store = self._store if self._store is not None and self._store.root == root \
                else self._open(root)
            store.retire(doomed)
            if store is not self._store:
                self._done(store)

    def teardown(self) -> None:
        """Finish the write in flight (raising its error), delete dropped steps, unlock."""
        self._finish()


def load_from_checkpoint(cls: type, path: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(path, map_location, **kwargs)`` where ``path`` is a pointer
    written by :class:`CkptCheckpointIO` (or a ``.ckpt`` of Lightning's own format).

    ``cls`` is a LightningModule or LightningDataModule class. Example::

        model = load_from_checkpoint(MyModule, "ckpts/last.ckpt", map_location="cpu")
    """
    if read_pointer(_same_folder_link(_local(path))) is None:
        return cls.load_from_checkpoint(path, map_location=map_location, **kwargs)
    checkpoint = CkptCheckpointIO().load_checkpoint(path, map_location=map_location)
    buffer = io.BytesIO()  # Lightning's loader reads a file object with torch.load
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return cls.load_from_checkpoint(buffer, map_location=map_location, **kwargs)
