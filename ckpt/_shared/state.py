"""Turning user state into named tensors plus a JSON tree, and back.

A state is a mapping of top-level items. Each item is one of:

* ``stateful``: anything with ``state_dict()``/``load_state_dict()`` (modules, optimizers,
  schedulers, samplers, :class:`ckpt.RNGState`); restored through ``load_state_dict``;
* ``tensor``: a top-level tensor, restored by copying into the existing tensor;
* ``value``: plain Python data (JSON-like, possibly holding tensors), replaced in the dict.

Inside an item, tensors become ``{"__tensor__": key}`` leaves and the rest is JSON. Dict keys
that are not strings (an optimizer's integer parameter ids), tuples, non-finite floats and
bytes get small tagged objects (``ckpt._format.tags``) so they come back as the same types.
Anything else is refused unless the caller allowed pickle.
"""

from __future__ import annotations

import base64
from itertools import repeat
import math
import pickle
import warnings
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils.data

from ckpt.errors import StateMismatchError, UnsupportedValueError
from ckpt._format.gcpause import paused_gc
from ckpt._format.tags import BYTES, DICT, FLOAT, NDARRAY, PICKLE, TAGS, TENSOR, TUPLE
from ckpt._shared.sharding import dtensor_type


COMPILED_PREFIX = "_orig_mod"  # torch.compile's wrapper module holds the model under this name


def plain_name(key: str) -> str:
    """A module key without torch.compile's ``_orig_mod`` segments (``_orig_mod.fc.weight``
    and ``fc.weight`` name the same parameter)."""
    if COMPILED_PREFIX not in key:
        return key
    return ".".join(p for p in key.split(".") if p != COMPILED_PREFIX)


def module_state_dict(module: torch.nn.Module, keep_vars: bool = False) -> dict[str, Any]:
    """``module.state_dict()`` under plain names, whether the module (or a submodule) was
    compiled with ``torch.compile`` or not, so compiled and plain models share checkpoints."""
    sd = module.state_dict(keep_vars=keep_vars)
    if not any(COMPILED_PREFIX in k for k in sd):
        return sd
    return type(sd)((plain_name(k), v) for k, v in sd.items())


def load_stateful(obj: Any, value: Any) -> None:
    """``obj.load_state_dict(value)``; a module gets plain names mapped back to its own
    (``_orig_mod.`` names when it is compiled)."""
    if isinstance(obj, torch.nn.Module) and isinstance(value, Mapping):
        own = {plain_name(k): k for k in obj.state_dict(keep_vars=True)}
        if any(own_key != plain for plain, own_key in own.items()):
            value = type(value)((own.get(k, k), v) for k, v in value.items())
    obj.load_state_dict(value)
    if isinstance(obj, torch.utils.data.DataLoader):
        _settle_single_process_loader(obj, value)


def _settle_single_process_loader(loader: torch.utils.data.DataLoader, value: Any) -> None:
    """Put a single-process StatefulDataLoader's generator where the saved run had it.

    torchdata restores the shuffling sampler's generator to the epoch's start and draws the
    epoch's permutation again, but the saved run had also drawn the iterator's base seed
    after that permutation (torch's ``_BaseDataLoaderIter`` draws it after creating the
    sampler iterator): without that draw every epoch after the resumed one is shuffled
    differently. With workers, torchdata restores the base seed itself."""
    sampler_iter = value.get("_sampler_iter_state") if isinstance(value, Mapping) else None
    shuffled = isinstance(sampler_iter, Mapping) and isinstance(
        sampler_iter.get("sampler_iter_state"), Mapping) and \
        "generator" in sampler_iter["sampler_iter_state"]
    if not shuffled or loader.num_workers != 0 or loader.generator is None:
        return
    loader.state_dict()  # builds the resumed iterator now; the next iter() continues it
    torch.empty((), dtype=torch.int64).random_(generator=loader.generator)


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None))


@dataclass
class FlatState:
    """A state taken apart: tensors by key, aliases (tied tensors), and the JSON items."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    items: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The objects state_dict() returned (a module's own Parameters with keep_vars=True),
    # so an in-place load can hand them back to load_state_dict, whose copy_ then skips.
    originals: dict[str, torch.Tensor] = field(default_factory=dict)


class _Flattener:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.flat = FlatState()
        # first byte's address -> the first tensor stored from there (tensor, local piece,
        # key), or once another came, each one's identity -> key (see tensor())
        self._at: dict[int | None, tuple | dict[tuple, str]] = {}
        self._dtensor = dtensor_type()  # looked up once per state, not once per tensor

    def tensor(self, t: torch.Tensor, key: str) -> dict:
        # Runs once per tensor of a state (tens of thousands for an LLM's optimizer), where
        # each attribute read of a tensor costs about 0.1 us: none is read twice, and most
        # tensors need only their address.
        flat = self.flat
        if key in flat.tensors or key in flat.aliases:
            key = self._unique(key)
        if t.layout != torch.strided:  # sparse and other non-dense layouts
            raise UnsupportedValueError(f"{key}: only strided (dense) tensors can be saved", path=key)
        dtensor = self._dtensor
        local = t.to_local() if dtensor is not None and isinstance(t, dtensor) else t
        # Two names for the same memory (tied weights) are stored once, as an alias. Tensors
        # are told apart by their first byte's address, and by their whole description
        # (_identity) only when an address comes again: tied weights, views that start at
        # the same byte, empty tensors.
        try:
            address = local.data_ptr()
        except RuntimeError:  # no storage of its own (a wrapper subclass): described
            address = None
        same = self._at.get(address)
        if same is None:
            self._at[address] = (t, local, key)
        else:
            if isinstance(same, tuple):
                same = self._at[address] = {_identity(same[0], same[1]): same[2]}
            identity = _identity(t, local)
            if identity in same:
                flat.aliases[key] = same[identity]
                return {TENSOR: key}
            same[identity] = key
        # A plain tensor outside autograd is its own detached form (detach() costs
        # several microseconds a tensor).
        flat.tensors[key] = t if type(t) is torch.Tensor and not t.requires_grad else (
            t.detach())
        flat.originals[key] = t
        return {TENSOR: key}

    def _unique(self, key: str) -> str:
        base, n = key, 1
        while key in self.flat.tensors or key in self.flat.aliases:
            key, n = f"{base}~{n}", n + 1
        return key

    def encode(self, value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            return self.tensor(value, path)
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {FLOAT: repr(value)}
        if isinstance(value, dict) or isinstance(value, Mapping):  # (dict's check is cheaper)
            # (tensor values and int keys are told apart here, not in a call each: an
            # optimizer's state is thousands of them)
            encode, tensor, tensor_type = self.encode, self.tensor, torch.Tensor
            if TAGS.isdisjoint(value) and all(map(isinstance, value, repeat(str))):
                return {k: tensor(v, f"{path}/{k}") if isinstance(v, tensor_type)
                        else encode(v, f"{path}/{k}") for k, v in value.items()}
            return {DICT: [[k if type(k) is int else encode(k, f"{path}/key"),
                            tensor(v, f"{path}/{k}") if isinstance(v, tensor_type)
                            else encode(v, f"{path}/{k}")] for k, v in value.items()]}
        if isinstance(value, list):
            return [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {TUPLE: [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, (bytes, bytearray)):
            return {BYTES: base64.b64encode(value).decode()}
        numpy_value = _encode_numpy(self, value, path)
        if numpy_value is not None:
            return numpy_value
        if isinstance(value, torch.utils.data.DataLoader):
            raise UnsupportedValueError(
                f"{path}: a torch DataLoader has no saved position; use torchdata's "
                "StatefulDataLoader, or trainer.ResumableLoader over a trainer.ResumableSampler "
                "(docs/guide.md, 'Exact resume')", path=path)
        if self.allow_pickle:
            return {PICKLE: base64.b64encode(pickle.dumps(value)).decode()}
        raise UnsupportedValueError(
            f"{path}: a {type(value).__name__} is neither a tensor nor JSON data; convert it, "
            "give it state_dict()/load_state_dict(), or pass allow_pickle=True (unsafe for "
            "checkpoints from untrusted sources)", path=path)


def _identity(t: torch.Tensor, local: torch.Tensor) -> tuple:
    """What makes two tensors one (an alias): the same bytes seen the same way. No two empty
    tensors are one, nor two without storage of their own (wrapper subclasses)."""
    shape = tuple(local.shape)
    try:
        where = local.data_ptr() if 0 not in shape else id(t)
    except RuntimeError:
        where = id(t)
    return (shape if local is t else tuple(t.shape), local.device, local.dtype, t.is_conj(),
            t.is_neg(), where, shape, local.stride())


def _encode_numpy(flattener: _Flattener, value: Any, path: str) -> Any:
    try:
        import numpy as np
    except ImportError:
        return None
    if isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
        return {NDARRAY: flattener.tensor(torch.from_numpy(value.copy()), path)[TENSOR]}
    if isinstance(value, np.generic):
        return flattener.encode(value.item(), path)
    return None


def is_per_rank(obj: Any) -> bool:
    """Items whose value differs by rank (RNG state, :class:`PerRank`) are saved per rank."""
    return bool(getattr(obj, "ckpt_per_rank", False))


class PerRank:
    """A value that differs by rank, saved once per rank: a stateful object (anything with
    ``state_dict()``/``load_state_dict()``) or a plain value (tensors, tuples and dicts of
    them, numbers, strings: whatever a state's values may be).

    A stateful object is restored through its ``load_state_dict`` (``.obj`` is the object).
    A plain value is replaced: after a restore, ``.value`` holds this rank's saved value,
    bit-exact; a tensor in it moves to the device of the live value's tensor at the same
    place (a tuple's same position, a dict's same key), else it comes back on the CPU.

    Example::

        hidden = ckpt.PerRank((h, c))        # an LSTM's carried state, one per rank
        state = {"model": model, "hidden": hidden}
        mgr.restore(state)
        h, c = hidden.value

    On a different world size at load, rank r gets saved rank ``r % saved_world``'s value
    (its own when it existed).
    """

    ckpt_per_rank = True

    def __init__(self, obj: Any) -> None:
        self.stateful = is_stateful(obj)
        if self.stateful:
            self.obj = obj
        else:
            self.value = obj

    @property
    def ckpt_replaced(self) -> bool:
        """A plain value is replaced at restore, never read into (see ``flatten``)."""
        return not self.stateful

    def state_dict(self) -> Any:
        return self.obj.state_dict() if self.stateful else self.value

    def load_state_dict(self, state: Any) -> None:
        if self.stateful:
            self.obj.load_state_dict(state)
        else:
            self.value = _on_devices_of(state, self.value)

    def __repr__(self) -> str:
        held = self.obj if self.stateful else self.value
        return f"ckpt.PerRank({type(held).__name__})"


def _on_devices_of(new: Any, old: Any) -> Any:
    """``new`` with each tensor moved to the device of ``old``'s tensor at the same place."""
    if isinstance(new, torch.Tensor):
        return new.to(old.device) if isinstance(old, torch.Tensor) else new
    if isinstance(new, (tuple, list)) and isinstance(old, (tuple, list)) and \
            len(new) == len(old):
        return type(new)(_on_devices_of(n, o) for n, o in zip(new, old))
    if isinstance(new, dict) and isinstance(old, Mapping):
        return {k: _on_devices_of(v, old.get(k)) for k, v in new.items()}
    return new


def flatten(state: Mapping[str, Any], *, allow_pickle: bool = False, rank: int = 0,
            keep_vars: bool = False) -> FlatState:
    """Take ``state`` apart into tensors and JSON (calls ``state_dict()`` on stateful items).

    Tensors of per-rank items get keys under ``<item>@<rank>`` so ranks never collide.
    ``keep_vars``: the live state of a restore (the loads' read destinations): modules give
    their Parameters themselves, not detached views, and a :class:`PerRank` plain value
    gives no tensors (it is replaced by the saved one, whatever its shapes now).
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of items, not {type(state).__name__}")
    _warn_global_rng_loaders(state)
    _warn_stateless_shufflers(state)
    f = _Flattener(allow_pickle)
    with paused_gc():  # a leaf and a key per tensor: many small objects, no cycles
        for name, obj in state.items():
            _flatten_item(f, name, obj, rank, keep_vars)
    return f.flat


def _flatten_item(f: _Flattener, name: Any, obj: Any, rank: int, keep_vars: bool) -> None:
    if not isinstance(name, str) or not name or "/" in name:
        raise UnsupportedValueError(f"state keys must be non-empty strings without '/': {name!r}")
    if isinstance(obj, torch.Tensor):
        f.flat.items[name] = {"kind": "tensor", "tree": f.tensor(obj, name)}
    elif is_stateful(obj):
        kind = "module" if isinstance(obj, torch.nn.Module) else "stateful"
        sd = module_state_dict(obj, keep_vars) if kind == "module" else obj.state_dict()
        if is_per_rank(obj):
            replaced = keep_vars and getattr(obj, "ckpt_replaced", False)
            tree = None if replaced else f.encode(sd, f"{name}@{rank}")
            f.flat.items[name] = {"kind": kind, "per_rank": {str(rank): tree}}
        else:
            f.flat.items[name] = {"kind": kind, "tree": f.encode(sd, name)}
    else:
        f.flat.items[name] = {"kind": "value", "tree": f.encode(obj, name)}


def _warn_global_rng_loaders(state: Mapping[str, Any]) -> None:
    """Warn about a saved DataLoader that seeds its iterators from the global torch RNG
    while the state also restores that RNG: ``iter(loader)`` after ``restore()`` then draws
    from the restored stream, and the model's random stream shifts."""
    from ckpt._shared.rng import RNGState

    if not any(isinstance(obj, RNGState) for obj in state.values()):
        return
    for name, obj in state.items():
        if isinstance(obj, torch.utils.data.DataLoader) and is_stateful(obj) and \
                getattr(obj, "generator", False) is None:
            warnings.warn(
                f"'{name}': this DataLoader has no generator=, so each iter() draws a seed "
                "from the global torch RNG that ckpt.RNGState restores: after a resume the "
                "random stream (dropout, sampling) differs from an uninterrupted run. Pass "
                "generator=torch.Generator().manual_seed(SEED) (docs/guide.md, 'Exact "
                "resume')", RuntimeWarning, stacklevel=4)


_SHUFFLERS = (torch.utils.data.RandomSampler, torch.utils.data.SubsetRandomSampler,
              torch.utils.data.WeightedRandomSampler)


def _warn_stateless_shufflers(state: Mapping[str, Any]) -> None:
    """Warn about a saved DataLoader (a StatefulDataLoader) that shuffles with one of torch's
    samplers, which keep no state: torchdata resumes it by skipping batches of a permutation
    drawn afresh, so after a resume in a later epoch the order is not the saved run's. A
    sampler with ``set_epoch`` (Accelerate's seedable one) draws its order from the epoch."""
    for name, obj in state.items():
        if not (isinstance(obj, torch.utils.data.DataLoader) and is_stateful(obj)):
            continue
        sampler = getattr(obj.batch_sampler, "sampler", None) or obj.sampler
        if isinstance(sampler, _SHUFFLERS) and not is_stateful(sampler) and \
                not callable(getattr(sampler, "set_epoch", None)):
            warnings.warn(
                f"'{name}': its sampler ({type(sampler).__name__}) keeps no state, so after a "
                "resume torchdata skips the batches already seen in a permutation drawn "
                "afresh: from the second epoch on, not the saved run's order. Use "
                "shuffle=True with generator=torch.Generator().manual_seed(SEED) instead of "
                "sampler=, or a sampler with state_dict()/load_state_dict() (docs/guide.md, "
                "'Exact resume')", RuntimeWarning, stacklevel=4)


def decode(tree: Any, tensors: Mapping[str, torch.Tensor], *, allow_pickle: bool = False) -> Any:
    """Rebuild a value from its JSON tree; ``tensors`` supplies every ``__tensor__`` leaf."""
    if isinstance(tree, list):
        return [decode(v, tensors, allow_pickle=allow_pickle) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if len(tree) == 1:
        (tag, body), = tree.items()
        if tag == TENSOR:
            return tensors[body]
        if tag == NDARRAY:
            return tensors[body].numpy()
        if tag == TUPLE:
            return tuple(decode(v, tensors, allow_pickle=allow_pickle) for v in body)
        if tag == DICT:
            return {decode(k, tensors, allow_pickle=allow_pickle):
                    decode(v, tensors, allow_pickle=allow_pickle) for k, v in body}
        if tag == FLOAT:
            return float(body)
        if tag == BYTES:
            return base64.b64decode(body)
        if tag == PICKLE:
            if not allow_pickle:
                raise UnsupportedValueError(
                    "this checkpoint holds a pickled value; load it with allow_pickle=True "
                    "only if you trust where it came from")
            return pickle.loads(base64.b64decode(body))  # only past the allow_pickle check
    return {k: decode(v, tensors, allow_pickle=allow_pickle) for k, v in tree.items()}


def item_tree(item: Mapping[str, Any], rank: int = 0) -> Any:
    """An item's JSON tree; for a per-rank item, the tree of saved rank ``rank``."""
    per_rank = item.get("per_rank")
    if isinstance(per_rank, Mapping):  # a dict, or (format 2) trees read from rank tables
        return per_rank.get(str(rank))
    return item.get("tree")


def holds_pickle(tree: Any) -> bool:
    """Whether a JSON tree holds a pickled value anywhere."""
    if isinstance(tree, list):
        for v in tree:
            if holds_pickle(v):
                return True
        return False
    if not isinstance(tree, dict):
        return False
    if PICKLE in tree:
        return True
    for v in tree.values():
        if holds_pickle(v):
            return True
    return False


def tensor_keys(tree: Any) -> list[str]:
    """Every tensor key a JSON tree refers to, in tree order."""
    keys: list[str] = []
    _collect_keys(tree, keys)
    return keys


def _collect_keys(tree: Any, keys: list[str]) -> None:
    # Appends into one list: building a list per subtree made a deep tree quadratic.
    if isinstance(tree, list):
        for v in tree:
            _collect_keys(v, keys)
    elif isinstance(tree, dict):
        if len(tree) == 1:
            (tag, body), = tree.items()
            if tag == TENSOR or tag == NDARRAY:
                keys.append(body)
                return
        for v in tree.values():
            _collect_keys(v, keys)


def check_compatible(current: FlatState, saved_items: Mapping[str, dict],
                     saved_spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                     aliases: Mapping[str, str], source_rank: int = 0) -> None:
    """Raise StateMismatchError unless the saved items fit the state being restored.

    Every tensor the live state has must be saved with the same shape and dtype; a module's
    saved tensors must also all exist in the live module (strict, as load_state_dict is).
    """
    problems: list[str] = []
    for name, item in current.items.items():
        saved = saved_items.get(name)
        if saved is None:
            problems.append(f"'{name}' is not in the checkpoint (it has: {sorted(saved_items)})")
            continue
        if saved.get("kind") != item["kind"]:
            problems.append(f"'{name}' was saved as a {saved.get('kind')}, but is a {item['kind']} now")
            continue
        workers = _loader_workers(item_tree(saved, source_rank)), \
            _loader_workers(item_tree(item, source_rank))
        if None not in workers and workers[0] != workers[1]:
            problems.append(
                f"'{name}': a StatefulDataLoader saved with num_workers={workers[0]} cannot "
                f"continue with num_workers={workers[1]} (torchdata keeps its position per "
                f"worker): build it with num_workers={workers[0]} to resume, or restore a "
                f"state without '{name}' and start the data at a new epoch")
            continue
        live_keys = set(tensor_keys(item_tree(item, source_rank)))
        saved_keys = set(tensor_keys(item_tree(saved, source_rank)))
        missing = sorted(live_keys - saved_keys)
        if missing:
            problems.append(f"'{name}': missing from the checkpoint: {_few(missing)}")
        if item["kind"] in ("module", "tensor"):
            unexpected = sorted(saved_keys - live_keys)
            if unexpected:
                problems.append(f"'{name}': unexpected in the checkpoint: {_few(unexpected)}")
        for key in sorted(live_keys & saved_keys):
            live = current.tensors[current.aliases.get(key, key)]
            shape, dtype = saved_spec[aliases.get(key, key)]
            if tuple(live.shape) != shape:
                problems.append(f"{key}: checkpoint shape {list(shape)}, model shape {list(live.shape)}")
            elif live.dtype != dtype:
                problems.append(f"{key}: checkpoint dtype {dtype}, model dtype {live.dtype}")
    if problems:
        raise StateMismatchError(
            "the checkpoint does not match the state to restore; nothing was loaded:\n  "
            + "\n  ".join(problems[:50]) + (f"\n  ... and {len(problems) - 50} more"
                                            if len(problems) > 50 else "")
            + "".join(f"\n{advice}" for advice in _advice(problems)))


def _advice(problems: list[str]) -> list[str]:
    """What to do about the kinds of mismatch in ``problems``."""
    text = "\n".join(problems)
    advice = []
    if "missing from the checkpoint" in text or "unexpected in the checkpoint" in text \
            or "shape" in text:
        advice.append(
            "If layers were renamed, added or removed since the save: read the saved tensors "
            "with ckpt.load(path) (no state; mgr.load() for a manager's newest step), rename "
            "or drop what changed, and load them with load_state_dict(..., strict=False); "
            "or restore a state holding only the items that still match.")
    if "dtype" in text:
        advice.append(
            "If the model's dtype changed (fp32 -> bf16): restore into the model in the saved "
            "dtype (model.float()) and convert it after, or read the tensors with "
            "ckpt.load(path) and convert them.")
    if "is not in the checkpoint" in text:
        advice.append("Restore a state without the items the checkpoint lacks.")
    return advice


def _loader_workers(tree: Any) -> int | None:
    """The ``num_workers`` a torchdata StatefulDataLoader's saved state was taken with
    (None: not such a state)."""
    if not isinstance(tree, dict):
        return None
    if "_num_yielded" in tree and "_sampler_iter_state" in tree:
        return 0
    main = tree.get("_snapshot", {}).get("_main_snapshot") \
        if isinstance(tree.get("_snapshot"), dict) else None
    workers = main.get("_num_workers") if isinstance(main, dict) else None
    return workers if isinstance(workers, int) else None


def _few(keys: list[str], n: int = 8) -> str:
    return ", ".join(keys[:n]) + (f" (+{len(keys) - n} more)" if len(keys) > n else "")
