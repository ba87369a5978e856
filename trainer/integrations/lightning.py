"""PyTorch Lightning: ``L.Trainer(plugins=[CkptCheckpointIO()])`` writes through ckpt.

Every checkpoint Lightning asks for (``ModelCheckpoint``, ``trainer.save_checkpoint``) is a
``.ckpt`` file of Lightning's own format (``torch.save``: ``torch.load``, ``pl_load`` and
``Model.load_from_checkpoint`` read it), written atomically and durably, and a ckpt step
``step-<global_step>`` (under the root's writer lock) whose manifest records the file's digests
(:mod:`._pl_file`): the bytes are on disk once. The steps of a folder ``ckpts`` live in its
hidden sibling ``.ckpts.ckpt``: ``ckpts`` lists exactly the files Lightning's own IO leaves
there. A second save of the same step with the same contents (the top-k file, then
``last.ckpt``) is a hard link to the first file. Loading checks the file against its step's
digests; a file whose step is corrupt or not in the root falls back, with a warning, to
the newest good step before it (its file). A ``.ckpt`` of Lightning's own IO (no claim) is
loaded with ``torch.load`` as Lightning would, and a pointer of earlier versions through ckpt.

A save returns once its file and step are committed, and leaves no thread or lock behind, as
Lightning's own IO (``trainer.save_checkpoint`` outside ``fit`` included). With
``async_save=True`` it returns once the state is copied to host memory and the write goes on,
holding the lock, until the next save, a load, or ``teardown``.

Under DDP, Lightning saves from rank 0 only: rank 0 writes alone (its own one-rank group),
every rank reads. Paths are local: an fsspec URL (``memory://``, ``s3://``...) is refused with
a ``ValueError`` (use Lightning's own IO there).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import re
from typing import Any, Callable

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

import ckpt
import ckpt.inspect
from ckpt.tools import read_pointer
from verify.lightning_file import sibling_root

from . import _pl_file as plf
from ._hf_folder import FolderWriter, HostCopies
from ._pl_sigterm import DEFAULT_TIMEOUT as DEFAULT_SIGTERM_TIMEOUT
from ._pl_sigterm import SigtermGuard
from ._steps import StepStore, check_own_root, load_newest_good, pickle_allowed, solo_group

log = logging.getLogger("ckpt")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
def root_for(folder: str) -> str:
    """ckpt's root for the checkpoints of ``folder``: its hidden sibling ``.<name>.ckpt`` (a
    folder that already holds steps, as written by earlier versions, is its own root)."""
    folder = os.path.abspath(folder)
    root = sibling_root(folder)
    if root != folder:
        check_own_root(root, f"the checkpoints in {folder}", "point ModelCheckpoint("
                       "dirpath=...) at a folder in a directory only you can write")
    return root


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
    """The steps the files in ``folder`` claim, or its pointers name (links are not
    followed)."""
    named = set()
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return named
    for entry in entries:
        if entry.name.endswith(".ckpt") and entry.is_file(follow_symlinks=False):
            step = plf.claim(entry.path)
            step = read_pointer(entry.path) if step is None else step
            if step is not None:
                named.add(step)
    return named



class _Pickler(pickle.Pickler):
    """Pickles a checkpoint's structure with each tensor replaced by its storage's identity."""

    def __init__(self, buffer: io.BytesIO) -> None:
        super().__init__(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        self.tensors.append(obj)
        return (obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape),
                tuple(obj.stride()), str(obj.dtype), str(obj.device))


def _fingerprint(checkpoint: dict[str, Any]) -> tuple[bytes, list[torch.Tensor]] | None:
    """What tells whether a second save of a step holds what the first did, without reading
    tensor bytes: the structure and every value but the tensors, which must be the same
    storages (kept alive until the next save, so no address is reused meanwhile). None when
    it cannot be taken: the second save is then written in full."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    try:
        pickler.dump(checkpoint)
    except Exception:  # noqa: BLE001 - torch.save reports what it cannot save
        return None
    return buffer.getvalue(), pickler.tensors


class _Saved:
    """The newest save of this plugin: a second save of the same step may link to it."""

    def __init__(self, root: str, step: int, path: str, seen: Any) -> None:
        self.root, self.step, self.path, self.seen = root, step, path, seen
        self.records: list[dict[str, Any]] = []  # the step's file records, filled when written

    def same(self, root: str, step: int, seen: Any) -> bool:
        return (self.root, self.step) == (root, step) and seen is not None \
            and self.seen is not None and seen[0] == self.seen[0]


class CkptCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through a :class:`ckpt.CheckpointManager`.

    Args:
        manager_options: passed to the manager (``async_save=True``, ``metrics``...).
            Saves are synchronous unless ``async_save=True``. The save schedule and retention
            are Lightning's (``ModelCheckpoint``), so ``every_steps``, ``keep_last`` and
            ``keep_every`` are refused. SIGTERM is Lightning's too (``trainer.received_sigterm``,
            ``on_exception``): ``schedule`` defaults to ``ckpt.Schedule(handle_sigterm=False)``.
            With ``handle_sigterm=True``, a SIGTERM while a checkpoint is being written waits
            for it to commit, then exits with 143 (:mod:`._pl_sigterm`).
        sigterm_timeout: with ``handle_sigterm=True``, how long (seconds) a SIGTERM waits
            for a background write before exiting without it.

    Example::

        trainer = L.Trainer(plugins=[CkptCheckpointIO()],
                            callbacks=[ModelCheckpoint(dirpath="ckpts", every_n_train_steps=100,
                                                       save_top_k=2, save_last=True)])
        trainer.fit(model, ckpt_path="last")
    """

    def __init__(self, *, sigterm_timeout: float = DEFAULT_SIGTERM_TIMEOUT,
                 **manager_options: Any) -> None:
        StepStore.check_options(manager_options)
        schedule = manager_options.pop("schedule", None) or ckpt.Schedule(handle_sigterm=False)
        # The plugin's writes run outside the manager's sight (its own thread): SIGTERM is
        # handled here, waiting for the write in flight (_pl_sigterm), not by the manager.
        self._sigterm = SigtermGuard(sigterm_timeout) if schedule.handle_sigterm else None
        self.manager_options = {"async_save": False, **manager_options,
                                "schedule": dataclasses.replace(schedule, handle_sigterm=False)}
        self._store: StepStore | None = None  # with async_save: the store of the write
        self._writer: FolderWriter | None = None  # in flight, and its thread
        self._group: Any = None  # rank 0's one-rank group under DDP, made once
        self._host = HostCopies()  # async_save: host buffers, reused from save to save
        self._last: _Saved | None = None

    # -- running jobs that write under a root ------------------------------------------------
    def _run(self, root: str, job: Callable[[StepStore], None], what: str = "") -> None:
        """Run ``job`` with the root's store: now, then close it (no lock or thread left), or
        with ``async_save`` on a writer thread that holds the store until :meth:`_finish`.
        ``what``: the checkpoint it writes, for the SIGTERM log lines."""
        self._finish()
        if self._group is None:
            self._group = solo_group() or False
        # The plugin's writer thread is the asynchrony: the manager itself saves in it.
        store = StepStore(root, {**self.manager_options, "async_save": False},
                          group=self._group or None)
        if not self.manager_options["async_save"]:
            if self._sigterm is not None:
                self._sigterm.arm(what or root, None)
            try:
                job(store)
            finally:
                try:
                    store.close()
                finally:
                    if self._sigterm is not None:
                        self._sigterm.disarm()  # exits if SIGTERM came meanwhile
            return
        self._store, self._writer = store, FolderWriter()
        # Armed before the write starts: a SIGTERM as soon as it has begun is ours to handle.
        if self._sigterm is not None:
            self._sigterm.arm(what or root, None)
        self._writer.submit(lambda: job(store))
        if self._sigterm is not None:
            self._sigterm.hand_off(self._writer.settle)

    def _queue(self, root: str, job: Callable[[StepStore], None]) -> None:
        """``job`` after the write in flight under ``root`` (without waiting), or now."""
        store = self._store
        if store is not None and store.root == root:
            self._writer.then(lambda: job(store))
        else:
            self._run(root, job)

    def _finish(self) -> None:
        """Finish the asynchronous write in flight (raising its error), release the lock."""
        store, writer = self._store, self._writer
        self._store = self._writer = None
        if store is not None:
            try:
                writer.close()
            finally:
                try:
                    store.close()
                finally:
                    if self._sigterm is not None:
                        self._sigterm.disarm()

    # -- saving ------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any = None) -> None:
        """Write ``checkpoint`` to ``path`` as Lightning does, recorded by step
        ``global_step``; returns once both are committed (with ``async_save=True``: once
        copied to host memory)."""
        if storage_options is not None:
            raise TypeError("CkptCheckpointIO takes no storage_options; pass manager options "
                            "to CkptCheckpointIO(...) instead")
        full = _local(path)
        folder = os.path.dirname(full)
        root = root_for(folder)
        step = int(checkpoint.get("global_step", 0))
        os.makedirs(folder, exist_ok=True)
        seen = _fingerprint(checkpoint)
        last = self._last
        if last is not None and last.same(root, step, seen) and last.path != full:
            # the same state under a second name (top-k and last.ckpt): one file on disk
            self._queue(root, lambda store: self._link(store, last.path, full))
            return
        saved = _Saved(root, step, full, seen)
        if last is not None and (last.root, last.step) == (root, step):
            saved.records = last.records  # the step's other file stays recorded
        if self.manager_options["async_save"]:
            self._finish()  # one write in flight: its host buffers are reused now
            checkpoint = self._host.copy(checkpoint)
            plf.reserve(full, step)
        self._last = None
        self._run(root, lambda store: self._write(store, checkpoint, saved),
                  f"step {step}, {full}")
        self._last = saved

    @staticmethod
    def _write(store: StepStore, checkpoint: dict[str, Any], saved: _Saved) -> None:
        folder = os.path.dirname(saved.path)
        for name in plf.remove_leftovers(folder):  # the store holds the root's lock
            log.info("ckpt: removed %s, the temporary file of a write that died", name)
        tmp, record = plf.write(checkpoint, saved.path, saved.step)
        try:
            records = [r for r in saved.records if r["name"] != record["name"]] + [record]
            # as Lightning's own IO writes over a file: a resume from an older checkpoint
            # saves its steps again
            store.save(saved.step, {"lightning_file": record["name"]},
                       metadata={plf.FILES_KEY: records}, overwrite=True)
            store.mgr.wait()
            plf.publish(tmp, saved.path)  # once its step is committed
            saved.records = records
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        for name in plf.remove_reservations(folder, keep=saved.path):
            log.info("ckpt: removed %s, the place held for the file of a write that died",
                     name)
        store.retire(set(store.mgr.steps()) - _named_steps(folder) - {saved.step})

    @staticmethod
    def _link(store: StepStore, source: str, full: str) -> None:
        plf.link(source, full)
        store.retire(set(store.mgr.steps()) - _named_steps(os.path.dirname(full)))

    # -- loading -----------------------------------------------------------------------------
    def load_checkpoint(self, path: Any, map_location: Any = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint at ``path``, checked against its step's digests (or the newest good
        one before it), read with ``torch.load`` as Lightning's own IO reads it."""
        self._finish()  # a save of this process may still be writing
        full = _same_folder_link(_local(path))
        if map_location is None:  # Lightning's own IO's default: where the tensors were
            map_location = lambda storage, loc: storage  # noqa: E731
        step = plf.claim(full)
        if step is None and read_pointer(full) is not None:
            return self._load_pointer(full, map_location)
        if step is None:
            if not os.path.exists(full):  # Lightning's message, naming the path as given
                raise FileNotFoundError(f"Checkpoint file not found: {path}")
            log.info("ckpt: %s was not written by CkptCheckpointIO; loading it with "
                     "torch.load", full)
            return TorchCheckpointIO().load_checkpoint(full, map_location, weights_only)
        folder = os.path.dirname(full)
        root = root_for(folder)
        if not os.path.isdir(root):
            raise FileNotFoundError(
                f"{full} belongs to step {step} of {root}, which does not exist: the folder was "
                f"moved or copied without its hidden sibling {os.path.basename(root)} (move "
                "that along with it), or the root was deleted")
        with ckpt.CheckpointManager(root, read_only=True, metrics=False,  # no collectives
                                    schedule=ckpt.Schedule(handle_sigterm=False)) as ro:
            candidates = [s for s in ro.steps() if s <= step]
        if step not in candidates and plf.is_reservation(full):
            log.warning("ckpt: %s holds the place of step %d's file, whose write in the "
                        "background did not finish (the run was stopped during it); loading "
                        "the newest step before it", full, step)
        elif step not in candidates:
            # The file is renamed into place only once its step committed: the step went
            # later, or the file came from elsewhere; the root keeps no record of which.
            log.warning("ckpt: %s belongs to step %d, which is not committed under %s (its "
                        "step was removed after the file was written: its folder deleted, "
                        "the root restored from an older copy; or the file was copied from "
                        "another folder); loading the newest step before it", full, step, root)
        failures = []
        for s in reversed(candidates):
            try:
                loaded = self._load_step(root, s, full, folder, map_location, weights_only)
            except (ckpt.CorruptCheckpointError, ckpt.CheckpointNotFoundError) as e:
                loaded = str(e)
            if isinstance(loaded, dict):
                if s != step:
                    log.warning("ckpt: %s (step %d) cannot be loaded; resuming from step %d",
                                full, step, s)
                return loaded
            log.warning("ckpt: skipping step %d under %s: %s", s, root, loaded)
            failures.append(f"step {s}: {loaded}")
        if failures:
            raise ckpt.CorruptCheckpointError(
                f"no checkpoint of {folder} at or before step {step} could be loaded; `ckpt "
                f"verify --all {root}` checks the steps:\n  " + "\n  ".join(failures),
                path=full)
        raise FileNotFoundError(f"{full} belongs to step {step}, but no step at or before it "
                                f"was committed under {root}")

    def _load_step(self, root: str, step: int, full: str, folder: str, map_location: Any,
                   weights_only: bool | None) -> dict[str, Any] | str:
        """Step ``step``'s checkpoint from a file of ``folder`` that claims it and matches
        its digests (``full`` first); what failed when none does."""
        records = ckpt.inspect.open(root).manifest(step).metadata.get(plf.FILES_KEY)
        if records is None:  # a step of an earlier version holds the state itself
            return self._load_pointer_step(root, step, map_location)
        problems, seen = [], set()
        for path in [full, *sorted(e.path for e in os.scandir(folder)
                                   if e.name.endswith(".ckpt") and e.path != full)]:
            if plf.claim(path) != step:
                continue
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:  # checked and read through one descriptor
                inode = os.fstat(fd)[1:3]
                if inode in seen:  # a second name of a file already checked
                    continue
                seen.add(inode)
                problem = plf.problem(f, records, os.path.basename(path))
                if problem is None:
                    f.seek(0)
                    # weights_only as Lightning's caller asks, as its own IO loads: only
                    # a file whose every record matched the step's digests gets here
                    return torch.load(f, map_location=map_location, weights_only=weights_only)
                problems.append(problem)
        return "; ".join(problems) or f"no file in {folder} holds it any more"

    def _load_pointer(self, full: str, map_location: Any) -> dict[str, Any]:
        """A pointer of earlier versions: its step holds the state."""
        step = read_pointer(full)
        root = root_for(os.path.dirname(full))
        found = load_newest_good(root, step, allow_pickle=pickle_allowed(self.manager_options),
                                 map_location=_device(map_location)) \
            if os.path.isdir(root) else None
        if found is None:
            raise FileNotFoundError(f"{full} points at step {step}, but no step at or before "
                                    f"it was committed under {root}")
        return found[1]

    def _load_pointer_step(self, root: str, step: int, map_location: Any) -> dict[str, Any]:
        return ckpt.load(os.path.join(root, ckpt.inspect.step_dir(step)),
                         allow_pickle=pickle_allowed(self.manager_options),
                         map_location=_device(map_location))

    # -- removing ----------------------------------------------------------------------------
    def remove_checkpoint(self, path: Any) -> None:
        """Remove the file (a link itself, never what it names); a step goes once no file
        claims it."""
        full = _local(path)
        if os.path.islink(full):
            os.remove(full)  # save_last="link": the link goes, the file it names stays
            return
        ours = plf.claim(full) is not None or read_pointer(full) is not None
        if not ours:
            if os.path.isfile(full):
                os.remove(full)
            return  # a checkpoint of Lightning's own format, in the same folder
        folder = os.path.dirname(full)
        root = root_for(folder)

        def drop(store: StepStore) -> None:
            if os.path.isfile(full):
                os.remove(full)
            store.retire(set(store.mgr.steps()) - _named_steps(folder))

        if self._store is not None and self._store.root == root:
            # After the write in flight (async_save): Lightning drops the file its new one
            # replaces as soon as the save returns, and until that save commits the dropped
            # file may be the only one a resume can load (save_top_k=1). A failed write
            # keeps it.
            self._queue(root, drop)
            return
        if os.path.isfile(full):
            os.remove(full)
        if set(self._steps(root)) - _named_steps(folder):
            self._run(root, drop)

    @staticmethod
    def _steps(root: str) -> list[int]:
        """The steps committed under ``root``."""
        if not os.path.isdir(root):
            return []
        with ckpt.CheckpointManager(root, read_only=True, metrics=False,
                                    schedule=ckpt.Schedule(handle_sigterm=False)) as ro:
            return ro.steps()

    def teardown(self) -> None:
        """Finish the write in flight (raising its error), delete dropped steps, unlock."""
        self._finish()


def _device(map_location: Any) -> Any:
    """ckpt.load's map_location: a device, or None (a function stays Lightning's)."""
    return map_location if isinstance(map_location, (str, torch.device)) else None


def load_from_checkpoint(cls: type, path: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(path, map_location, **kwargs)``, with the file checked
    against its step's digests first (falling back past a bad one as a resume does).

    ``cls`` is a LightningModule or LightningDataModule class. ``cls.load_from_checkpoint``
    reads the same file, unchecked. Example::

        model = load_from_checkpoint(MyModule, "ckpts/last.ckpt", map_location="cpu")
    """
    full = _same_folder_link(_local(path))
    if plf.claim(full) is None and read_pointer(full) is None:
        return cls.load_from_checkpoint(path, map_location=map_location, **kwargs)
    checkpoint = CkptCheckpointIO().load_checkpoint(path, map_location=map_location,
                                                    weights_only=kwargs.get("weights_only"))
    buffer = io.BytesIO()  # Lightning's loader reads a file object with torch.load
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return cls.load_from_checkpoint(buffer, map_location=map_location, **kwargs)
