"""Read-only access to checkpoints for tools: the ``ckpt`` command and the ``verify`` package
read checkpoints through this module and nothing deeper.

One call opens a root (``step-XXXXXXXX`` directories), one step directory of a root, or one
checkpoint directory written by :func:`ckpt.save`; each is a set of committed steps::

    cps = ckpt.inspect.open("/ckpt/run1")            # or ".../step-00000500", or "out/ckpt0"
    step = cps.latest_step()
    m = cps.manifest(step)                           # validated before anything in it is used
    w = cps.read_tensor(step, "model/embed.weight")  # every chunk checked against its digest
    cps.check_chunk(step, "model/embed.weight", m.tensors["model/embed.weight"].chunks[0])

Nothing here writes, deletes or takes a lock. Damaged data is reported as
:class:`ckpt.CorruptCheckpointError` naming the file (a zstd frame that fails to decode
too); storage that cannot be opened (a file instead of a directory, an unknown protocol, a
backend library not installed, an unreachable endpoint) as :class:`ckpt.StorageError`; a
missing root or step as :class:`ckpt.CheckpointNotFoundError`.

Also here, for tools that interpret what a step holds: the tree helpers
(:func:`item_tree`, :func:`tensor_leaves`, :func:`plain_values`, :func:`parameter_names`),
the probe's item name, forward, tolerances and sanity check (:data:`PROBE_ITEM`,
:func:`run_forward`, :func:`tolerance_for`, :func:`damaged_probe`, :func:`compared_outputs`,
:func:`sums_outside`) and the
safetensors dtype codes of the data files. They are kept stable with the format version.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import json
import os
from typing import Any, Iterator, MutableMapping

import torch

from storage_backends import Storage, open_storage

from ckpt._format.datafile import SAFETENSORS_DTYPES
from ckpt._shared.buffers import byte_view
from ckpt.errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                     StorageError)
from ckpt._format.bounds import is_decimal
from ckpt._format.entries import Chunk, TensorEntry
from ckpt._format.manifest import Manifest
from ckpt._format.names import MANIFEST_NAME, STEP_DIR, step_dir
from ckpt._load.levels import damaged_probe
from ckpt._step.integrity import check_structure as _check_structure
from ckpt._format.digest import digest
from ckpt._step.headers import header_disagreement
from ckpt._step.integrity import chunk_path, read_manifest
from ckpt._step.listing import committed_steps
from ckpt._step.verified import MarkerState, Verification, read_marker
from ckpt._load.probe import (PROBE_ITEM, TOLERANCES, compared_outputs, run_forward,
                              sums_outside, tolerance_for)
from ckpt._load.reader import load_step
from ckpt._load.chunk_read import read_chunk as _read_chunk
from ckpt._format.tags import BYTES, DICT, FLOAT, NDARRAY, PICKLE, TENSOR, TUPLE
from ckpt._shared.state import item_tree

__all__ = [
    "PROBE_ITEM", "SAFETENSORS_DTYPES", "TOLERANCES", "Checkpoints", "Chunk", "Manifest",
    "MarkerState", "TensorEntry", "Verification", "byte_view", "compared_outputs", "damaged_probe", "digest",
    "header_disagreement",
    "is_tensor_leaf", "item_tree",
    "named_tensors", "open", "parameter_names", "plain_values", "run_forward", "step_dir",
    "sums_outside", "tensor_leaves", "tolerance_for",
]


class Checkpoints:
    """The committed steps of a root, or the one step of a checkpoint directory.

    ``storage`` is the root (for a single directory: the directory holding it, where the
    files of earlier steps an incremental step refers to also live); ``single`` is the
    directory's name under it, None for a root. ``url`` is what was opened.
    """

    def __init__(self, storage: Storage, single: str | None = None) -> None:
        self.storage = storage
        self.single = single
        self.url = f"{storage.url}/{single}" if single else storage.url
        self._single_step: int | None = None

    @property
    def is_root(self) -> bool:
        return self.single is None

    def __repr__(self) -> str:
        return f"ckpt.inspect.Checkpoints({self.url!r})"

    # -- steps and manifests ----------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, oldest first (a single directory: its one step).

        Raises:
            CorruptCheckpointError: a single directory whose manifest is invalid.
            StorageError: the storage cannot be listed.
        """
        if self.single is None:
            try:  # the same discovery as the manager's
                return committed_steps(self.storage)
            except OSError as e:
                raise StorageError(f"listing the steps of {self.url} failed: {e}",
                                   path=self.url) from e
        if self._single_step is None:
            m = STEP_DIR.match(self.single)
            self._single_step = int(m.group(1)) if m else read_manifest(
                self.storage, self.single).step
        return [self._single_step]

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def require(self, step: int) -> None:
        """Raise CheckpointNotFoundError unless ``step`` is committed here."""
        steps = self.steps()
        if step not in steps:
            have = steps if len(steps) <= 8 else [*steps[:3], "...", *steps[-3:]]
            held = f"it has {have}" if steps else "it holds no committed step"
            raise CheckpointNotFoundError(
                f"{self.url} has no committed step {step}; {held} (see `ckpt ls`)",
                path=self.url)

    def location(self, step: int) -> str:
        """Where ``step`` lies, relative to :attr:`storage`."""
        if self.single is None:
            return step_dir(step)
        self.require(step)
        return self.single

    def step_url(self, step: int) -> str:
        return f"{self.storage.url}/{self.location(step)}"

    def manifest(self, step: int) -> Manifest:
        """The validated manifest of ``step``.

        Raises:
            CheckpointNotFoundError: no such committed step.
            CorruptCheckpointError: the manifest is invalid.
        """
        try:
            return read_manifest(self.storage, self.location(step), step)
        except CheckpointError:
            raise
        except OSError as e:
            raise StorageError(f"reading the manifest of step {step} under {self.url} "
                               f"failed: {e}", path=self.url) from e

    def marker(self, step: int) -> MarkerState:
        """Whether ``step`` is verified (``CheckpointManager.mark_verified``): its marker,
        validated against the step's manifest; a marker that is damaged, edited or stale
        is reported in ``problem``, never trusted. A single directory's step is read the
        same way (its marker lies beside its manifest).

        Raises:
            CheckpointNotFoundError: no such committed step.
            StorageError: the storage failed.
        """
        location = self.location(step)
        try:
            return read_marker(self.storage, step, location)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.url} has no committed step {step}",
                                          path=self.url) from None
        except OSError as e:
            raise StorageError(f"reading the verified marker of step {step} under "
                               f"{self.url} failed: {e}", path=self.url) from e

    # -- files --------------------------------------------------------------------------------
    def chunk_path(self, step: int, chunk: Chunk) -> str:
        """The file holding ``chunk``, relative to :attr:`storage` (an incremental step's
        chunk may live in an earlier step's directory)."""
        return chunk_path(self.location(step), chunk)

    def files(self, step: int, manifest: Manifest) -> dict[str, list[tuple[str, Chunk]]]:
        """Every file ``step`` uses (relative to :attr:`storage`) -> (key, chunk) it holds;
        the manifest's own files first, in its order."""
        location = self.location(step)
        out: dict[str, list[tuple[str, Chunk]]] = {f"{location}/{n}": [] for n in manifest.files}
        for key, entry in manifest.tensors.items():
            for chunk in entry.chunks:
                out.setdefault(chunk_path(location, chunk), []).append((key, chunk))
        return out

    def url_of(self, path: str) -> str:
        """The full URL of a path relative to :attr:`storage` (for messages)."""
        return f"{self.storage.url}/{path}"

    def file_size(self, path: str) -> int:
        """Size of the file at ``path`` (relative to :attr:`storage`); FileNotFoundError."""
        return self.storage.size(path)

    def read_bytes(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        """Raw bytes of a file (a data file's safetensors header, say)."""
        return self.storage.read(path, start, length)

    def check_structure(self, step: int, manifest: Manifest) -> None:
        """Every file present with its recorded size and holding its chunks (what a restore
        checks before reading); raises CorruptCheckpointError at the first problem."""
        _check_structure(self.storage, self.location(step), manifest)

    # -- data -----------------------------------------------------------------------------------
    def read_chunk(self, step: int, key: str, chunk: Chunk, out: torch.Tensor) -> None:
        """Fill ``out`` (contiguous, CPU, the chunk's shape and the tensor's dtype) with the
        chunk's data and check its digest.

        Raises:
            CorruptCheckpointError: the chunk cannot be read or decoded, or fails its digest.
            PermissionError: the file cannot be opened (not the checkpoint's fault).
        """
        location = self.location(step)
        try:
            _read_chunk(self.storage, location, key, chunk, out, verify=True)
        except (CheckpointError, PermissionError):
            raise
        except Exception as e:
            # zstandard raises its own error for a damaged frame, and a flipped bit in a
            # frame's content size can make it attempt a huge allocation (MemoryError).
            if chunk.codec == "raw" and not isinstance(e, OSError):
                raise  # not a decoding failure: a bug, show it
            url = self.url_of(chunk_path(location, chunk))
            raise CorruptCheckpointError(
                f"{url}: cannot read {key} at offsets {list(chunk.offsets)} (bytes "
                f"{chunk.start}..{chunk.start + chunk.length}, {chunk.codec}): "
                f"{type(e).__name__}: {e}", path=url) from e

    def check_chunk(self, step: int, key: str, chunk: Chunk, dtype: torch.dtype,
                    buffer: torch.Tensor | None = None) -> None:
        """Read ``chunk`` of tensor ``key`` (of ``dtype``) and check its digest; ``buffer``
        (uint8, at least the chunk's raw size) is reused when given.

        Raises:
            CorruptCheckpointError: as :meth:`read_chunk`.
        """
        nbytes = chunk.numel * dtype.itemsize
        out = None
        if buffer is not None and buffer.numel() >= nbytes:
            try:
                out = buffer[:nbytes].view(dtype)
            except RuntimeError:  # a dtype that cannot view bytes (sub-byte types)
                out = None
        if out is None:
            out = torch.empty(chunk.numel, dtype=dtype)
        self.read_chunk(step, key, chunk, out)

    def read_tensor(self, step: int, key: str, manifest: Manifest | None = None,
                    pool: cf.ThreadPoolExecutor | None = None) -> torch.Tensor:
        """The whole tensor ``key`` (a stored key, not an alias), gathered from every chunk
        whatever world size saved it, each chunk checked against its digest."""
        manifest = manifest if manifest is not None else self.manifest(step)
        entry = manifest.tensors[key]
        out = torch.empty(entry.shape, dtype=entry.torch_dtype)

        def one(chunk: Chunk) -> None:
            if chunk.numel == 0:
                return
            if not entry.shape or all(o == 0 and s == full for o, s, full in
                                      zip(chunk.offsets[1:], chunk.shape[1:], entry.shape[1:])):
                row = chunk.numel // chunk.shape[0] if entry.shape else 0
                start = chunk.offsets[0] * row if entry.shape else 0
                self.read_chunk(step, key, chunk,
                                out.view(-1)[start:start + chunk.numel].view(chunk.shape))
                return
            tmp = torch.empty(chunk.shape, dtype=out.dtype)
            self.read_chunk(step, key, chunk, tmp)
            out[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.shape))] = tmp

        if pool is None:
            for chunk in entry.chunks:
                one(chunk)
        else:
            for future in [pool.submit(one, c) for c in entry.chunks]:
                future.result()
        return out

    def load(self, state: MutableMapping[str, Any], step: int) -> None:
        """Load ``step`` into ``state`` in place, atomically (nothing changes unless every
        chunk passed its digest and the state fits). No pickle.

        Raises:
            StateMismatchError: the step does not fit ``state``.
            CorruptCheckpointError: the step is damaged.
        """
        location = self.location(step)
        manifest = self.manifest(step)
        _check_structure(self.storage, location, manifest)
        load_step(self.storage, location, manifest, state, in_place=False)


def open(path: str | os.PathLike | Storage | Any, *,  # noqa: A001 (reads well as ckpt.inspect.open)
         storage_options: dict | None = None) -> Checkpoints:
    """Open a root, a step directory or a ``ckpt.save`` directory, read-only.

    ``path`` may also be a :class:`storage_backends.Storage` (a root) or an open
    :class:`ckpt.CheckpointManager` (its root). A directory holding a ``manifest.json`` is
    one checkpoint; anything else is a root (possibly still empty).

    Raises:
        CheckpointNotFoundError: nothing exists at ``path``.
        StorageError: ``path`` is a file, or its storage cannot be opened (unknown protocol,
            backend library missing, endpoint unreachable, permission denied).
    """
    storage = getattr(path, "storage", None)
    if isinstance(storage, Storage):  # a CheckpointManager
        return Checkpoints(storage)
    if isinstance(path, Storage):
        return Checkpoints(path)
    text = os.fspath(path)
    local = "://" not in text or text.startswith("file://")
    if local:
        full = os.path.abspath(os.path.expanduser(text.removeprefix("file://")))
        if not os.path.lexists(full):
            raise CheckpointNotFoundError(f"checkpoint root {text} does not exist", path=text)
        if not os.path.isdir(full):
            raise StorageError(f"{text} is not a directory: give a checkpoint root or one "
                               "checkpoint directory", path=text)
        if os.path.isfile(os.path.join(full, MANIFEST_NAME)):
            parent, name = os.path.split(full)
            return Checkpoints(_open(parent, None), name)
        return Checkpoints(_open(full, None))
    storage = _open(text, storage_options)
    try:
        single = storage.exists(MANIFEST_NAME)
    except OSError as e:
        raise StorageError(f"cannot read {text}: {e}", path=text) from e
    if not single:
        return Checkpoints(storage)
    parent, _, name = text.rstrip("/").rpartition("/")
    if "://" not in parent or not parent.split("://", 1)[1]:
        raise StorageError(f"{text} holds a manifest.json at the top of its bucket: open "
                           "the checkpoint directory's parent as a root instead", path=text)
    return Checkpoints(_open(parent, storage_options), name)


def _open(url: str, storage_options: dict | None) -> Storage:
    try:
        storage = open_storage(url, create=False, storage_options=storage_options)
        if "://" in url and not url.startswith("file://") and not storage.exists(""):
            raise CheckpointNotFoundError(f"checkpoint root {url} does not exist", path=url)
        return storage
    except CheckpointError:
        raise
    except ImportError as e:  # fsspec names the package to install (gcsfs, adlfs...)
        raise StorageError(f"cannot open {url}: {e}", path=url) from e
    except (OSError, ValueError) as e:
        raise StorageError(f"cannot open {url}: {type(e).__name__}: {e}", path=url) from e


# -- what a step's item trees hold --------------------------------------------------------------

def is_tensor_leaf(tree: Any) -> bool:
    """Whether a tree node stands for a tensor (its value is the tensor key)."""
    return isinstance(tree, dict) and len(tree) == 1 and (TENSOR in tree or NDARRAY in tree)


def tensor_leaves(tree: Any, path: str = "") -> dict[str, str]:
    """Every tensor in an item's tree: its path inside the item (``embed.weight``,
    ``state/0/exp_avg``) -> its tensor key in the manifest (maybe an alias)."""
    out: dict[str, str] = {}
    for p, node in _walk(tree, path):
        if is_tensor_leaf(node):
            out[p] = next(iter(node.values()))
    return out


def plain_values(tree: Any, path: str = "") -> dict[str, Any]:
    """Every non-tensor leaf of an item's tree (learning rates, step counters, a sampler's
    position, a scaler's scale...): path -> value, tags decoded for reading (tuples as
    lists, non-finite floats as floats, bytes and pickles described)."""
    out: dict[str, Any] = {}
    for p, node in _walk(tree, path):
        if not is_tensor_leaf(node):
            out[p] = _readable(node)
    return out


def _walk(tree: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(path, leaf) pairs of a tree; containers (dicts, lists, tuples) are descended."""
    join = (lambda k: f"{path}/{k}" if path else str(k))  # noqa: E731
    if isinstance(tree, dict) and len(tree) == 1 and TUPLE in tree and isinstance(
            tree[TUPLE], list):
        if not any(isinstance(v, (dict, list)) for v in tree[TUPLE]):
            yield path, tree[TUPLE]  # a tuple of plain values (betas) is one value
            return
        for i, v in enumerate(tree[TUPLE]):
            yield from _walk(v, join(i))
    elif isinstance(tree, dict) and len(tree) == 1 and DICT in tree and isinstance(
            tree[DICT], list):
        for pair in tree[DICT]:
            if isinstance(pair, list) and len(pair) == 2:
                k = pair[0]
                yield from _walk(pair[1], join(k if isinstance(k, (str, int, float, bool))
                                               else json.dumps(k)))
    elif isinstance(tree, dict) and tree and not (len(tree) == 1 and next(iter(tree)) in (
            TENSOR, NDARRAY, FLOAT, BYTES, PICKLE)):
        for k, v in tree.items():
            yield from _walk(v, join(k))
    elif isinstance(tree, list) and tree and any(isinstance(v, (dict, list)) for v in tree):
        for i, v in enumerate(tree):
            yield from _walk(v, join(i))
    else:
        yield path, tree


def _readable(node: Any) -> Any:
    if isinstance(node, dict) and len(node) == 1:
        (tag, body), = node.items()
        if tag == FLOAT and isinstance(body, str):
            try:
                return float(body)
            except ValueError:
                return body
        if tag == BYTES and isinstance(body, str):
            return f"<{len(base64.b64decode(body, validate=False))} bytes>"
        if tag == PICKLE:
            return "<pickled value>"
    return node


def parameter_names(manifest: Manifest) -> dict[str, dict[int, str]]:
    """For each optimizer item whose parameters are those of a module in the same step,
    parameter index -> the module's parameter name (``optim`` -> {0: "embed.weight", ...}).

    An optimizer's state dict numbers its parameters 0..N-1 in the order it was given them,
    which for ``Optimizer(model.parameters())`` is the module's parameter order: its state
    dict's order without buffers and without the second name of a tied weight. A module
    fits when it has exactly N such tensors of floating dtype and every parameter with
    optimizer state has a state tensor of that parameter's shape; when no module, or more
    than one, fits, the optimizer is left out (its state keeps its numbers).
    """
    modules = {}
    for name, item in manifest.items.items():
        if item.get("kind") == "module" and "tree" in item:
            leaves = tensor_leaves(item["tree"])
            seen, params = set(), []
            for pname, key in leaves.items():
                target = manifest.resolve(key)
                entry = manifest.tensors.get(target)
                if entry is None or target in seen or not (
                        entry.torch_dtype.is_floating_point or entry.torch_dtype.is_complex):
                    continue
                seen.add(target)
                params.append((pname, entry.shape))
            modules[name] = params
    out: dict[str, dict[int, str]] = {}
    for name, item in manifest.items.items():
        tree = item.get("tree")
        if item.get("kind") != "stateful" or not _is_optimizer(tree):
            continue
        ids = [i for g in tree["param_groups"] for i in g["params"]]
        if not all(type(i) is int for i in ids):
            continue  # not parameter numbers (a hand-edited or foreign tree)
        shapes = _state_shapes(manifest, tree["state"])
        fits = [m for m, params in modules.items()
                if len(params) == len(ids) and all(
                    shapes.get(i) in (None, params[n][1]) for n, i in enumerate(ids))]
        if len(fits) == 1:
            params = modules[fits[0]]
            out[name] = {i: params[n][0] for n, i in enumerate(ids)}
    return out


def _is_optimizer(tree: Any) -> bool:
    return (isinstance(tree, dict) and isinstance(tree.get("param_groups"), list)
            and "state" in tree and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                        for g in tree["param_groups"]))


def _state_shapes(manifest: Manifest, state: Any) -> dict[int, tuple[int, ...] | None]:
    """Parameter index -> the shape of its non-scalar state tensors (exp_avg, momentum...);
    None when it has only scalars (a ``step`` counter)."""
    out: dict[int, tuple[int, ...] | None] = {}
    for pid, body in _int_keyed(state).items():
        shape = None
        for key in tensor_leaves(body).values():
            entry = manifest.tensors.get(manifest.resolve(key))
            if entry is not None and entry.shape:
                shape = entry.shape
        out[pid] = shape
    return out


def _int_keyed(tree: Any) -> dict[int, Any]:
    """A dict with integer keys (saved under the DICT tag) as a Python dict."""
    if isinstance(tree, dict) and len(tree) == 1 and DICT in tree and isinstance(
            tree[DICT], list):
        return {k: v for k, v in (p for p in tree[DICT] if isinstance(p, list) and len(p) == 2)
                if isinstance(k, int)}
    if isinstance(tree, dict):
        return {int(k): v for k, v in tree.items() if is_decimal(k)}
    return {}


def named_tensors(manifest: Manifest) -> dict[str, str]:
    """Tensor key -> a readable name, for the optimizer state tensors that
    :func:`parameter_names` can name: ``optim/state/3/exp_avg`` -> ``optim/state/mix.weight/
    exp_avg``. Other keys are not listed."""
    out: dict[str, str] = {}
    for name, names in parameter_names(manifest).items():
        state = manifest.items[name]["tree"]["state"]
        for pid, body in _int_keyed(state).items():
            if pid in names:
                out.update({key: path for path, key in
                            tensor_leaves(body, f"{name}/state/{names[pid]}").items()})
    return out
