"""Validation of the items of a manifest and of their value trees (see ``tags``)."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from ckpt._format.bounds import MAX_DEPTH, Invalid, check, is_decimal
from ckpt._format.entries import TensorEntry
from ckpt._format.names import ITEM_KINDS, NUMPY_DTYPES, PER_RANK_IN_TABLES
from ckpt._format.tags import BYTES, DICT, FLOAT, NDARRAY, NON_FINITE, TAGS, TENSOR, TUPLE


def check_item(name: Any, item: Any, tensors: dict[str, TensorEntry],
               aliases: dict[str, str], in_tables: bool = False) -> None:
    """An item is ``{"kind", "tree"}`` or ``{"kind", "per_rank": {rank: tree}}``, and its
    trees are well formed (see :func:`check_tree`). With ``in_tables`` (format 2), a
    per-rank item may leave its trees to the rank tables."""
    what = f"item {name!r}"
    check(isinstance(item, dict), f"{what} must be an object")
    kind = item.get("kind")
    check(isinstance(kind, str) and kind in ITEM_KINDS,
          f"{what} has kind {kind!r}, not one of {list(ITEM_KINDS)}")
    if in_tables and item.get("per_rank") == PER_RANK_IN_TABLES:
        return  # each rank's tree is in its rank table, checked when the table is read
    if "per_rank" in item:
        per_rank = item["per_rank"]
        check(isinstance(per_rank, dict) and bool(per_rank)
              and all(is_decimal(r) for r in per_rank),
              f"{what}: per_rank must map rank numbers to trees")
        trees = list(per_rank.values())
    else:
        check("tree" in item, f"{what} has neither a tree nor per_rank trees")
        trees = [item["tree"]]
    for tree in trees:
        check_item_tree(what, kind, tree, tensors, aliases)


def check_item_tree(what: str, kind: str, tree: Any, tensors: dict[str, TensorEntry],
                    aliases: dict[str, str]) -> None:
    """One tree of an item of ``kind`` is well formed (raises Invalid naming ``what``)."""
    check_tree(tree, tensors, aliases, what)
    if kind == "tensor":
        check(isinstance(tree, dict) and len(tree) == 1 and TENSOR in tree,
              f"{what} is a tensor item, but its tree is not a tensor")
    if kind == "module":
        check(isinstance(tree, dict), f"{what}: a module's state must be an object")


def check_tree(tree: Any, tensors: dict[str, TensorEntry], aliases: dict[str, str],
               what: str = "tree") -> None:
    """A JSON tree of ckpt._shared.state's encoding is well formed: bounded depth, tags with
    bodies of the right type, every tensor it names stored. Iterative: a hostile tree cannot
    exhaust the stack. Raises Invalid for the caller to turn into corruption."""
    # Messages are built only on failure: a state's tree has a leaf per tensor.
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, list):
            if depth > MAX_DEPTH:
                raise Invalid(f"{what} nests deeper than {MAX_DEPTH} levels")
            stack.extend((v, depth + 1) for v in node)
            continue
        if not isinstance(node, dict):
            continue
        if depth > MAX_DEPTH:
            raise Invalid(f"{what} nests deeper than {MAX_DEPTH} levels")
        if len(node) != 1 or next(iter(node)) not in TAGS:
            stack.extend((v, depth + 1) for v in node.values())
            continue
        (tag, body), = node.items()
        if tag == TENSOR or tag == NDARRAY:
            if not (isinstance(body, str) and (body in tensors or body in aliases)):
                raise Invalid(f"{what} refers to tensor {body!r}, which the manifest does "
                              "not hold")
            if tag == NDARRAY:
                entry = tensors[aliases.get(body, body)]
                check(entry.dtype in NUMPY_DTYPES,
                      f"{what}: array {body!r} has dtype {entry.dtype}, which numpy lacks")
        elif tag == TUPLE:
            check(isinstance(body, list), f"{what}: a tuple's body must be a list")
            stack.extend((v, depth + 1) for v in body)
        elif tag == DICT:
            check(isinstance(body, list) and all(isinstance(p, list) and len(p) == 2
                                                 for p in body),
                  f"{what}: a dict's body must be a list of [key, value] pairs")
            stack.extend((v, depth + 2) for p in body for v in p)
            for k, _ in body:
                if not (k is None or isinstance(k, (bool, int, float, str))
                        or _is_hashable_tag(k)):
                    raise Invalid(f"{what}: dict key {str(k)[:40]!r} cannot be a key")
        elif tag == FLOAT:
            check(body in NON_FINITE, f"{what}: {str(body)[:40]!r} is not a non-finite float")
        elif tag == BYTES:
            check(isinstance(body, str) and _is_base64(body),
                  f"{what}: a bytes value must be base64 text")
        else:  # PICKLE: loaded only with allow_pickle (checked when loading)
            check(isinstance(body, str) and _is_base64(body),
                  f"{what}: a pickled value must be base64 text")


def nesting_depth(doc: Any) -> int:
    """How deeply ``doc`` (parsed JSON) nests lists and objects, without recursing; stops
    counting past MAX_DEPTH."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (list, dict)):
            deepest = max(deepest, depth)
            if depth > MAX_DEPTH:
                break
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict)
                                                  else node))
    return deepest


def _is_hashable_tag(key: Any, depth: int = 0) -> bool:
    """A dict key saved as a tagged value: a tuple (of hashables), bytes or a float tag."""
    if not (isinstance(key, dict) and len(key) == 1) or depth > MAX_DEPTH:
        return False
    (tag, body), = key.items()
    if tag == TUPLE:
        return isinstance(body, list) and all(
            k is None or isinstance(k, (bool, int, float, str)) or _is_hashable_tag(k, depth + 1)
            for k in body)
    return tag in (BYTES, FLOAT)


def _is_base64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True
