"""The tags of a value tree: how a state's values that JSON lacks are spelled in a manifest.

Inside an item, a tensor is the leaf ``{TENSOR: key}`` and a numpy array ``{NDARRAY: key}``;
tuples, dicts whose keys are not all strings, non-finite floats, bytes and (when allowed)
pickled objects are one-key objects tagged the same way. ``ckpt._shared.state`` writes and
reads them; ``ckpt._format.tree`` validates them.
"""

from __future__ import annotations

TENSOR = "__tensor__"
NDARRAY = "__ndarray__"
TUPLE = "__tuple__"
DICT = "__dict__"
FLOAT = "__float__"
BYTES = "__bytes__"
PICKLE = "__pickle__"

TAGS = frozenset({TENSOR, NDARRAY, TUPLE, DICT, FLOAT, BYTES, PICKLE})
NON_FINITE = ("inf", "-inf", "nan")  # the bodies of FLOAT
