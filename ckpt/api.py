"""One-shot save and load of a single checkpoint directory, without a manager."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
import time
from typing import Any, MutableMapping, overload

import torch

from storage_backends import PosixStorage, Storage, open_storage

from ckpt._format.names import MANIFEST_NAME, step_dir
from ckpt._interop.detect import is_dcp, is_hf, is_step_dir
from ckpt._load.levels import Gate, verify_level
from ckpt._load.reader import load_step
from ckpt._load.as_saved import MapLocation, read_structure
from ckpt._save.handle import SaveHandle, SaveResult
from ckpt._save.snapshot import snapshot
from ckpt._save.staging import Stager
from ckpt._save.writer import BackgroundWriter
from ckpt._shared.distributed import Group
from ckpt._step.integrity import read_manifest
from ckpt._step.listing import committed_steps
from ckpt.errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                         StateMismatchError)
from ckpt.options import SaveOptions

log = logging.getLogger("ckpt")

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
def load(path: str | os.PathLike, *, step: int | None = None, map_location: MapLocation = None,
         allow_pickle: bool = False, verify: bool | str = True,
         storage_options: dict | None = None) -> dict[str, Any]: ...
@overload
def load(state: MutableMapping[str, Any], path: str | os.PathLike, *, step: int | None = None,
         allow_pickle: bool = False, verify: bool | str = True, atomic: bool = True,
         storage_options: dict | None = None) -> int: ...


def load(state: Any, path: Any = None, *, step: int | None = None, allow_pickle: bool = False,
         verify: bool | str = True, atomic: bool = True, map_location: MapLocation = None,
         storage_options: dict | None = None) -> Any:
    """Load a checkpoint into ``state`` in place; returns its step.

    ``path`` is one checkpoint directory (written by :func:`save`, or a root's
    ``step-XXXXXXXX``) or a root, as every ``ckpt`` command takes (a directory or an
    object-store URL, ``storage_options`` passed to its backend). From a root it loads the
    newest committed step that passes ``verify``: a step that fails is skipped with a
    warning (``ckpt.load skipping step=N reason=...``) and the one before it tried, as
    :meth:`CheckpointManager.restore` does; ``step=N`` loads that step or raises. Example:
    ``ckpt.load(state, "/ckpt/run1")``, or ``ckpt.load(state, "/ckpt/run1", step=500)``.

    ``path`` may also be a PyTorch DCP checkpoint directory (``.metadata`` plus ``.distcp``
    files, from ``torch.distributed.checkpoint.save``, TorchTitan, Megatron ``torch_dist``),
    local or an fsspec URL: each rank reads the byte ranges of the chunks its shards need;
    items map to the checkpoint's top-level keys (see ``docs/guide.md``). It returns the
    step its directory name ends with (``step-1000``), else 0. A local Hugging Face folder
    (``model.safetensors.index.json`` and its shards) initialises the state's modules, plain
    or sharded, each rank reading only its slices (:func:`ckpt.interop.load_hf`); returns 0.

    ``load(path)`` without a state returns the saved structure instead, like ``torch.load``:
    a dict of the saved items, each a tensor, the value its ``state_dict()`` returned, or the
    plain value (tensors on the CPU, or moved with ``map_location``; tied tensors stay one
    object). Example: ``sd = ckpt.load("ckpt/one")["model"]``.

    Under torch.distributed each rank loads the boxes it holds (any world size); from a
    root, ranks skip a step together when it fails on any of them. Every chunk is verified
    before the first live tensor is written: chunks for new tensors are read once, into
    them; chunks for live tensors are streamed through one small buffer per reading thread
    and read again, from the page cache, straight into the tensors (from an object store:
    downloaded once into staging memory within a budget; docs/guide.md says what a load
    reads). ``atomic=False`` reads once, verifying each chunk where it lands: a digest
    mismatch then raises :class:`PartialLoadError`, which names the tensors it overwrote
    (and nothing older is tried).
    ``verify`` is ``"structure"`` (False), ``"digest"`` (True, the default) or ``"forward"``:
    see :meth:`CheckpointManager.restore`; a failed forward check puts the models back.

    Raises:
        CheckpointNotFoundError: ``path`` holds no committed checkpoint (or not ``step``).
        CorruptCheckpointError: the manifest is invalid, a file is missing or truncated, or
            (with ``verify``) a chunk's digest does not match; from a root, every step
            failed (the message lists each step's reason).
        ForwardCheckError: (``verify="forward"``) the probe's rerun failed.
        StateMismatchError: the checkpoint does not fit ``state``; nothing was changed.
        UnsupportedValueError: it holds pickled values and ``allow_pickle`` is False.
        PartialLoadError: reading failed after live tensors were written (``atomic=False``,
            or a file removed between the two reads); the message says which.
        ValueError: ``step=`` given for a single checkpoint directory.
    """
    template_free = path is None
    if template_free:
        if not isinstance(state, (str, os.PathLike)):
            raise TypeError("ckpt.load(path) or ckpt.load(state, path): no path was given")
        state, path = None, state
    elif map_location is not None:
        raise TypeError("map_location= applies to load(path) without a state; a state's "
                        "tensors keep their own devices")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise TypeError(f"step= must be an int, not {step!r}")
    if template_free and verify_level(verify) == "forward":
        raise ValueError('verify="forward" needs the model to run the probe through: use '
                         'ckpt.load(state, path, verify="forward")')
    if state is not None and is_hf(path) and not is_step_dir(path, storage_options):
        return _load_hf(state, path)
    if is_dcp(path, storage_options) and not is_step_dir(path, storage_options):
        return _load_dcp(state, path, step=step, verify=verify, allow_pickle=allow_pickle,
                         storage_options=storage_options)
    storage, names, where = _locate(path, step, storage_options)
    group = Group()
    failed: list[str] = []
    for name, expected in names:
        error = result = None
        try:
            result = _load_step(state, storage, name, expected, where, verify=verify,
                                allow_pickle=allow_pickle, atomic=atomic,
                                map_location=map_location, group=group)
        except CorruptCheckpointError as e:
            if len(names) == 1:
                raise
            error = e
        # From a root: every rank skips a step that failed on any of them.
        if all(group.all_gather(error is None) if group.enabled else [error is None]):
            return result
        error = error or CorruptCheckpointError(f"another rank failed to load step {expected}",
                                                path=where)
        log.warning("ckpt.load skipping step=%s reason=%s", expected, error)
        failed.append(f"step {expected}: {error}")
    raise CorruptCheckpointError(f"no committed step of {where} loads: " + "; ".join(failed),
                                 path=where)


def _load_dcp(state: MutableMapping[str, Any] | None, path: str | os.PathLike, *,
              step: int | None, verify: bool | str, allow_pickle: bool,
              storage_options: dict | None) -> Any:
    """A PyTorch DCP directory (``.metadata`` + ``.distcp`` files): see ckpt._interop."""
    if step is not None:
        raise ValueError(f"step= chooses a step of a root; {os.fspath(path)} is one DCP "
                         "checkpoint: load it without step=")
    if verify_level(verify) == "forward":
        raise ValueError('verify="forward" is for ckpt steps; a DCP checkpoint is loaded '
                         "with its structure and file sizes checked (it has no digests)")
    from ckpt._interop import dcp_load as _dcp_load  # torch's DCP modules, imported on use

    if state is None:
        return _dcp_load.read_all(path, allow_pickle=allow_pickle,
                                  storage_options=storage_options)
    return _dcp_load.load_into(state, path, allow_pickle=allow_pickle,
                               storage_options=storage_options)


def _load_hf(state: MutableMapping[str, Any], path: str | os.PathLike) -> int:
    """A Hugging Face folder of safetensors shards into the state's modules: see
    ckpt._interop.hf_in."""
    from ckpt._interop.hf_in import load_hf

    others = [k for k, v in state.items() if not isinstance(v, torch.nn.Module)]
    if others:
        raise StateMismatchError(f"{os.fspath(path)} is a Hugging Face folder: it holds a "
                                 f"model's weights only, not {others}", path=os.fspath(path))
    for module in state.values():
        load_hf(module, path)
    return 0


def _locate(path: str | os.PathLike, step: int | None, storage_options: dict | None
            ) -> tuple[Storage, list[tuple[str, int | None]], str]:
    """The storage, the checkpoint directories to try in order (with the step each must
    hold) and the name to report, for a checkpoint directory or a root."""
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        storage = open_storage(text, create=False, storage_options=storage_options)
        single = storage.exists(MANIFEST_NAME)
        if single:
            parent, _, name = text.rstrip("/").rpartition("/")
            storage = open_storage(parent, create=False, storage_options=storage_options)
    else:
        full = os.path.realpath(text.removeprefix("file://"))  # a link named is followed
        single = not os.path.isdir(full) or os.path.isfile(os.path.join(full, MANIFEST_NAME))
        parent, name = os.path.split(full)
        storage = PosixStorage(parent if single else full, create=False)
    if single:
        if step is not None:
            raise ValueError(f"step= chooses a step of a root; {text} is one checkpoint "
                             "directory: load it without step=")
        return storage, [(name, None)], text
    steps = committed_steps(storage)
    if step is not None:
        if step not in steps:
            raise CheckpointNotFoundError(f"{text} has no committed step {step} (committed: "
                                          f"{_listed(steps)})", path=text)
        return storage, [(step_dir(step), step)], text
    if not steps:
        raise CheckpointNotFoundError(f"{text} holds no committed checkpoint (neither a "
                                      f"{MANIFEST_NAME} nor a committed step directory)",
                                      path=text)
    return storage, [(step_dir(s), s) for s in reversed(steps)], text


def _listed(steps: list[int]) -> str:
    if not steps:
        return "none"
    return ", ".join(map(str, steps[-10:])) + (" and older" if len(steps) > 10 else "")


def _load_step(state: MutableMapping[str, Any] | None, storage: Storage, name: str,
               step: int | None, where: str, *, verify: bool | str, allow_pickle: bool,
               atomic: bool, map_location: MapLocation, group: Group) -> Any:
    """Load one checkpoint directory: into ``state`` (returns its step) or, without a state,
    as saved (returns the items)."""
    gate = Gate(verify_level(verify), {} if state is None else state)
    manifest = read_manifest(storage, name, step)
    with cf.ThreadPoolExecutor(SaveOptions().write_threads) as pool, gate:
        if state is None:
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
        error = gate.check(None, manifest, group, f"{where}/{name}" if step is not None
                           else where)
        if error is not None:
            raise error
    return manifest.step
