"""One-shot save and load of a single checkpoint directory, without a manager."""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from typing import Any, MutableMapping, overload

from storage_backends import PosixStorage

from ckpt._load.levels import Gate, verify_level
from ckpt._load.reader import load_step
from ckpt._load.as_saved import MapLocation, read_structure
from ckpt._save.handle import SaveHandle, SaveResult
from ckpt._save.snapshot import snapshot
from ckpt._save.staging import Stager
from ckpt._save.writer import BackgroundWriter
from ckpt._shared.distributed import Group
from ckpt._step.integrity import read_manifest
from ckpt.errors import CheckpointError
from ckpt.options import SaveOptions


class CheckpointExistsError(CheckpointError, FileExistsError):
    """The target checkpoint directory already exists."""


def _split(path: str | os.PathLike) -> tuple[PosixStorage, str]:
    full = os.path.realpath(os.fspath(path))  # a link the caller names is followed
    parent, name = os.path.split(full)
    if not name:
        raise ValueError(f"{path!r} does not name a checkpoint directory")
    return PosixStorage(parent), name


class _OneShot:
    """The module-level writer behind :func:`async_save` (one save in flight at a time)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._writer: BackgroundWriter | None = None
        self._stager = Stager()
        self._inflight: SaveHandle | None = None

    def submit(self, state: MutableMapping[str, Any], path: str | os.PathLike, *, step: int,
               copy: bool, options: SaveOptions, metadata: dict | None) -> SaveHandle:
        storage, name = _split(path)
        if storage.exists(name):
            raise CheckpointExistsError(
                f"{os.fspath(path)} already exists; remove it or choose another path",
                path=os.fspath(path))
        with self._mutex:
            if self._inflight is not None:
                try:
                    self._inflight.wait()
                except CheckpointError:
                    pass  # that caller owns that error; it was raised through its handle
            group = Group()
            if (self._writer is None or self._writer.options != options
                    or self._writer.group.rank != group.rank
                    or self._writer.group.world_size != group.world_size):
                if self._writer is not None:
                    self._writer.close()
                self._writer = BackgroundWriter(options, group)
            t0 = time.perf_counter()
            payload = snapshot(state, step=step, name=name, group=self._writer.group,
                               stager=self._stager, options=options, copy=copy,
                               metadata=metadata)
            self._inflight = self._writer.submit(storage, payload, time.perf_counter() - t0)
            return self._inflight

    def release(self, handle: SaveHandle) -> None:
        """Drop the host buffers after ``handle``'s save when no save started since (a
        synchronous save keeps no copy of the state; pinned ones for CUDA tensors)."""
        with self._mutex:
            if self._inflight is handle:
                self._inflight = None
                self._stager.release_buffers()


_ONE_SHOT = _OneShot()


def async_save(state: MutableMapping[str, Any], path: str | os.PathLike, *, step: int = 0,
               allow_pickle: bool = False, options: SaveOptions | None = None,
               metadata: dict | None = None) -> SaveHandle:
    """Save ``state`` to the new directory ``path`` in the background.

    Returns once the state is copied to host memory; the handle's ``wait()`` returns the
    :class:`SaveResult` or raises the writer's error. The directory appears complete or not
    at all. The host copy (pinned memory for CUDA tensors) is kept for the next
    ``async_save``, which refills it instead of allocating; :func:`save` frees it.
    """
    options = options or SaveOptions(allow_pickle=allow_pickle)
    return _ONE_SHOT.submit(state, path, step=step, copy=True, options=options, metadata=metadata)


def save(state: MutableMapping[str, Any], path: str | os.PathLike, *, step: int = 0,
         allow_pickle: bool = False, options: SaveOptions | None = None,
         metadata: dict | None = None) -> SaveResult:
    """Save ``state`` to the new directory ``path``; returns when it is committed.

    Raises:
        CheckpointExistsError: ``path`` exists already.
        UnsupportedValueError: a value is neither a tensor nor JSON (and pickle not allowed).
        StorageError: writing failed (nothing is left at ``path``).
    """
    options = options or SaveOptions(allow_pickle=allow_pickle)
    handle = _ONE_SHOT.submit(state, path, step=step, copy=False, options=options,
                              metadata=metadata)
    try:
        return handle.wait()
    finally:
        _ONE_SHOT.release(handle)


@overload
def load(path: str | os.PathLike, *, map_location: MapLocation = None,
         allow_pickle: bool = False, verify: bool | str = True) -> dict[str, Any]: ...
@overload
def load(state: MutableMapping[str, Any], path: str | os.PathLike, *,
         allow_pickle: bool = False, verify: bool | str = True,
         atomic: bool = True) -> int: ...


def load(state: Any, path: Any = None, *, allow_pickle: bool = False,
         verify: bool | str = True, atomic: bool = True,
         map_location: MapLocation = None) -> Any:
    """Load the checkpoint directory ``path`` into ``state`` in place; returns its step.

    ``load(path)`` without a state returns the saved structure instead, like ``torch.load``:
    a dict of the saved items, each a tensor, the value its ``state_dict()`` returned, or the
    plain value (tensors on the CPU, or moved with ``map_location``; tied tensors stay one
    object). Example: ``sd = ckpt.load("ckpt/one")["model"]``.

    Under torch.distributed each rank loads the boxes it holds (any world size). Every
    chunk is verified before the first live tensor is written, streamed through one small
    buffer per reading thread (the extra memory does not grow with the state); the files are
    then read again, from the page cache, straight into the tensors. ``atomic=False`` reads
    once, verifying each chunk where it lands: a digest mismatch then raises
    :class:`PartialLoadError`, which names the tensors it overwrote.
    ``verify`` is ``"structure"`` (False), ``"digest"`` (True, the default) or ``"forward"``:
    see :meth:`CheckpointManager.restore`; a failed forward check puts the models back.

    Raises:
        CheckpointNotFoundError: ``path`` holds no committed checkpoint.
        CorruptCheckpointError: the manifest is invalid, a file is missing or truncated, or
            (with ``verify``) a chunk's digest does not match.
        ForwardCheckError: (``verify="forward"``) the probe's rerun failed.
        StateMismatchError: the checkpoint does not fit ``state``; nothing was changed.
        UnsupportedValueError: it holds pickled values and ``allow_pickle`` is False.
        PartialLoadError: reading failed after live tensors were written (``atomic=False``,
            or a file removed between the two reads); the message says which.
    """
    template_free = path is None
    if template_free:
        if not isinstance(state, (str, os.PathLike)):
            raise TypeError("ckpt.load(path) or ckpt.load(state, path): no path was given")
        state, path = None, state
    elif map_location is not None:
        raise TypeError("map_location= applies to load(path) without a state; a state's "
                        "tensors keep their own devices")
    gate = Gate(verify_level(verify), {} if template_free else state)
    if template_free and gate.forward:
        raise ValueError('verify="forward" needs the model to run the probe through: use '
                         'ckpt.load(state, path, verify="forward")')
    full = os.path.realpath(os.fspath(path))  # a link the caller names is followed
    storage = PosixStorage(os.path.dirname(full), create=False)
    name = os.path.basename(full)
    manifest = read_manifest(storage, name)
    group = Group()
    with cf.ThreadPoolExecutor(SaveOptions().write_threads) as pool, gate:
        if template_free:
            return read_structure(storage, name, manifest, rank=group.rank,
                                  allow_pickle=allow_pickle, verify=gate.digests, pool=pool,
                                  map_location=map_location)
        try:
            load_step(storage, name, manifest, gate.target(manifest), rank=group.rank,
                      allow_pickle=allow_pickle, verify=gate.digests, pool=pool,
                      in_place=not atomic)
        except Exception:
            gate.agree(group, False)  # ranks run the forward check all or none
            raise
        error = gate.check(None, manifest, group, full)
        if error is not None:
            raise error
    return manifest.step
