"""The format's vocabulary: versions, file and step-directory names, dtypes, codecs, item kinds."""

from __future__ import annotations

import re

import torch

from ckpt.errors import UnsupportedValueError

FORMAT_NAME = "ckpt"
FORMAT_VERSION = 1  # one JSON manifest holding every chunk (small worlds)
FORMAT_VERSION_TABLES = 2  # a top-level manifest plus one chunk table per rank
# Format 2: a per-rank item's "per_rank" is this marker; each rank's tree is in its table.
PER_RANK_IN_TABLES = "tables"
MANIFEST_NAME = "manifest.json"
STEP_PREFIX = "step-"
# Only the name step_dir() gives a step: another spelling of its number (step-000000005,
# step-5, other digits) would name the same step twice, and the collector would take the
# stray directory's state (no manifest) for the real step's and delete it. (Patterns end in
# \Z, not $, which also matches before a final newline, and spell digits [0-9]: \d also
# matches other scripts' digits, which int() reads.)
STEP_DIR = re.compile(r"step-([0-9]{8}|[1-9][0-9]{8,})\Z")

ITEM_KINDS = ("module", "stateful", "tensor", "value")
CODECS = ("raw", "zstd", "zstd-grouped")

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
        "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
        "float8_e8m0fnu", "float4_e2m1fn_x2",
    )
    if hasattr(torch, name)
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# The dtypes a saved numpy array may have (numpy has no bfloat16, float8, ...).
NUMPY_DTYPES = frozenset({"float64", "float32", "float16", "complex128", "complex64", "int64",
                          "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64",
                          "bool"})


def step_dir(step: int) -> str:
    """The directory name of a committed step."""
    return f"{STEP_PREFIX}{step:08d}"


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name of ``dtype``; refuses dtypes the format cannot store."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise UnsupportedValueError(
            f"tensors of dtype {dtype} cannot be checkpointed (quantized and other "
            "non-plain dtypes): dequantize or convert them first") from None
