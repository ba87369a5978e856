"""``ckpt diff``: which tensors and values changed between two steps, of one root or of two
(two runs, two ``ckpt.save`` directories), and how much.

Tensors are compared chunk by chunk when both steps cut them the same way (the usual case:
same model, same world size): a chunk whose digest is the same in both steps holds the same
bytes (xxh3-64: a collision has probability 2**-64) and B's copy is not read; A's is read
only when the tensor changed elsewhere, for the norm below. Memory stays at two chunks.
Tensors cut differently (another world size) are read whole, one tensor at a time. Every
chunk read is checked against its digest.

Per tensor: ``equal``; ``changed`` with the largest absolute difference, the relative L2
norm ``||B - A|| / ||A||`` and the number of elements that differ (NaN = NaN here), or with
the old and new shape/dtype; ``added`` or ``removed``. Plain values (every non-tensor leaf
of every item: epoch, learning rates, sampler positions, the probe's loss...) are compared
too, and listed by path when they differ. Optimizer state is also named by parameter
(``optim/state/mix.weight/exp_avg``) where a module of the same step has the optimizer's
parameters (:func:`ckpt.inspect.parameter_names`). A filter (shell-style patterns, matched
against tensor keys, those names and value paths) limits what is compared. Per-rank items
(``ckpt.RNGState``, ``ckpt.PerRank``) are named ``ITEM@RANK/...`` everywhere, tensors and
values alike, as in the manifest: ``--filter 'rng@*'`` selects every rank's, ``'rng@1/*'``
rank 1's.
"""

from __future__ import annotations

import fnmatch
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

import ckpt
from ckpt.inspect import Checkpoints, Chunk, Manifest, TensorEntry, named_tensors, plain_values


@dataclass
class TensorDiff:
    """How one tensor differs between step A and step B (shape/dtype are B's)."""

    key: str
    status: str  # equal | changed | added | removed
    shape: list[int] | None = None
    dtype: str | None = None
    old_shape: list[int] | None = None
    old_dtype: str | None = None
    numel: int | None = None
    changed_elements: int | None = None
    max_abs_diff: float | None = None
    rel_l2: float | None = None
    name: str | None = None  # optimizer state named by parameter, when it can be


@dataclass
class ValueDiff:
    """A plain value that differs (``a``/``b``: None when absent on that side)."""

    path: str
    a: Any
    b: Any


@dataclass
class StepDiff:
    """Everything that differs between step ``a`` of ``root`` and step ``b`` of ``other``
    (``other`` is ``root`` when both steps are of one root)."""

    root: str
    a: int
    b: int
    tensors: list[TensorDiff] = field(default_factory=list)
    values: list[ValueDiff] = field(default_factory=list)
    aliases: list[dict[str, Any]] = field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0
    other: str | None = None
    filters: list[str] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)  # filters that match no name at all

    def counts(self) -> dict[str, int]:
        out = {"equal": 0, "changed": 0, "added": 0, "removed": 0}
        for t in self.tensors:
            out[t.status] += 1
        return out

    @property
    def differs(self) -> bool:
        """Whether anything compared differs (a tensor, a value or an alias)."""
        return bool(self.values or self.aliases or any(t.status != "equal"
                                                       for t in self.tensors))

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["summary"] = {**self.counts(), "values": len(self.values)}
        doc["differ"] = self.differs
        return doc


class _Stats:
    """Running difference statistics over the pieces of one tensor."""

    def __init__(self) -> None:
        self.changed = 0
        self.max_abs = 0.0
        self.sq_diff = 0.0
        self.sq_a = 0.0

    def add(self, a: torch.Tensor, b: torch.Tensor | None) -> None:
        """``b`` None: the piece is equal (only A's norm grows)."""
        wide = torch.complex128 if a.is_complex() else torch.float64
        a64 = a.reshape(-1).to(wide)
        self.sq_a += float(a64.abs().square().sum())
        if b is None:
            return
        b64 = b.reshape(-1).to(wide)
        diff = (b64 - a64).abs()
        try:
            differs = a.reshape(-1) != b.reshape(-1)
        except (RuntimeError, TypeError):  # dtypes without comparison kernels (float8)
            differs = a64 != b64
        if a.is_floating_point() or a.is_complex():
            same_nan = torch.isnan(a64) & torch.isnan(b64)
            differs &= ~same_nan
            diff = torch.nan_to_num(diff.masked_fill(same_nan, 0.0), nan=math.inf)
        self.changed += int(differs.sum())
        if diff.numel():
            self.max_abs = max(self.max_abs, float(diff.max()))
            self.sq_diff += float(diff.square().sum())

    def rel_l2(self) -> float:
        if self.sq_diff == 0:
            return 0.0
        return math.sqrt(self.sq_diff) / math.sqrt(self.sq_a) if self.sq_a else math.inf


def diff_steps(source: Checkpoints | ckpt.CheckpointManager, a: int, b: int, *,
               threads: int = 4, other: Checkpoints | ckpt.CheckpointManager | None = None,
               filters: Sequence[str] = ()) -> StepDiff:
    """Compare step ``a`` of ``source`` with step ``b`` of ``other`` (default: ``source``).

    ``source``/``other``: checkpoints opened with :func:`ckpt.inspect.open` (a root or one
    checkpoint directory) or open managers. ``filters``: shell-style patterns (``model/*``,
    ``*exp_avg*``); when given, only tensors whose key or name matches one, and values
    whose path matches one, are compared.

    Raises:
        CheckpointNotFoundError: a step does not exist.
        CorruptCheckpointError: a manifest is invalid, a file is missing or shorter than
            recorded, or a chunk read fails its digest.
    """
    t0 = time.perf_counter()
    side_a = _open(source)
    side_b = side_a if other is None else _open(other)
    side_a.require(a)
    side_b.require(b)
    ma, mb = side_a.manifest(a), side_b.manifest(b)
    # Sizes and byte ranges checked before any buffer is sized from a manifest's shapes.
    side_a.check_structure(a, ma)
    side_b.check_structure(b, mb)
    result = StepDiff(side_a.url, a, b, other=None if other is None else side_b.url,
                      filters=list(filters))
    names = {**named_tensors(ma), **named_tensors(mb)}

    def wanted(*texts: str | None) -> bool:
        return not filters or any(t is not None and fnmatch.fnmatchcase(t, f)
                                  for t in texts for f in filters)

    if filters:  # a pattern that names nothing of either step is most likely mistyped
        every = {*ma.tensors, *mb.tensors, *names.values(), *ma.aliases, *mb.aliases,
                 *ma.items, *mb.items, *user_metadata(ma), *user_metadata(mb)}
        for m in (ma, mb):
            for name, item in m.items.items():
                every.update(item_values(name, item))
        result.unmatched = [f for f in filters
                            if not any(fnmatch.fnmatchcase(n, f) for n in every if n)]
    reader = _Reader(side_a, a, ma, side_b, b, mb, threads)
    for key in sorted(set(ma.tensors) | set(mb.tensors)):
        if wanted(key, names.get(key)):
            d = _tensor_diff(key, ma.tensors.get(key), mb.tensors.get(key), reader)
            d.name = names.get(key)
            result.tensors.append(d)
    for key in sorted(set(ma.aliases) | set(mb.aliases)):
        if ma.aliases.get(key) != mb.aliases.get(key) and wanted(key):
            result.aliases.append({"key": key, "a": ma.aliases.get(key), "b": mb.aliases.get(key)})
    result.values = [v for v in diff_values(ma, mb) if wanted(v.path)]
    result.bytes_read = reader.bytes_read
    result.seconds = time.perf_counter() - t0
    return result


def _open(source: Checkpoints | ckpt.CheckpointManager) -> Checkpoints:
    return source if isinstance(source, Checkpoints) else ckpt.inspect.open(source)


class _Reader:
    """Reads chunks and whole tensors of the two steps, counting the bytes."""

    def __init__(self, cps_a: Checkpoints, a: int, ma: Manifest, cps_b: Checkpoints, b: int,
                 mb: Manifest, threads: int) -> None:
        self.threads, self.bytes_read = threads, 0
        self.sides = {"a": (cps_a, a, ma), "b": (cps_b, b, mb)}

    def chunk(self, side: str, key: str, chunk: Chunk) -> torch.Tensor:
        cps, step, manifest = self.sides[side]
        out = torch.empty(chunk.shape, dtype=manifest.tensors[key].torch_dtype)
        cps.read_chunk(step, key, chunk, out)
        self.bytes_read += chunk.length
        return out

    def whole(self, side: str, key: str) -> torch.Tensor:
        import concurrent.futures as cf

        cps, step, manifest = self.sides[side]
        with cf.ThreadPoolExecutor(self.threads) as pool:
            out = cps.read_tensor(step, key, manifest, pool)
        self.bytes_read += sum(c.length for c in manifest.tensors[key].chunks)
        return out


def _tensor_diff(key: str, ea: TensorEntry | None, eb: TensorEntry | None,
                 reader: _Reader) -> TensorDiff:
    if ea is None or eb is None:
        e = eb or ea
        return TensorDiff(key, "added" if ea is None else "removed", list(e.shape), e.dtype,
                          numel=math.prod(e.shape))
    d = TensorDiff(key, "equal", list(eb.shape), eb.dtype, numel=math.prod(eb.shape))
    if ea.shape != eb.shape or ea.dtype != eb.dtype:
        d.status, d.old_shape, d.old_dtype = "changed", list(ea.shape), ea.dtype
        return d
    stats = _Stats()
    boxes_a = [(c.offsets, c.shape) for c in ea.chunks]
    if boxes_a == [(c.offsets, c.shape) for c in eb.chunks]:
        if all(ca.digest == cb.digest for ca, cb in zip(ea.chunks, eb.chunks)):
            d.changed_elements, d.max_abs_diff, d.rel_l2 = 0, 0.0, 0.0
            return d
        for ca, cb in zip(ea.chunks, eb.chunks):
            same = ca.digest == cb.digest
            stats.add(reader.chunk("a", key, ca), None if same else reader.chunk("b", key, cb))
    else:
        stats.add(reader.whole("a", key), reader.whole("b", key))
    d.changed_elements, d.max_abs_diff, d.rel_l2 = stats.changed, stats.max_abs, stats.rel_l2()
    if stats.changed or stats.max_abs:  # -0.0 vs 0.0: bytes differ, values do not
        d.status = "changed"
    return d


def item_values(name: str, item: dict) -> dict[str, Any]:
    """The plain values of one item by path (``optim/param_groups/0/lr``); a per-rank item's
    under ``NAME@RANK/`` for each saved rank (``rng@0/python/...``), the manifest's spelling
    of its tensors (``rng@0/torch``). Format 2 reads per-rank trees from the rank tables."""
    per_rank = item.get("per_rank")
    if per_rank is None:
        return plain_values(item.get("tree"), name)
    out: dict[str, Any] = {}
    for rank, tree in per_rank.items():
        out.update(plain_values(tree, f"{name}@{rank}"))
    return out


def diff_values(ma: Manifest, mb: Manifest) -> list[ValueDiff]:
    """Plain values that differ: every non-tensor leaf of every item, and user metadata,
    by the paths ``ckpt inspect`` shows (:func:`ckpt.inspect.plain_values`)."""
    out: list[ValueDiff] = []
    for name in sorted(set(ma.items) | set(mb.items)):
        ia, ib = ma.items.get(name), mb.items.get(name)
        if ia is None or ib is None:
            out.append(ValueDiff(name, _kind(ia), _kind(ib)))
        elif ia.get("kind") != ib.get("kind"):
            out.append(ValueDiff(f"{name} (kind)", ia.get("kind"), ib.get("kind")))
        else:
            out += _differing(item_values(name, ia), item_values(name, ib))
    out += _differing(user_metadata(ma), user_metadata(mb))
    return out


def user_metadata(manifest: Manifest) -> dict[str, Any]:
    """The step's metadata as plain values under ``metadata/`` (``save(..., metrics=...)``,
    user keys), without ckpt's own ``ckpt_*`` keys."""
    meta = {k: v for k, v in manifest.metadata.items() if not k.startswith("ckpt_")}
    return plain_values(meta, "metadata") if meta else {}


def _kind(item: dict | None) -> Any:
    """An item present on one side only: a value item's value, else its kind."""
    if item is None:
        return None
    return item.get("tree") if item.get("kind") == "value" else f"<{item.get('kind')} item>"


def _differing(a: dict[str, Any], b: dict[str, Any]) -> list[ValueDiff]:
    """The paths whose values differ (or exist on one side only), in A's order then B's."""
    return [ValueDiff(path, a.get(path), b.get(path))
            for path in [*a, *(p for p in b if p not in a)]
            if path not in a or path not in b or not _same(a[path], b[path])]


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True  # NaN = NaN here, as for tensors
    return type(x) is type(y) and x == y
